"""Layer-wise checkpoints that a different plan can load.

A plan change (re-plan after a failure, restart by the launcher) moves layers between devices,
so a checkpoint is stored per layer, not per rank: ``step-<N>/layer-<i>.pt`` holds layer
``i``'s parameters and its optimizer state (one dict per parameter, in ``parameters()``
order). Every holder of a layer has identical weights after the gradient sync, so only one
writes it: the lowest device id among its holders (under tensor parallelism its unit gathers the
whole tensors and its card 0 writes them, so a checkpoint loads under any degree). The little
per-step state that is not a layer's lives beside them in ``trainer.json`` (fp16's loss scale;
the learning-rate schedule needs nothing, it is replayed up to the checkpoint's step).

Commit protocol: each writer saves to a temporary name and renames (a file is whole or absent);
then all ranks meet at a barrier; then rank 0 atomically replaces ``latest`` with ``N`` and
deletes older step directories. A crash before ``latest`` moves leaves the previous checkpoint
in force, so a loader never sees a mix of two steps. Files are read with
``torch.load(weights_only=True)``: plain tensors and containers, never arbitrary pickles.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from .carry_over import move_schedule
from .errors import PeerLost, PipelineRuntimeError
from .layer_state import LayerState, export_layer, import_layer
from .precision import LossScale, Precision
from .user_state import copy_state, load_states

__all__ = ["latest_step", "load_checkpoint", "load_job_states", "load_layers", "load_loss_scale",
           "save_checkpoint"]


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step}"


def latest_step(directory: str | Path) -> int | None:
    """The last committed step in ``directory``, or None when there is none."""
    marker = Path(directory) / "latest"
    try:
        return int(marker.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise PipelineRuntimeError(
            f"{marker} does not hold a step number; delete the checkpoint directory or fix "
            "the file."
        ) from exc


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(trainer, directory: str | Path, step: int) -> None:
    """Commit the state after ``step`` completed steps (collective over the world). A peer lost
    meanwhile raises :class:`~.errors.PeerLost`; the previous checkpoint then stays in force."""
    directory = Path(directory)
    target = _step_dir(directory, step)
    target.mkdir(parents=True, exist_ok=True)
    for layer, module in sorted(trainer.layers.items()):
        if min(trainer.holders[layer]) != trainer.device:
            continue
        # whole tensors: the unit gathers its shards (every card takes part), card 0 writes
        state = export_layer(layer, module, trainer.optimizer, whole=True,
                             extras=trainer.extras.get(layer)).to_dict()
        if trainer.tp_rank == 0:
            _atomic_write(target / f"layer-{layer}.pt", lambda tmp, s=state: torch.save(s, tmp))
    if dist.get_rank() == 0:   # every rank holds the same scale
        scale = trainer.loss_scale
        text = json.dumps({"loss_scale": scale.scale, "loss_scale_good": scale.good})
        _atomic_write(target / "trainer.json", lambda tmp: Path(tmp).write_text(text))
        if trainer.job_state:
            states = copy_state(trainer.job_state)
            _atomic_write(target / "job-state.pt", lambda tmp: torch.save(states, tmp))
    _barrier(trainer.device)
    if dist.get_rank() == 0:
        _atomic_write(directory / "latest", lambda tmp: Path(tmp).write_text(f"{step}\n"))
        for old in directory.glob("step-*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    _barrier(trainer.device)


def _barrier(device: int) -> None:
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise PeerLost(f"device {device} lost a peer while committing a checkpoint: "
                       f"{exc}") from exc


def load_layers(directory: str | Path, step: int, layers: Iterable[int]) -> dict[int, LayerState]:
    """The states of ``layers`` in checkpoint ``step`` (weights_only: plain tensors)."""
    source = _step_dir(Path(directory), step)
    out = {}
    for layer in layers:
        path = source / f"layer-{layer}.pt"
        try:
            out[layer] = LayerState.from_dict(torch.load(path, weights_only=True))
        except FileNotFoundError as exc:
            raise PipelineRuntimeError(
                f"checkpoint step {step} has no {path.name}; it was written for a model with "
                "fewer layers or is damaged: delete the checkpoint directory to start afresh."
            ) from exc
    return out


def load_job_states(directory: str | Path, step: int) -> dict[str, dict]:
    """The registered job-wide objects' states at checkpoint ``step`` (none saved: empty)."""
    try:
        return torch.load(_step_dir(Path(directory), step) / "job-state.pt", weights_only=True)
    except FileNotFoundError:
        return {}


def load_loss_scale(directory: str | Path, step: int, precision: Precision) -> LossScale:
    """fp16's loss scale at checkpoint ``step`` (a checkpoint written without one, or any other
    precision: the precision's starting scale)."""
    fresh = LossScale.for_precision(precision)
    if fresh.fixed:
        return fresh
    try:
        saved = json.loads((_step_dir(Path(directory), step) / "trainer.json").read_text())
        return LossScale(float(saved["loss_scale"]), int(saved["loss_scale_good"]), fixed=False)
    except (OSError, ValueError, KeyError, TypeError):
        return fresh


def load_checkpoint(trainer, directory: str | Path) -> int:
    """Load this device's layers and optimizer state from the last committed checkpoint;
    returns the number of completed steps (0 when there is no checkpoint). Every rank must call
    it, on a trainer that has not trained yet (trainer.run resumes from checkpoints itself)."""
    step = latest_step(directory)
    if step is None:
        return 0
    for layer, state in load_layers(directory, step, trainer.layers).items():
        import_layer(state, trainer.layers[layer], trainer.optimizer)
        load_states(trainer.extras.get(layer, {}), state.extra, f"layer {layer}'s state")
    load_states(trainer.job_state, load_job_states(directory, step),
                   f"checkpoint step {step}")
    trainer.committed = step
    trainer.loss_scale = load_loss_scale(directory, step, trainer.precision)
    trainer.scheduler = move_schedule(trainer.model, trainer.scheduler, trainer.optimizer, None,
                                      step)
    return step
