"""The hang timeout that sets itself: its derivation, the worker's measurement of its pace
(slow stretches left out), and the agent's reading of both from the channel."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.hang import (
    FACTOR,
    FLOOR_S,
    MIN_GAPS,
    PRIOR_BANDWIDTH,
    REGROUP_PRIOR_PER_RANK_S,
    GapWindow,
    PhaseDeadline,
    asleep_past_deadline,
    derive_hang_s,
    describe,
    recovery_deadlines,
)
from chameleon_elastic.launcher.detection.detectors import HangWatch
from chameleon_elastic.runtime.execution.phases import Phases
from chameleon_elastic.timeouts import Timeouts


def test_the_derived_timeout_is_factor_times_the_pace_within_floor_and_ceiling():
    assert derive_hang_s(2.0, 60) == FACTOR * 2.0
    assert derive_hang_s(0.01, 60) == FLOOR_S
    assert derive_hang_s(30.0, 60) == 60
    assert derive_hang_s(2.0, 60, slow=True) == 60     # an expected-slow stretch
    assert derive_hang_s(None, 60) == 60               # not measured yet
    assert derive_hang_s(2.0, 60, slow=PhaseDeadline(7.5, 30)) == 7.5   # its own deadline
    assert derive_hang_s(None, 60, slow=PhaseDeadline(1.0, 4)) == FLOOR_S
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
    channel.write(store, channel.slow_key(1), {"deadline_s": 6.5, "give_up_s": 26.0})
    assert watch._limit(store, 1, looked=True) == 6.5   # a recovery's phase: its deadline
    fixed = HangWatch(3, nproc=2)
    assert fixed._limit(store, 0, looked=True) == 3 and fixed.in_force() == ""   # no beat yet
    channel.write(store, channel.beat_key(0), 1)
    fixed.check(store, {0: 1})
    assert fixed.in_force() == "3 s"


def test_a_recoverys_deadlines_are_factor_times_what_was_measured_and_the_transfer_its_bytes():
    few = recovery_deadlines([0.01], [0.02], [0.2], 0.0, None, 4)   # a tiny job: the floor
    assert (few.regroup_s, few.enter_s, few.first_step_s) == (FLOOR_S, FLOOR_S, FLOOR_S)
    slow = recovery_deadlines([3.0, 8.0], [2.0], [4.0] * 50 + [1.0], 0.0, None, 4)
    assert slow.regroup_s == FACTOR * 8.0            # the 0.99 quantile of two: the larger
    assert slow.enter_s == FACTOR * 2.0 and slow.first_step_s == FACTOR * 4.0
    assert slow.of("first step") == slow.first_step_s
    moving = recovery_deadlines([], [], [], 2e9, None, 4)   # nothing measured: the priors
    assert moving.enter_s == FLOOR_S + FACTOR * 2e9 / PRIOR_BANDWIDTH
    assert moving.regroup_s == FLOOR_S   # 4 ranks regroup in far less than the floor
    measured = recovery_deadlines([], [], [], 2e9, 1e9, 1024)
    assert measured.enter_s == FLOOR_S + FACTOR * 2.0
    assert measured.regroup_s == FACTOR * REGROUP_PRIOR_PER_RANK_S * 1024   # a large world
    restart = recovery_deadlines([0.01], [], [], 0.0, None, 4, start_s=3.0)
    assert restart.regroup_s == FLOOR_S + FACTOR * 3.0   # a restarted peer's start-up waited
    assert restart.enter_s == few.enter_s                # and nothing else


def test_a_recovery_phase_announces_its_own_deadline_until_the_stretch_ends():
    phases, link = Phases(), _Link()
    phases.report_to(link)
    regroup, enter = PhaseDeadline(6.5, 13), PhaseDeadline(7.0, 27)
    phases.allow(regroup)      # known before the stretch begins: said with it
    phases(3, "regroup")
    phases.allow(enter)        # the next phase's, said at once
    for name in ("enter", "forward", "backward", "sync", "vote", "apply", "applied"):
        phases(3, name)
    phases(4, "checkpoint")    # a stretch nothing measures: the ceiling
    assert link.said == [regroup, enter, False, True]


def test_a_worker_asleep_past_the_time_its_phase_gives_itself_up_is_hung():
    deadline = PhaseDeadline(5.0, 20.0)
    assert not asleep_past_deadline(24.0, deadline)   # still within the news' slack
    assert asleep_past_deadline(20.0 + FLOOR_S, deadline)
    assert not asleep_past_deadline(1e6, True)        # a stretch nothing measures: never
    assert not asleep_past_deadline(1e6, False)       # asleep outside a recovery: waiting


def _asleep() -> subprocess.Popen:
    """A process asleep (reading a pipe nobody writes), as a worker blocked where nothing
    reaches it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_SLEEPING:
        assert time.monotonic() < deadline, "the sleeper never fell asleep"
        time.sleep(0.01)
    return proc


