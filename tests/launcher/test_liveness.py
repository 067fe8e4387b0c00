"""Liveness end to end: a failure that keeps coming back ends the job within the cap, in one
sentence, with no process left behind; the hang timeout derived from the workers' pace
convicts a frozen worker, but not one frozen where slowness is expected."""

from __future__ import annotations

import os
import re
import signal

import pytest

from chameleon_elastic.launcher.detection.detectors import STOPPED_S

from .conftest import (
    MLP_FAULTS,
    assert_single_process_results,
    pid_alive,
    read_events,
    two_device_job,
    wait_for,
)
from .conftest import (
    launch_mlp as _launch_mlp,
)


def _pids(out) -> list[int]:
    return [int(p) for f in out.glob("pid-*") for p in f.read_text().split()]


@pytest.mark.timeout(90)
def test_a_failure_in_every_generation_ends_the_job_within_the_cap_in_one_sentence(
        tmp_path, launch):
    """Device 1 raises torch's DistBackendError (a lost peer, by its type) in step 2's forward
    of every generation: each recovery regroups, resumes at step 2 and fails again. With a cap
    of 2 the third failed generation ends the job: exit 1, one sentence naming the error, no
    traceback, every worker gone. Two devices (one pipeline) are enough to regroup in place."""
    run, out, state = _launch_mlp(launch, tmp_path, 6, "1:2:forward:dist-error",
                                  flags=("--max-failed-generations", "2"), two_devices=True)
    assert run.wait(80) == 1, run.log.read_text()[-3000:]
    log = run.log.read_text()
    said = [x for x in log.splitlines() if "plan generations in a row failed" in x]
    assert len(said) == 1, log[-3000:]
    assert "3 plan generations in a row failed before committing a step" in said[0]
    assert "injected: NCCL communicator was aborted" in said[0]
    assert "--max-failed-generations (now 2)" in said[0]
    assert "Traceback" not in log and "ChildFailedError" not in log
    events = read_events(state / "events.jsonl")
    assert [e["generation"] for e in events if e["event"] == "plan_chosen"] == [1, 2]
    assert events[-1]["event"] == "job_finished" and events[-1]["state"] == "FAILED"
    for pid in _pids(out):
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"worker {pid} to stop")


@pytest.mark.timeout(90)
def test_relaunched_workers_that_fail_every_generation_are_bounded_by_the_agent(
        tmp_path, launch):
    """Under --recovery relaunch every generation starts fresh processes, so no worker can count
    the generations that failed before it: device 1 says it lost a peer as it enters the plan,
    in every process. The agent counts, and ends the job within the cap (1 here: a relaunch
    is slow on a busy machine) with the sentence that names what the workers said."""
    job = two_device_job(tmp_path)   # each relaunch starts 2 processes
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--job", str(job),
                               "--state-dir", str(tmp_path / "state"), "--monitor-interval",
                               "0.05", "--no-status", "--max-failed-generations", "1",
                               "--recovery", "relaunch", MLP_FAULTS, str(out), "6",
                               "1:-1:enter:lose-vote"])
    assert run.wait(80) == 1, run.log.read_text()[-3000:]
    log = run.log.read_text()
    said = [x for x in log.splitlines() if "plan generations in a row failed" in x]
    assert len(said) == 1, log[-3000:]
    assert said[0].startswith("chameleon-run: giving up: 2 plan generations in a row failed")
    assert "injected: this rank's vote result was lost" in said[0]
    assert "Traceback" not in log and "ChildFailedError" not in log
    assert len((out / "pid-1").read_text().split()) == 2   # one process per failed generation
    for pid in _pids(out):
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"worker {pid} to stop")


def _in_force(log: str) -> list[float]:
    """The auto hang timeouts the status line said were in force, in order."""
    return [float(m) for m in re.findall(r"hang timeout ([\d.]+) s \(auto[:)]", log)]


@pytest.mark.timeout(90)
def test_a_spinning_worker_is_convicted_on_the_timeout_derived_from_its_pace(tmp_path, launch):
    """No --hang-timeout: the status line says the auto timeout in force once every worker has
    a measured pace (steps of about 0.2 s: the 5 s floor, far below the 60 s ceiling); device 1
    then spins without progress (a livelock: running, so neither asleep nor stopped) and is
    convicted on that timeout and recovered from in place: two replicas, so that the survivor
    holds every layer. The workers hold at step 24's checkpoint until the figure is shown, so
    that a loaded machine's late figure cannot let the fault come first."""
    run, out, state = _launch_mlp(launch, tmp_path, 40, "1:25:forward:spin", "--pace", "0.2",
                                  "--hold-at", "24", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                  status=True, two_devices=True, replicas=True)
    wait_for(lambda: any(x < 60 for x in _in_force(run.log.read_text())), 60,
             "the status line's auto hang timeout below the ceiling")
    victim = int((out / "pid-1").read_text().split()[0])
    (out / "release").touch()
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    assert [e["device"] for e in seen] == [1] and seen[0]["hang_auto"] is True
    assert 5 <= seen[0]["hang_s"] < 60 and "process running" in seen[0]["reason"]
    # the status line says 3 digits: above the floor (a loaded machine's slower steps) the
    # figure is not a round one
    assert float(f"{seen[0]['hang_s']:.3g}") in _in_force(run.log.read_text())
    log = run.log.read_text()
    assert f"(hung at {seen[0]['hang_s']:.3g} s, auto)" in log
    assert "device 1 lost (hung: no progress for " in log
    assert not pid_alive(victim)


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_cut_out_in_seconds_before_its_pace_is_known(tmp_path, launch):
    """Device 1 is SIGSTOPped after its third step, when no pace is measured yet and the hang
    timeout in force is the 60 s ceiling (a minute of silence for the others, issue 47): a
    stopped process, without CPU and without progress, is frozen whatever its timeout, and is
    convicted as such (detectors.STOPPED_S) rather than at the ceiling."""
    run, out, state = _launch_mlp(launch, tmp_path, 12, "--pace", "0.2", status=True,
                                  two_devices=True, replicas=True)
    steps = out / "steps.jsonl"
    wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3, 60,
             "the first three steps")
    victim = int((out / "pid-1").read_text().split()[0])
    os.kill(victim, signal.SIGSTOP)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    assert [e["device"] for e in seen] == [1], seen
    assert "process stopped" in seen[0]["reason"] and seen[0]["hang_s"] == STOPPED_S, seen
    assert "device 1 lost (stopped: no progress for " in run.log.read_text()
    assert not pid_alive(victim)
    assert_single_process_results(out, [0], 12)


