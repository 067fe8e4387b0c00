"""Checkpoints in torch.distributed.checkpoint (DCP) format, keyed by the model's own names.

A plan change (re-plan after a failure, restart by the launcher) moves layers between devices,
so a checkpoint is stored per parameter, not per rank: ``step-<N>/`` is a DCP directory whose
keys are

- ``<name>``: every parameter and buffer under its model-wide name
  (``PipelineModel.parameter_name``: ``layers.3.attn.weight``, or transformers' names), whole
  tensors;
- ``optimizer.<name>.<key>``: the optimizer's state of that parameter (Adam's moments, ...);
- ``extra.<layer>.<object>.<key>`` and ``job.<object>.<key>``: the script's registered objects
  (:mod:`.user_state`);
- ``trainer.step``, ``trainer.loss_scale``, ``trainer.loss_scale_good``: 0-d tensors (the
  learning-rate schedule needs nothing: it is replayed up to the checkpoint's step);
- ``layout.<layer>``: a JSON string, the layer's names in order (what :func:`load_layers`
  needs to rebuild a layer's state without the model).

Every holder of a layer has identical weights after the gradient sync, so only one writes it:
the lowest device id among its holders (under tensor parallelism its unit gathers the whole
tensors and its card 0 writes them, so a checkpoint loads under any degree). Plain
``torch.distributed.checkpoint.load`` in one process reads any subset of the keys.

Commit protocol: DCP writes ``.metadata`` only after every rank's files are written (its
coordinator gathers every writer's result first); then rank 0 atomically replaces ``latest``
with ``N`` and deletes older step directories. A crash before ``latest`` moves leaves the
previous checkpoint in force, so a loader never sees a mix of two steps. Saving in the
background (:mod:`.background_save`) keeps that guarantee. Loading never unpickles: tensors are
read as tensors and the few plain values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerLost, PipelineRuntimeError
from ..precision import LossScale, Precision
from .carry_over import move_schedule
from .layer_state import LayerState, export_layer, import_layer
from .user_state import copy_state, load_states

__all__ = ["checkpoint_state", "commit", "latest_step", "load_checkpoint", "load_job_states",
           "load_layers", "load_loss_scale", "save_checkpoint", "saved_layers",
           "step_dir"]


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step}"


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


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        Path(tmp).write_text(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_state(trainer: Any, step: int) -> dict[str, Any]:
    """This rank's share of the checkpoint after ``step`` steps: the layers it writes (their
    lowest holder's card 0; under tensor parallelism a collective over the unit) and, on rank
    0, the job-wide state. Detached copies: training may go on while they are written."""
    name = trainer.model.parameter_name
    out: dict[str, Any] = {}
    optimizer, extra, layout = {}, {}, {}
    for layer, module in sorted(trainer.layers.items()):
        if min(trainer.holders[layer]) != trainer.device:
            continue
        # whole tensors: the unit gathers its shards (every card takes part), card 0 writes
        state = export_layer(layer, module, trainer.optimizer, whole=True,
                             extras=trainer.extras.get(layer))
        if trainer.tp_rank:
            continue
        names = {k: name(layer, k) for k in state.params}
        out.update({names[k]: v for k, v in state.params.items()})
        parameters = [k for k, _ in module.named_parameters()]
        for k, entry in zip(parameters, state.optimizer):
            if entry:
                optimizer[name(layer, k)] = entry
        if state.extra:
            extra[str(layer)] = state.extra
        layout[str(layer)] = json.dumps({"names": names, "parameters": parameters})
    out.update(optimizer=optimizer, extra=extra, layout=layout)
    if dist.get_rank() == 0:   # every rank holds the same scale and job-wide state
        scale = trainer.loss_scale
        out["trainer"] = {"step": torch.tensor(step), "loss_scale": torch.tensor(scale.scale,
                          dtype=torch.float64), "loss_scale_good": torch.tensor(scale.good)}
        out["job"] = copy_state(trainer.job_state)
    return {k: v for k, v in out.items() if not isinstance(v, dict) or v}


def commit(directory: str | Path, step: int) -> None:
    """Rank 0, once every writer of ``step`` has finished: move ``latest`` and delete older
    step directories."""
    directory = Path(directory)
    _atomic_write(directory / "latest", f"{step}\n")
    for old in directory.glob("step-*"):
        if old != step_dir(directory, step) and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(trainer: Any, directory: str | Path, step: int) -> None:
    """Commit the state after ``step`` completed steps, and return when it is committed
    (collective over the world; ``trainer.run`` saves in the background instead). A peer lost
    meanwhile raises :class:`~.errors.PeerLost`; the previous checkpoint then stays in force."""
    if trainer.saving is not None:
        trainer.saving.settle()
    import torch.distributed.checkpoint as dcp  # see dcp_parts

    state = checkpoint_state(trainer, step)
    try:
        dcp.save(state, checkpoint_id=step_dir(directory, step))
    except RuntimeError as exc:
        raise PeerLost(f"device {trainer.device} lost a peer while writing checkpoint "
                       f"{step}: {exc}") from exc
    if dist.get_rank() == 0:
        commit(directory, step)
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise PeerLost(f"device {trainer.device} lost a peer while committing a checkpoint: "
                       f"{exc}") from exc


# --------------------------------------------------------------------------- reading


def _metadata(directory: str | Path, step: int):
    source = step_dir(directory, step)
    if not (source / ".metadata").is_file():
        if any(source.glob("layer-*.pt")):
            raise PipelineRuntimeError(
                f"{source} is a checkpoint in the old per-layer format (layer-<i>.pt), which "
                "this version does not read; start with a new checkpoint directory (or resume "
                "it with the version that wrote it).")
        raise PipelineRuntimeError(
            f"checkpoint step {step} in {directory} has no {source / '.metadata'}; it is "
            "damaged: delete the checkpoint directory to start afresh.")
    from torch.distributed.checkpoint import FileSystemReader  # see dcp_parts

    return FileSystemReader(str(source)).read_metadata()


def _request(metadata, wanted) -> dict[str, Any]:
    """A state dict to load into: every saved entry whose key path ``wanted(path)`` accepts,
    nested as it was saved, tensors allocated from the metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for fqn, path in metadata.planner_data.items():
        if not wanted(path):
            continue
        meta = metadata.state_dict_metadata[fqn]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                          if isinstance(meta, TensorStorageMetadata) else None)
    return out


