"""A worker's end of its agent's channel (:mod:`chameleon_elastic.channel`).

Who talks to whom: a worker talks to its own agent only, through a TCPStore client on loopback
named by ``CHAMELEON_AGENT_STORE``. It registers once its trainer trains in ``run``, beats at
every phase of a step (hang detection), learns of each new plan generation, reports how it
resumed, which step it reported and checkpointed, and, when a peer failed it, says so
(``trouble``) so its agent looks now. The agents decide plans among themselves; nothing here
decides anything. Kept apart from the recovery chain so that joining a generation
(:mod:`.join`) and the chain (:mod:`.recovery`) both use it without importing each other.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.channel import Generation, Registration, Resumed
from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.hang import PhaseDeadline
from chameleon_elastic.timeouts import Timeouts

from ..errors import PipelineRuntimeError
from ..topology import tp_from_env

__all__ = ["BEAT_EVERY_S", "WorkerLink"]

#: how often a worker's progress count goes to its agent (when it moved)
BEAT_EVERY_S = 0.1
#: how often its typical gap between phases does (when it moved by a tenth)
GAP_EVERY_S = 1.0
#: committed steps a worker keeps for its agent's metrics: enough for steps much faster than
#: the beats, without growing
RECENT_STEPS = 64


class WorkerLink:
    """A worker's end of its agent's channel (a TCPStore client on loopback). ``device`` is
    the plan's device (a unit of ``tp`` cards under tensor parallelism), ``tp_rank`` this
    worker's place in it; the channel knows the worker by its card."""

    def __init__(self, store: Any, device: int, timeouts: Timeouts, address: str = "",
                 tp_rank: int = 0, tp: int = 1) -> None:
        self.store = store
        self.device = device
        self.timeouts = timeouts
        self.address = address
        self.tp_rank, self.tp = tp_rank, tp
        self.stop_requested = False   # the agent asked for a stop (``stop``, read with beats)
        self._beats: _BeatSender | None = None

    @property
    def card(self) -> int:
        return self.device * self.tp + self.tp_rank

    @property
    def port(self) -> int | None:
        """The channel's port (None when the address is not known)."""
        port = self.address.rpartition(":")[2]
        return int(port) if port.isdigit() else None

    @classmethod
    def from_env(cls, timeouts: Timeouts | None = None,
                 env: Mapping[str, str] | None = None) -> WorkerLink | None:
        """The channel named by ``CHAMELEON_AGENT_STORE``; None outside ``chameleon-run --job``."""
        env = os.environ if env is None else env
        address = env.get(channel.AGENT_STORE_ENV)
        if not address:
            return None
        timeouts = timeouts or Timeouts.resolve(env=env)
        host, _, port = address.rpartition(":")
        try:
            device = int(env["CHAMELEON_DEVICE"])
            tp_rank, tp = tp_from_env(env)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=timeouts.delta("store_s"))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise PipelineRuntimeError(
                f"cannot reach this node's chameleon-run agent at {address} ({exc}); the "
                "agent is gone or the variables were copied from another run: start the script "
                f"with chameleon-run, or unset {channel.AGENT_STORE_ENV}."
            ) from exc
        return cls(store, device, timeouts, address, tp_rank, tp)

    def another(self, timeout: timedelta | None = None) -> WorkerLink:
        """A second connection to the same channel, for another thread; ``timeout``: how long
        its calls may block (the store timeout by default)."""
        host, _, port = self.address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=timeout or self.timeouts.delta("store_s"))
        return WorkerLink(store, self.device, self.timeouts, self.address, self.tp_rank, self.tp)

    def newest(self) -> int:
        value = channel.read_int(self.store, channel.NEWEST)
        return -1 if value is None else value

    def has(self, number: int) -> bool:
        return bool(self.store.check([channel.generation_key(number)]))

    def generation(self, number: int) -> Generation:
        return Generation.from_dict(channel.read(self.store, channel.generation_key(number)))

    def current(self) -> Generation:
        return self.generation(self.newest())

    def wait_newer(self, than: int) -> Generation:
        """The newest generation after ``than``, waiting up to ``generation_s`` for one."""
        try:
            self.store.wait([channel.generation_key(than + 1)],
                            self.timeouts.delta("generation_s"))
        except RuntimeError as exc:
            raise PipelineRuntimeError(
                f"device {self.device} lost a peer at plan generation {than} but its agent "
                f"published no new plan within {self.timeouts.generation_s:g} s "
                f"(CHAMELEON_GENERATION_TIMEOUT_S); no agent saw a device fail, so a peer may "
                "be hung rather than dead."
            ) from exc
        # the agent writes the generation's key before NEWEST: a worker woken by the key may
        # still read the old NEWEST, and must not join the old generation's (closed) store
        return self.generation(max(self.newest(), than + 1))

    def wait_for_bell(self) -> None:
        """Block until this worker's bell on the channel rings (``wake/<card>``: its agent
        rings it after publishing a generation, the worker itself to stop its watchdog),
        then clear it. A doorbell only: what happened is read elsewhere, after clearing, so
        no ring is lost."""
        key = channel.wake_key(self.card)
        self.store.wait([key])
        self.store.delete_key(key)

    def ring(self) -> None:
        channel.write(self.store, channel.wake_key(self.card), True)

    def register(self, generation: int) -> None:
        channel.write(self.store, channel.worker_key(self.card),
                      Registration(self.card, os.getpid(), generation))

    def resumed(self, record: Resumed) -> None:
        channel.write(self.store, channel.resumed_key(record.generation, self.card), record)

    def reported(self, step: int) -> None:
        channel.write(self.store, channel.REPORTED, step)

    def checkpoints(self) -> None:
        channel.write(self.store, channel.CHECKPOINTS, True)

    def checkpointed(self, step: int) -> None:
        channel.write(self.store, channel.CHECKPOINT, step)

    def beat(self) -> None:
        """Progress: the agent declares a worker whose count stops moving (and that is not
        asleep waiting for a peer) hung past ``--hang-timeout``. Counted here and sent by a
        thread every :data:`BEAT_EVERY_S`: a phase of a step costs no round trip to the agent
        (several per step, each a scheduling delay of the agent's process on a loaded host),
        and hang timeouts are seconds long."""
        self._sender().count += 1

    def slow(self, on: bool | PhaseDeadline) -> None:
        """This worker is in a stretch expected to be slow (a recovery, entering a plan, a
        checkpoint, an evaluation; runtime/execution/phases.py): its agent holds it to the stretch's own
        deadline when one is given (seconds: a recovery's phase, runtime/recovery/deadlines.py), else
        to the ceiling of the hang timeout, not to the timeout derived from its pace. Said at
        once, not by the beat thread."""
        key = channel.slow_key(self.card)
        if on is not False:
            channel.write(self.store, key, True if on is True else dataclasses.asdict(on))
        else:
            self.store.delete_key(key)

    def gaps(self, typical: Callable[[], float | None]) -> None:
        """Where the beat thread reads this worker's typical gap between phases (seconds),
        which it sends to the agent about once a second when it moved (hang.py)."""
        self._sender().typical = typical

    def committed(self, step: int, seconds: float) -> None:
        """A step committed here, for the agent's metrics (sent with the beats)."""
        sender = self._sender()
        sender.steps.append((step, seconds))
        sender.count += 1

    def _sender(self) -> _BeatSender:
        if self._beats is None:
            self._beats = _BeatSender(self.another(), self.card, owner=self)
        return self._beats

    def paced(self, generation: int, busy_s: float, compute_s: float, sync_s: float) -> None:
        """One more step of ``generation`` trained: ``busy_s`` of it computing, ``compute_s``
        in the pipeline part (computing and waiting), ``sync_s`` summing gradients. Sent with
        the next beat, never on the step's path."""
        was = self._sender().pace
        if was is None or was.generation != generation:
            was = channel.Pace(generation)
        self._beats.pace = channel.Pace(generation, was.steps + 1, was.busy_s + busy_s,
                                        was.wait_s + max(0.0, compute_s - busy_s),
                                        was.sync_s + sync_s)

    def stop_beats(self) -> None:
        """Stop sending progress (before the process ends). What is left (freeing groups,
        torch's teardown) is a slow stretch of its own, *leaving*: the agent holds the worker to
        the ceiling of the hang timeout, not to its step pace, and does not name it stalled
        (a person read 'device 2: no progress for 3 s' after the job's last step)."""
        try:
            channel.write(self.store, channel.slow_key(self.card), channel.LEAVING)
        except RuntimeError:   # the agent is gone: nobody watches
            pass
        if self._beats is not None:
            self._beats.stop()
            self._beats = None

    def failed(self, generation: int, cause: str) -> None:
        """What made this worker leave ``generation``, for the agent's sentence if failures keep
        coming back; the first worker's words stay (its peers fail because it did)."""
        lines = cause.strip().splitlines()
        channel.write_once(self.store, channel.cause_key(generation),
                           lines[0][:300] if lines else "unknown")

    def trouble(self, generation: int) -> None:
        """A peer failed us: the agent should look now. Also progress, sent at once, since a
        worker busy reacting to its peer's loss has not beaten since it blocked on that peer."""
        # kept at its largest: a worker failing a generation that was already superseded
        # (join.py) must not hide a peer's trouble with the current one
        channel.write_max(self.store, channel.TROUBLE, generation)
        self.store.add(channel.beat_key(self.card), 1)

    def ended(self, sentence: str, status: ExitStatus = ExitStatus.FAILED) -> None:
        """Training cannot go on (some layer's state exists nowhere, or failures keep coming
        back): the agent ends the job with this sentence and ``status`` instead of reporting a
        crashed worker. The first sentence stays: the worker that failed first says why the
        others did."""
        channel.write_once(self.store, channel.ENDED_STATUS, int(status))
        channel.write_once(self.store, channel.ENDED, sentence)