def _as_if_waited(watch: HangWatch, seconds: float) -> None:
    """Move the watch's clocks back, as if ``seconds`` had passed since the publication and
    since each worker's progress was last seen."""
    watch._unstarted = {d: (count, since - seconds)
                        for d, (count, since) in watch._unstarted.items()}
    watch._beats = {d: (count, since - seconds) for d, (count, since) in watch._beats.items()}


def test_a_worker_asleep_that_never_takes_up_a_published_generation_is_hung():
    """Device 0 sleeps where the watchdog's unblocking does not reach (still in the old
    generation); device 1 took the new generation up and now waits for a peer, asleep too,
    which is no hang."""
    sleeper = _asleep()
    try:
        store, pids = dist.HashStore(), {0: sleeper.pid, 1: sleeper.pid}
        store.add(channel.beat_key(0), 7)
        store.add(channel.beat_key(1), 3)
        channel.write(store, channel.gap_key(0), 0.1)   # steps of ~0.1 s: the floor
        watch = HangWatch(60, nproc=2, auto=True)
        watch._read_gaps(store, pids, now=1e12)
        watch.reset(store, pids)          # the next generation is published
        store.add(channel.beat_key(1), 1)   # device 1 regroups
        assert watch.check(store, pids)[0] == []
        _as_if_waited(watch, FLOOR_S + 1)
        hung, _ = watch.check(store, pids)
        assert [f.device for f in hung] == [0]
        assert "asleep in the previous plan generation" in hung[0].reason
        assert hung[0].hang_s == FLOOR_S   # its hang timeout, from its pace
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_worker_asleep_in_the_old_generation_is_hung_at_its_peers_regroup_deadline():
    """Early in a job no pace is measured yet, so a worker's own hang timeout is the 60 s
    ceiling; device 0 sleeps where no unblocking reaches (a unit's card left in a sharded
    backward's wait) while device 1 waits for it in the new generation's regroup, which it
    gives up at twice its 5 s deadline. Device 0 is convicted at 1x that deadline, as a frozen
    peer is, not at the ceiling (the generations failed one after another until the job
    ended: tests/launcher/test_inplace.py's tensor-parallel loss, 1 run in 10 under load)."""
    sleeper = _asleep()
    try:
        store, pids = dist.HashStore(), {0: sleeper.pid, 1: sleeper.pid}
        store.add(channel.beat_key(0), 7)
        store.add(channel.beat_key(1), 3)
        watch = HangWatch(60, nproc=2, auto=True)
        watch.reset(store, pids)          # the next generation is published
        store.add(channel.beat_key(1), 1)   # device 1 regroups, with its deadline
        channel.write(store, channel.slow_key(1), {"deadline_s": 5.0, "give_up_s": 10.0})
        watch._read_gaps(store, pids, now=1e12)
        assert watch.check(store, pids)[0] == []
        assert watch.check(store, pids)[0] == []   # device 0 is looked at: not yet
        _as_if_waited(watch, 5.0)
        hung, _ = watch.check(store, pids)
        assert [f.device for f in hung] == [0]
        assert "asleep in the previous plan generation" in hung[0].reason
        assert hung[0].hang_s == 5.0   # its peers' regroup deadline, not the ceiling
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_worker_that_takes_up_no_generation_keeps_its_clock_across_publications():
    """With nothing to shorten it, the timeout is the ceiling; a worker that took up none of
    several generations published seconds apart (each given up by its peers) is timed from
    the first it missed, not afresh at each, which would never reach the ceiling."""
    sleeper = _asleep()
    try:
        store, pids = dist.HashStore(), {0: sleeper.pid}
        store.add(channel.beat_key(0), 7)
        watch = HangWatch(60, nproc=1, auto=True)
        watch.reset(store, pids)          # generation 1 is published
        watch.check(store, pids)
        _as_if_waited(watch, 40.0)
        assert watch.check(store, pids)[0] == []
        watch.reset(store, pids)          # generation 2, 40 s later: device 0 never moved
        _as_if_waited(watch, 20.0)
        hung, _ = watch.check(store, pids)
        assert [f.device for f in hung] == [0] and hung[0].hang_s == 60
        store.add(channel.beat_key(0), 1)   # a worker that moves is timed afresh
        watch.reset(store, pids)
        watch.check(store, pids)
        _as_if_waited(watch, 59.0)
        assert watch.check(store, pids)[0] == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_worker_asleep_past_its_phases_give_up_time_is_hung():
    sleeper = _asleep()
    try:
        store, pids = dist.HashStore(), {0: sleeper.pid}
        store.add(channel.beat_key(0), 1)
        watch = HangWatch(60, nproc=1, auto=True)
        watch.check(store, pids)
        channel.write(store, channel.slow_key(0), {"deadline_s": 5.0, "give_up_s": 20.0})
        watch._read_gaps(store, pids, now=1e12)
        _as_if_waited(watch, 20.0)   # asleep, but not yet past 20 s + the floor
        assert watch.check(store, pids)[0] == []
        _as_if_waited(watch, FLOOR_S)
        hung, _ = watch.check(store, pids)
        assert [f.device for f in hung] == [0] and hung[0].hang_s == 20.0
        assert "asleep past its recovery phase's deadline" in hung[0].reason
    finally:
        sleeper.kill()
        sleeper.wait()


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
        watch._awake = {d: (long_ago, _cpu(p)) for d, p in pids.items()}  # awake all along
        hung, _ = watch.check(store, pids)
        assert [h.device for h in hung] == [1]
    finally:
        stopped.kill()
        stopped.wait()
        exited.wait()