def _read(directory: str | Path, step: int, wanted) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from .dcp_parts import SafeLoadPlanner

    metadata = _metadata(directory, step)
    request = _request(metadata, wanted)
    if request:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, checkpoint_id=str(step_dir(directory, step)),
                     planner=SafeLoadPlanner(), no_dist=True)
    return request


def saved_layers(directory: str | Path, step: int) -> list[int]:
    """The layers checkpoint ``step`` holds."""
    paths = _metadata(directory, step).planner_data.values()
    return sorted(int(p[1]) for p in paths if p[0] == "layout")


def load_layers(directory: str | Path, step: int, layers: Iterable[int]) -> dict[int, LayerState]:
    """The states of ``layers`` in checkpoint ``step``: parameters by their names inside the
    layer, optimizer state in ``parameters()`` order, registered objects."""
    keys = {str(x) for x in layers}
    found = _read(directory, step, lambda p: p[0] == "layout" and p[1] in keys).get("layout", {})
    missing = sorted(keys - set(found), key=int)
    if missing:
        raise PipelineRuntimeError(
            f"checkpoint step {step} holds no layer {missing[0]}; it was written for a model "
            "with fewer layers or is damaged: delete the checkpoint directory to start afresh.")
    layouts = {int(x): json.loads(text) for x, text in found.items()}
    names = {n for lay in layouts.values() for n in lay["names"].values()}
    state = _read(directory, step, lambda p: (len(p) == 1 and p[0] in names)
                  or (p[0] == "optimizer" and p[1] in names)
                  or (p[0] == "extra" and p[1] in keys))
    out = {}
    for layer, lay in layouts.items():
        full = {k: state[n] for k, n in lay["names"].items()}
        optimizer = [dict(state.get("optimizer", {}).get(lay["names"][k], {}))
                     for k in lay["parameters"]]
        out[layer] = LayerState(layer, full, optimizer, state.get("extra", {}).get(str(layer), {}))
    return out


def load_job_states(directory: str | Path, step: int) -> dict[str, dict]:
    """The registered job-wide objects' states at checkpoint ``step``."""
    return _read(directory, step, lambda p: p[0] == "job").get("job", {})


def load_loss_scale(directory: str | Path, step: int, precision: Precision) -> LossScale:
    """fp16's loss scale at checkpoint ``step`` (any other precision: its starting scale)."""
    fresh = LossScale.for_precision(precision)
    if fresh.fixed:
        return fresh
    saved = _read(directory, step, lambda p: p[0] == "trainer").get("trainer", {})
    if "loss_scale" not in saved:
        return fresh
    return LossScale(float(saved["loss_scale"]), int(saved["loss_scale_good"]), fixed=False)


def load_checkpoint(trainer: Any, directory: str | Path) -> int:
    """Load this device's layers and optimizer state from the last committed checkpoint;
    returns the number of completed steps (0 when there is no checkpoint). Every rank must call
    it, on a trainer that has not trained yet (trainer.run resumes from checkpoints itself)."""
    step = latest_step(directory)
    if step is None:
        return 0
    for layer, state in load_layers(directory, step, trainer.layers).items():
        import_layer(state, trainer.layers[layer], trainer.optimizer)
        load_states(trainer.extras.get(layer, {}), state.extra, f"layer {layer}'s state")
    load_states(trainer.job_state, load_job_states(directory, step), f"checkpoint step {step}")
    trainer.committed = step
    trainer.loss_scale = load_loss_scale(directory, step, trainer.precision)
    trainer.scheduler = move_schedule(trainer.model, trainer.scheduler, trainer.optimizer, None,
                                      step)
    return step