class _BeatSender:
    """Sends the progress counted in ``count`` (by the training thread) on its own
    connection, every :data:`BEAT_EVERY_S` when it moved, the step times (``pace``) with it,
    and the worker's typical gap between phases (``typical``, hang.py) every
    :data:`GAP_EVERY_S` when it moved by a tenth. Stopped before the process ends: a
    daemon thread caught inside a store call at interpreter exit aborts the process."""

    def __init__(self, link: WorkerLink, card: int, owner: WorkerLink) -> None:
        self.count = 0
        self.typical: Callable[[], float | None] = lambda: None
        self._sent = 0
        self.pace: channel.Pace | None = None   # set by the training thread
        self._pace_sent: channel.Pace | None = None
        self._gap_sent: float | None = None
        self._gap_at = 0.0
        self.steps: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=RECENT_STEPS)                 # (step, seconds), by the training thread
        self._steps_sent: tuple[int, float] | None = None
        self._link = link
        self._owner = owner   # the training thread's link, told of a stop request
        self._key, self._pace_key = channel.beat_key(card), channel.pace_key(card)
        self._gap_key = channel.gap_key(card)
        self._steps_key = channel.steps_key(card)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chameleon-beats", daemon=True)
        self._thread.start()
        atexit.register(self.stop)   # also when the script ends without closing its trainer

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop.set()
        self._thread.join(timeout=self._link.timeouts.store_s)

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            self._send_gap()
            self._send()

    def _send(self) -> None:
        count, pace, steps = self.count, self.pace, list(self.steps)
        try:
            if pace is not self._pace_sent and pace is not None:
                channel.write(self._link.store, self._pace_key, pace)
                self._pace_sent = pace
            if steps and steps[-1] != self._steps_sent:
                self._link.store.set(self._steps_key, json.dumps({"recent": steps}))
                self._steps_sent = steps[-1]
            if count != self._sent:
                self._link.store.add(self._key, count - self._sent)
                self._sent = count
                self._read_stop()   # only while the worker makes progress
        except RuntimeError:  # the agent is gone: its death signal follows
            return

    def _read_stop(self) -> None:
        """The agent's preemption notice (runtime/recovery/preemption.py), read on this thread so that
        a step costs the training thread no round trip for it. Read after progress was sent,
        never while the worker is idle: a thread caught in a store call as the interpreter
        exits hangs it."""
        if not self._owner.stop_requested:
            self._owner.stop_requested = bool(self._link.store.check([channel.STOP]))

    def _send_gap(self) -> None:
        now = time.monotonic()
        if now - self._gap_at < GAP_EVERY_S:
            return
        self._gap_at = now
        gap = self.typical()
        if gap is None or (self._gap_sent is not None
                           and abs(gap - self._gap_sent) <= self._gap_sent / 10):
            return
        try:
            channel.write(self._link.store, self._gap_key, gap)
        except RuntimeError:  # the agent is gone: its death signal follows
            return
        self._gap_sent = gap
