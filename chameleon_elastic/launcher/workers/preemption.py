"""The agent's side of a preemption: SIGTERM (or SIGUSR1/SIGUSR2 given in
``--signals-to-handle``) ends the run with nothing lost when it can.

In protocol order, once torch's handler has turned the signal into ``SignalException``:

1. the agent's workers all run on the runtime and the job writes checkpoints (the channel's
   ``checkpoints`` key): the agent writes ``stop`` on its channel; every worker learns it within
   0.1 s, the ranks agree in the next step's vote, commit a checkpoint at that step boundary and
   exit with ``ExitStatus.PREEMPTED`` (runtime/recovery/preemption.py). The agent waits for them for up
   to the shutdown timeout (torchrun's ``--shutdown-timeout``), then stops whoever is left;
2. otherwise the signal is forwarded to the workers, as torchrun does (torch's ``_shutdown``).

Either way the launcher exits with ``ExitStatus.PREEMPTED`` and one sentence saying what was
kept or lost. An agent that got no signal but whose workers exit ``PREEMPTED`` (the stop rides
on the vote, so another node's preemption stops every node's workers at the same step) ends
the same way: the job is preempted as a whole. SIGINT, SIGHUP and SIGQUIT keep torchrun's meaning (interrupted, status 1).
Further preemption signals during the drain are ignored: schedulers send one, then SIGKILL.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.api import SignalException

from chameleon_elastic import channel

from ..observe import Event

__all__ = ["PEER_PREEMPTED", "PREEMPTION_SIGNALS", "Drained", "Preempted", "drain", "preempt"]

#: what preempted the job when this node got no signal of its own
PEER_PREEMPTED = "on another node, or by a signal to the workers"

PREEMPTION_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})


@dataclass(frozen=True)
class Drained:
    """How the workers ended after a preemption signal."""

    signal: str
    runtime: bool                 # every worker ran on the runtime
    checkpoints: bool             # the job writes checkpoints
    stopped: bool                 # every worker stopped by itself at a step boundary
    committed: int | None         # steps the last committed checkpoint holds
    reported: int | None          # last step the job reported

    def sentence(self, grace_s: float) -> str:
        head = f"preempted ({self.signal})"
        if not self.runtime:
            return (f"{head}: the signal was forwarded to the workers, which stopped; what the "
                    "script did not save is lost")
        resume = ("; run the same command to resume at step "
                  f"{self.committed}" if self.committed else "")
        if not self.checkpoints:
            trained = 0 if self.reported is None else self.reported + 1
            return (f"{head}: workers stopped; the job writes no checkpoints (no "
                    f"--checkpoint-dir), so the {trained} steps trained are lost")
        if self.stopped and self.committed is not None:
            return (f"{head}: every worker stopped after step {self.committed - 1} with its "
                    f"checkpoint committed{resume}")
        kept = (f"the last committed checkpoint holds {self.committed} steps{resume}"
                if self.committed else "no checkpoint was committed yet: a rerun starts over")
        return (f"{head}: the workers did not stop at a step boundary within {grace_s:g} s and "
                f"were killed; {kept}")


class Preempted(SignalException):
    """The launcher was preempted (exit status ``PREEMPTED``); ``sentence`` says what was
    kept."""

    def __init__(self, sentence: str, sigval: signal.Signals) -> None:
        super().__init__(sentence, sigval)
        self.sentence = sentence


def drain(store: Any, procs: Any, why: str, grace_s: float, runtime: bool | None = None
          ) -> Drained:
    """Ask this node's runtime workers to stop at the next step boundary with a checkpoint,
    and wait up to ``grace_s`` for them to exit (see the module docstring). ``why``: the
    signal's name, or what else preempted the job; ``runtime``: known to be runtime workers
    (None: ask the channel)."""
    for handled in PREEMPTION_SIGNALS:
        signal.signal(handled, signal.SIG_IGN)
    runtime = procs.registered(store) if runtime is None else runtime
    checkpoints = runtime and channel.read(store, channel.CHECKPOINTS) is not None
    stopped = False
    if checkpoints:
        channel.write(store, channel.STOP, why)
        deadline = time.monotonic() + grace_s
        while procs.devices and time.monotonic() < deadline:
            procs.poll()
            time.sleep(0.05)
        stopped = not procs.devices
    return Drained(why, runtime, checkpoints, stopped,
                   channel.read_int(store, channel.CHECKPOINT) if runtime else None,
                   channel.read_int(store, channel.REPORTED) if runtime else None)


def preempt(store: Any, procs: Any, why: str, sigval: signal.Signals, grace_s: float,
            emit: Callable[..., None], runtime: bool | None = None) -> NoReturn:
    """Drain (:func:`drain`), say so in the event log, and end the agent's run with
    :class:`Preempted` (exit status 75)."""
    drained = drain(store, procs, why, grace_s, runtime)
    emit(Event.JOB_FINISHED, state="PREEMPTED", reason=why, checkpoint=drained.committed,
         stopped=drained.stopped)
    raise Preempted(drained.sentence(grace_s), sigval) from None
