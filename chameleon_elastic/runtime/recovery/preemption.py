"""Stopping for a preemption at a step boundary, with a checkpoint, on every rank alike.

Who asks, and how every rank learns it at the same step. A preemption reaches a worker in one
of two ways: its agent received SIGTERM (or a signal of ``--signals-to-handle`` such as
SIGUSR1) and wrote the channel's ``stop`` key, which the worker's beat thread reads every
0.1 s; or the worker itself received SIGUSR1/SIGUSR2 (Slurm's ``--signal`` reaches every
process of a job step) and its handler, installed here, notes it. Either only sets
:attr:`Preemption.requested` on this rank. The ranks learn it together from the step's vote
(runtime/execution/step.py adds the flag to the all-reduce that commits the step): a step whose vote
carries the flag is the last, on every rank, so they stop at the same boundary whatever moment
each was told. Then :func:`stop_here` (``PipelineTrainer.run``): the checkpoint in flight is
settled, a checkpoint of the committed steps is written and committed (collective), and the
process exits with ``ExitStatus.PREEMPTED``; the same command resumes at the next step.

SIGTERM sent to a worker itself keeps its meaning (stop now), as under torchrun: the agent
stops workers with it, and a worker that ignored it would stall every relaunch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from chameleon_elastic.exit_status import ExitStatus

from ..state.background_save import BackgroundSave

__all__ = ["Preemption", "stop_here"]

#: signals a worker may receive straight from a scheduler and turn into a stop request
_WORKER_SIGNALS = ("SIGUSR1", "SIGUSR2")


class Preemption:
    """This rank's stop request (``requested``) and the job's agreement on it (``agreed``,
    set by the vote)."""

    def __init__(self, link: Any) -> None:
        self._link = link
        self._signalled: str | None = None
        self.agreed = False

    @property
    def requested(self) -> bool:
        return self._signalled is not None or bool(
            self._link is not None and self._link.stop_requested)

    def install(self, env: dict[str, str] | None = None) -> None:
        """Handle the scheduler's SIGUSR1/SIGUSR2 when ``--signals-to-handle`` names them
        (``TORCHELASTIC_SIGNALS_TO_HANDLE``, which workers inherit); main thread only."""
        env = dict(os.environ) if env is None else env
        wanted = {name.strip() for name in
                  env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "").split(",")}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in _WORKER_SIGNALS:
            if name in wanted:
                signal.signal(getattr(signal, name), self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self._signalled = signal.Signals(signum).name


def stop_here(trainer: Any) -> None:
    """Every rank, at the step boundary the vote agreed on: commit a checkpoint of the
    committed steps (when the trainer has a directory), say so once, and exit PREEMPTED."""
    step = trainer.committed
    saved = False
    if trainer.checkpoint_dir is not None:
        saving = trainer.saving
        if saving is not None:
            saved = saving.settle(trainer.timeouts.collective_s) and saving.step == step
        if not saved:
            trainer.saving = BackgroundSave.start(trainer, trainer.checkpoint_dir, step)
            saved = trainer.saving.settle(trainer.timeouts.collective_s)
        if saved and trainer.recovery is not None:
            trainer.recovery.link.checkpointed(step)
            trainer.saving.told = True
    if trainer.is_reporter:
        where = (f"checkpoint of step {step - 1} committed in {trainer.checkpoint_dir}; the same "
                 f"command resumes at step {step}" if saved else
                 f"no checkpoint (no checkpoint directory): the {step} steps trained are lost")
        sys.stdout.write(f"preempted after step {step - 1}: {where}\n")
        sys.stdout.flush()
    trainer.close()
    raise SystemExit(int(ExitStatus.PREEMPTED))
