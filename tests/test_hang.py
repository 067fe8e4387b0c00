"""The hang timeout that sets itself: its derivation, the worker's measurement of its pace
(slow stretches left out), and the agent's reading of both from the channel."""

from __future__ import annotations

import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.hang import (
    FACTOR,
    FLOOR_S,
    MIN_GAPS,
    GapWindow,
    derive_hang_s,
    describe,
)
from chameleon_elastic.launcher.detectors import HangWatch
from chameleon_elastic.runtime.phases import Phases
from chameleon_elastic.timeouts import Timeouts


def test_the_derived_timeout_is_factor_times_the_pace_within_floor_and_ceiling():
    assert derive_hang_s(2.0, 60) == FACTOR * 2.0
    assert derive_hang_s(0.01, 60) == FLOOR_S
    assert derive_hang_s(30.0, 60) == 60
    assert derive_hang_s(2.0, 60, slow=True) == 60     # an expected-slow stretch
    assert derive_hang_s(None, 60) == 60               # not measured yet
    assert describe(5.0, True) == "5 s (auto)" and describe(3, False) == "3 s"
    assert describe(0, False) == "off"


def test_the_pace_is_a_high_quantile_once_enough_gaps_are_measured():
    window = GapWindow()
    for _ in range(MIN_GAPS - 1):
        window.add(0.1)
    assert window.typical() is None
    window.add(0.1)
    assert window.typical() == 0.1
    for _ in range(200):
        window.add(0.1)
    window.add(3.0)   # one outlier in 221 lies above the 0.99 quantile ...
    assert window.typical() == 0.1
    for _ in range(5):
        window.add(3.0)   # ... six do not
    assert window.typical() == 3.0


class _Link:
    def __init__(self) -> None:
        self.beats, self.said = 0, []
        self.typical = None

    def beat(self) -> None:
        self.beats += 1

    def slow(self, on: bool) -> None:
        self.said.append(on)

    def gaps(self, typical) -> None:
        self.typical = typical


def test_slow_stretches_are_announced_and_not_measured():
    phases, link = Phases(), _Link()
    phases(-1, "enter")   # in the trainer's constructor, before run(): no link yet
    phases.report_to(link)
    assert link.said == [True] and link.typical == phases.gaps.typical
    step = ("forward", "backward", "sync", "vote", "apply", "applied")
    for name in step:           # the first step: a slow stretch until applied
        phases(0, name)
    assert link.said == [True, False] and len(phases.gaps) == 0
    for name in step:
        phases(1, name)
    assert len(phases.gaps) == 6
    phases(2, "checkpoint")
    for name in step:
        phases(2, name)
    assert link.said == [True, False, True, False] and len(phases.gaps) == 6
    phases(3, "forward")
    assert len(phases.gaps) == 7 and link.beats == 20   # every phase after report_to


def test_resolved_timeouts_are_auto_unless_the_hang_timeout_is_given():
    assert Timeouts.resolve(env={}).hang_auto
    assert not Timeouts.resolve(env={}, hang_s=3).hang_auto
    assert not Timeouts.resolve(env={"CHAMELEON_HANG_TIMEOUT_S": "7"}).hang_auto
    assert not Timeouts().hang_auto


def test_the_agent_holds_each_worker_to_its_own_pace_and_a_slow_one_to_the_ceiling():
    store = dist.HashStore()
    watch = HangWatch(60, nproc=2, auto=True)
    channel.write(store, channel.gap_key(0), 2.0)
    channel.write(store, channel.slow_key(1), True)
    channel.write(store, channel.gap_key(1), 0.1)
    watch._read_gaps(store, {0: 1, 1: 2}, now=1e9)
    assert watch._limit(store, 0, looked=True) == 10.0
    assert watch._limit(store, 1, looked=False) == FLOOR_S
    assert watch._limit(store, 1, looked=True) == 60
    fixed = HangWatch(3, nproc=2)
    assert fixed._limit(store, 0, looked=True) == 3 and fixed.in_force() == ""   # no beat yet
    channel.write(store, channel.beat_key(0), 1)
    fixed.check(store, {0: 1})
    assert fixed.in_force() == "3 s"


def test_a_worker_that_has_exited_is_never_hung_while_a_stopped_one_is():
    """A finished worker can sit as a zombie, unreaped, past its hang timeout (torch 2.15's
    slower teardown did, and the job was re-run); it has exited, so the next poll reports it.
    A stopped worker past its timeout is convicted at one look (the control)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    store = dist.HashStore()
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while (psutil.Process(exited.pid).status() != psutil.STATUS_ZOMBIE
               or psutil.Process(stopped.pid).status() != psutil.STATUS_STOPPED):
            assert time.monotonic() < deadline, "the children never reached zombie / stopped"
            time.sleep(0.01)
        watch = HangWatch(3, nproc=2)
        pids = {0: exited.pid, 1: stopped.pid}
        for device in pids:
            channel.write(store, channel.beat_key(device), 1)
        watch.check(store, pids)                       # the beats seen now ...
        long_ago = time.monotonic() - 100
        watch._beats = {d: (1, long_ago) for d in pids}   # ... and not again for 100 s,
        watch._awake = {d: (long_ago, 0.0) for d in pids}  # awake all along
        hung, _ = watch.check(store, pids)
        assert [h.device for h in hung] == [1]
    finally:
        stopped.kill()
        stopped.wait()
        exited.wait()
