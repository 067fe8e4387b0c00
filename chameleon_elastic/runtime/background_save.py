"""Writing a checkpoint while training goes on.

The step that starts a save only copies this rank's share of the state (:func:`~.checkpoint.
checkpoint_state`: detached copies, on the CPU); DCP's background thread then plans, writes the
files and, once every rank's files are written, the ``.metadata`` (its coordinator gathers every
writer's result first). Only then does rank 0 move ``latest`` (:func:`~.checkpoint.commit`), so
a checkpoint is committed only when every writer has finished, as with a synchronous save.

Why a process group of its own: DCP's planning and completion are collectives, run from the
background thread while the training thread runs its own collectives. Two threads must never
share a gloo group, so every plan generation has one more group over the whole world, used by
saves only and made at the plan's first save (:func:`ensure_save_group`). A recovery settles
the save in flight before it destroys the groups: a save that a lost peer broke is not
committed and the previous checkpoint stays in force.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from .abort import new_sockets
from .checkpoint import checkpoint_state, commit, step_dir
from .errors import PeerLost

__all__ = ["BackgroundSave", "ensure_save_group"]

log = logging.getLogger("chameleon_elastic.runtime.background_save")


def ensure_save_group(trainer: Any) -> Any:
    """The plan's gloo group over the whole world for background saves, made at its first
    save (collective: every rank saves at the same steps), so that entering a plan, and a
    job without checkpoints, never pays for it. Its sockets join those the watchdog may shut
    (:mod:`.abort`)."""
    if trainer.save_group is None:
        with new_sockets() as sockets:
            try:
                trainer.save_group = dist.new_group(
                    list(range(dist.get_world_size())),
                    timeout=trainer.timeouts.delta("collective_s"), backend="gloo")
            except RuntimeError as exc:
                raise PeerLost(f"cannot create the checkpoint group: {exc}") from exc
        trainer.group_sockets = trainer.group_sockets | frozenset(sockets)
        if trainer.recovery is not None:
            trainer.recovery.arm()
    return trainer.save_group


class _Yielding(dcp.FileSystemWriter):
    """DCP's file writer, whose thread yields the CPU to training: the background save runs at
    the lowest priority (on Linux a thread has its own nice value), so it takes the cores the
    training thread leaves idle rather than slowing its steps."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # the first call DCP makes in its background thread
        with contextlib.suppress(AttributeError, OSError):   # not Linux: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


class _OnTheCPU(AsyncStager):
    """The state is already a detached copy: staging only moves accelerator tensors to the
    CPU (the default stager would copy every tensor once more)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        def cpu(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: cpu(v) for k, v in value.items()}
            return value.cpu() if isinstance(value, torch.Tensor) else value
        return cpu(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class BackgroundSave:
    """One checkpoint being written in the background (every rank holds one)."""

    def __init__(self, future: Future, directory: Path, step: int, coordinator: bool) -> None:
        self.directory, self.step, self.coordinator = directory, step, coordinator
        self._settled = threading.Event()
        self.ok = False
        self.told = False   # the agent heard of the commit (trainer.run)
        future.add_done_callback(self._finish)

    @classmethod
    def start(cls, trainer: Any, directory: str | Path, step: int) -> BackgroundSave:
        """Copy this rank's share of the state after ``step`` steps and hand it to DCP's
        background thread (collective over the world)."""
        group = ensure_save_group(trainer)
        state = checkpoint_state(trainer, step)
        future = dcp.async_save(state, storage_writer=_Yielding(step_dir(directory, step)),
                                process_group=group, async_stager=_OnTheCPU())
        return cls(future, Path(directory), step, dist.get_rank() == 0)

    def _finish(self, future: Future) -> None:
        """In the background thread: rank 0 commits a save every rank finished."""
        try:
            error = future.exception()
            if error is None and self.coordinator:
                commit(self.directory, self.step)
            self.ok = error is None
            if error is not None:
                log.info("checkpoint %d not committed: %s", self.step,
                         str(error).splitlines()[0] if str(error) else type(error).__name__)
        except Exception as exc:   # noqa: BLE001 - a failed commit leaves the previous one
            log.warning("checkpoint %d not committed: %s", self.step, exc)
        finally:
            self._settled.set()

    def done(self) -> bool:
        return self._settled.is_set()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until the save ended (at most ``timeout_s``); whether it was committed (on rank
        0) or written (on the others). A save still running after the timeout counts as
        failed: it is never committed by a later call."""
        if not self._settled.wait(timeout_s):
            log.warning("checkpoint %d: still writing after %s s; not waiting longer",
                        self.step, timeout_s)
            self.coordinator = False
            return False
        return self.ok
