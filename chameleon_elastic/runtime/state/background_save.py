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

import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..world.groups import side_group
from .checkpoint import checkpoint_state, commit, step_dir
from .snapshots import SLOW_SETTLE_S

__all__ = ["BackgroundSave", "ensure_save_group"]

log = logging.getLogger("chameleon_elastic.runtime.state.background_save")


def ensure_save_group(trainer: Any) -> Any:
    """The plan's gloo group over the whole world for background saves, made at its first
    save (collective: every rank saves at the same steps), so that entering a plan, and a
    job without checkpoints, never pays for it. Its sockets join those the watchdog may shut
    (:mod:`.abort`)."""
    if trainer.save_group is None:
        trainer.save_group = side_group(trainer, "checkpoint")
    return trainer.save_group


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
        import torch.distributed.checkpoint as dcp  # see dcp_parts

        from .dcp_parts import OnTheCPU, Yielding

        group = ensure_save_group(trainer)
        state = checkpoint_state(trainer, step)
        future = dcp.async_save(state, storage_writer=Yielding(step_dir(directory, step)),
                                process_group=group, async_stager=OnTheCPU())
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
        began = time.perf_counter()
        if not self._settled.wait(timeout_s):
            log.warning("checkpoint %d: still writing after %s s; not waiting longer",
                        self.step, timeout_s)
            self.coordinator = False
            return False
        waited = time.perf_counter() - began
        if waited > SLOW_SETTLE_S:
            log.warning("checkpoint %d: took %.1f s to end after the failure (%s)", self.step,
                        waited, "written" if self.ok else "not committed")
        return self.ok