@pytest.mark.timeout(90)
def test_a_checkpoint_is_held_to_the_ceiling_not_to_the_derived_timeout(tmp_path, launch):
    """Once the auto timeout is below the time device 1 will be busy (8 s), device 1 spends 8 s
    in a checkpoint, a stretch that nothing measures: no hang, and the job finishes with
    single-process results."""
    run, out, state = _launch_mlp(
        launch, tmp_path, 16, "1:14:checkpoint:spin-8", "--pace", "0.1", "--hold-at", "10",
        "--checkpoint-dir", str(tmp_path / "ckpt"), status=True)
    wait_for(lambda: any(x < 8 for x in _in_force(run.log.read_text())), 60,
             "the status line's auto hang timeout below 8 s")
    (out / "release").touch()
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    assert seen == []
    assert_single_process_results(out, [0, 1, 2, 3], 16)


@pytest.mark.timeout(90)
def test_a_worker_frozen_while_the_others_recover_is_cut_out_in_seconds(tmp_path, launch):
    """Device 3 is lost; device 0 freezes (SIGSTOP, for 40 s) as it enters the plan made for
    the survivors. Entering a plan used to be held to the hang ceiling (60 s), then to the
    phase's deadline (at least the 5 s floor); a stopped process is now convicted as frozen in
    seconds (detectors.STOPPED_S), before its peers give the generation up, and the two devices
    left, which still hold every layer, finish with single-process results."""
    run, out, state = _launch_mlp(launch, tmp_path, 16, "3:8:forward:kill", "0:8:enter:stop-40",
                                  "--pace", "0.1", status=True)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    assert [(e.get("device"), e.get("signal")) for e in seen] == [(3, "SIGKILL"), (0, None)], seen
    assert "process stopped" in seen[1]["reason"] and seen[1]["hang_s"] == STOPPED_S
    assert_single_process_results(out, [1, 2], 16)


@pytest.mark.timeout(90)
def test_a_worker_deadlocked_asleep_while_the_others_recover_is_cut_out_too(tmp_path, launch):
    """As above, but device 0 deadlocks asleep as it enters the plan: asleep is what a worker
    waiting for a peer looks like, so no hang timeout applies. Its peers give the generation
    up at twice their phase deadline; the next generation is published, and device 0, asleep
    without ever taking it up, is convicted at its hang timeout (or, first, once asleep past
    the time its own phase would have given itself up). Devices 1 and 2 finish."""
    run, out, state = _launch_mlp(launch, tmp_path, 14, "3:8:forward:kill", "0:8:enter:sleep",
                                  "--pace", "0.1")
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    hung = [e for e in seen if e.get("device") == 0]
    assert len(hung) == 1 and "hung: no progress for " in hung[0]["reason"]
    assert "asleep" in hung[0]["reason"]
    assert_single_process_results(out, [1, 2], 14)


def test_a_quick_rounds_decider_hosts_the_worker_store_at_its_own_address():
    """In a quick round the decider may be another node than the one that hosted the last full
    round's store; when that node is the one lost, its address is unreachable. The decider
    hosts the new worker store at its own --local-addr (chaos trials 2, 6 and 8 timed out
    connecting to the lost node's address). It serves on torch's libuv backend."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from chameleon_elastic.launcher.coordination.rounds import Rounds
    from chameleon_elastic.launcher.observe import StatusLine
    from chameleon_elastic.timeouts import Timeouts

    rounds = Rounds(SimpleNamespace(backend="etcd-v3"), Timeouts(store_s=2, hang_s=1,
                                                                  collective_s=2),
                    StatusLine(enabled=False), lambda *a, **k: None)
    lost_host = SimpleNamespace(master_addr="10.255.255.1")   # TEST-NET: never answers
    info = SimpleNamespace(store=dist.HashStore(), bootstrap_store_info=lost_host)
    spec = SimpleNamespace(master_addr=None, local_addr="127.0.0.1")
    addr, port = rounds.open_worker_store(spec, info, host=True)
    assert addr == "127.0.0.1"
    assert rounds._worker_store.libuvBackend   # what serves 16k ranks (worker_store_scale.py)
    client = dist.TCPStore(addr, port, is_master=False)   # reachable there
    client.set("k", "v")
    rounds.close()