def _cpu(pid: int) -> float:
    """The CPU seconds ``pid`` used so far (0 for a process that has exited)."""
    try:
        return sum(psutil.Process(pid).cpu_times()[:2])
    except psutil.Error:
        return 0.0


def test_a_device_stopped_part_of_the_time_is_slow_not_frozen():
    """A throttled device, stopped and continued from outside (chaos.py's slow device), is
    seen stopped at some looks: it has run between them, so it is not convicted; one that
    stays stopped is."""
    throttled = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        while _cpu(throttled.pid) < 0.05:   # it has run
            assert time.monotonic() < deadline, "the spinner never ran"
            time.sleep(0.01)
        store, pids = dist.HashStore(), {0: throttled.pid}
        store.add(channel.beat_key(0), 1)
        watch = HangWatch(3, nproc=1)
        watch.check(store, pids)
        long_ago = time.monotonic() - 100
        watch._beats = {0: (1, long_ago)}
        watch._awake = {0: (long_ago, 0.0)}    # first seen awake 100 s ago, with no CPU used
        throttled.send_signal(signal.SIGSTOP)   # stopped now, at this look
        while psutil.Process(throttled.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the spinner never stopped"
            time.sleep(0.01)
        assert watch.check(store, pids)[0] == []   # it ran in between: throttled
        watch._awake = {0: (long_ago, _cpu(throttled.pid))}   # ... and now no more
        hung, _ = watch.check(store, pids)
        assert [h.device for h in hung] == [0]
    finally:
        throttled.kill()
        throttled.wait()


def test_a_deadline_far_from_the_step_time_says_where_it_comes_from():
    """The status line shows the longest deadline of a recovery phase a worker is in. Beside
    0.1 s steps, ``recovery phase deadline 161 s`` read as a mistake; each figure now comes
    with its phase and its largest term."""
    start = recovery_deadlines([0.01], [0.02], [0.1], 0.0, None, 4, start_s=4.0)
    assert start.why_of("regroup") == ("a process starts for it: 5 x 4 s, this worker's own "
                                       "start-up")
    assert start.why_of("first step") == f"at least {FLOOR_S:g} s for any phase"
    moving = recovery_deadlines([], [], [2.0] * 30, 2e9, None, 4)
    assert moving.why_of("enter") == "5 x 2e+03 MB at 125 MB/s (not measured yet)"
    assert moving.why_of("first step") == "5 x the 2 s measured"
    said = PhaseDeadline(start.regroup_s, 50.0, "regroup", start.why_of("regroup")).said()
    assert said == ("regroup deadline 25 s (a process starts for it: 5 x 4 s, this worker's "
                    "own start-up)")
    store = dist.HashStore()   # the agent reads it from the channel as the worker wrote it
    import dataclasses
    channel.write(store, channel.slow_key(0), dataclasses.asdict(
        PhaseDeadline(start.regroup_s, 50.0, "regroup", start.why_of("regroup"))))
    watch = HangWatch(60, nproc=2, auto=True)
    watch._read_gaps(store, {0: 1}, now=1e9)
    assert watch.recovering() == said
    assert describe(60, True, "not measured yet") == "60 s (auto: not measured yet)"


def test_a_process_start_up_leaves_out_its_waits_for_others(monkeypatch):
    """The start-up a starting process is allowed (5 x the survivor's own) is work: imports,
    the script, the model. It used to be measured from the process's creation to its first
    plan, so it took in the wait for the other ranks of its first world (a node started late),
    and a former standby's whole warm wait (minutes, hours): 5 x that as a regroup
    deadline."""
    import os
    from types import SimpleNamespace

    from chameleon_elastic.runtime.recovery import in_place
    from chameleon_elastic.runtime.recovery.entering import Entry
    from chameleon_elastic.runtime.world import join

    monkeypatch.setattr(join, "_WAITED_S", [0.0])
    join.note_waited(20.0)   # the first join: every rank of the world to come
    join.note_waited(100.0)  # a standby's wait for a place
    link = SimpleNamespace(store=dist.HashStore(), port=None, card=0, device=0)
    trainer = SimpleNamespace(group_sockets=frozenset(), unit_sockets=frozenset(),
                              phases=SimpleNamespace(allow=lambda deadline: None),
                              plan=SimpleNamespace(generation=0))
    recovery = in_place.Recovery(trainer, link, SimpleNamespace(unblock=lambda s: None))
    recovery._entering = psutil.Process(os.getpid()).create_time() + 123.0
    recovery.first_entry(Entry(0, "init", False, 0, 0.0, 0.0, 0))
    assert recovery.clock._start_s == 3.0
    deadlines = recovery.clock.begin(0.0, 4, starting=True)
    assert deadlines.regroup_s == FLOOR_S + FACTOR * 3.0
