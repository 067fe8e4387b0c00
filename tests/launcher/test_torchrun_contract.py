"""torchrun's contract on relaunches, and a plan that never changes a script's training silently.

- a relaunch counts in ``TORCHELASTIC_RESTART_COUNT`` (test_faults.py checks it under a job);
- without a job, a restart names what died as torchrun does: rank, pid, signal or exit code;
- a script that does not follow the plan is told once, in one line, when a re-plan changes its
  share of the global batch; one that follows it (a framework adapter announced it) is not;
- rank 0's stderr reaches the console under a job, but not what workers write once a peer died;
- a kept plan names only live devices; ``python -m chameleon_elastic.launcher`` runs.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from chameleon_elastic.launcher.failures import classify_exit
from chameleon_elastic.launcher.observation.shares import share_change
from chameleon_elastic.launcher.observe import layout
from chameleon_elastic.launcher.workers.worker_logs import ConsoleEcho
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute

from .conftest import PROBE, read_envs, two_device_job, wait_for


def _data_parallel(quotas: tuple[int, ...], failed: tuple[int, ...] = ()) -> ExecutionPlan:
    pipelines = tuple(Pipeline((d,), ((0, 4),), q) for d, q in enumerate(quotas))
    reroute = tuple(Reroute(device=d, pipeline=d, stage=0, peers=(PeerShare(
        next(x for x in range(len(quotas)) if x not in failed), quotas[d]),)) for d in failed)
    return ExecutionPlan(policy="reroute" if failed else "initial", generation=len(failed),
                         pipelines=pipelines, failed_devices=failed, reroute=reroute).validate()


def test_the_share_line_names_what_a_replan_did_to_a_data_parallel_script():
    first = _data_parallel((2, 2))
    line = share_change(first, _data_parallel((2, 2), failed=(1,)), micro_batch_size=8)
    assert line is not None and line.startswith(
        "this plan gives 1 worker 4 micro-batches per step where the first gave 2 workers 2 "
        "micro-batches each: a script that takes its gradient accumulation from "
        "CHAMELEON_MICRO_BATCHES keeps the global batch (4 micro-batches of "
        "training.micro_batch_size 8); one that does not now trains about 50% of its batch per "
        "step."), line
    assert share_change(first, first, 8) is None   # a crash restarted on the same shares
    uneven = share_change(_data_parallel((3, 3, 2)), _data_parallel((4, 4)), 1)
    assert uneven is not None and "2 workers 4 micro-batches each" in uneven
    assert "3 workers 3, 3, 2 micro-batches" in uneven and "about 75%" in uneven


def test_a_kept_plan_names_only_live_devices():
    assert layout(_data_parallel((2, 2), failed=(1,))) == "1 pipeline: device 0"
    assert layout(_data_parallel((2, 2))) == "2 pipelines: device 0 | device 1"


def test_a_failure_is_named_as_torchrun_names_it():
    assert classify_exit(-signal.SIGKILL, 1, 1, pid=5590, rank=3).said == (
        "rank 3 (local rank 1, pid 5590) was killed by SIGKILL")
    assert classify_exit(1, 0, 0, pid=77, rank=0).said == (
        "rank 0 (local rank 0, pid 77) exited with code 1")


def test_python_m_chameleon_elastic_launcher_is_chameleon_run():
    done = subprocess.run([sys.executable, "-m", "chameleon_elastic.launcher", "--help"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: chameleon-run")


def _launch_and_kill(launch, tmp_path, flags: list[str], mode: str) -> tuple[object, list]:
    """Two probe workers; SIGKILL the one of rank 1 once both run; wait for the relaunch."""
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                               "--monitor-interval", "0.05", *flags, PROBE, str(out), mode])
    first = wait_for(lambda: len(read_envs(out)) == 2 and read_envs(out), 60,
                     "the first launch's two workers")
    victim = next(r for r in first if r["env"]["RANK"] == "1")
    if mode == "hold-following":   # the agent must have heard them before one dies
        wait_for(lambda: len(list(out.glob("announced-*"))) == 2, 60,
                 "both workers' announcements that they follow the plan")
    if mode == "hold-peers-loud":   # echoed once a poll saw it while both lived
        wait_for(lambda: "probe rank 0 is up" in run.log.read_text(), 60,
                 "rank 0's first line on the console")
    os.kill(victim["pid"], signal.SIGKILL)
    later = wait_for(lambda: [r for r in read_envs(out) if r["pid"] not in
                              {f["pid"] for f in first}] or None, 60, "the relaunched workers")
    (out / "release").touch()
    assert run.wait(60) == 0
    return run, later


@pytest.mark.timeout(120)
def test_without_a_job_a_restart_names_the_rank_the_pid_and_the_signal(tmp_path, launch):
    run, later = _launch_and_kill(launch, tmp_path, [], "hold")
    log = run.log.read_text()
    victim = [line for line in log.splitlines() if "was killed by SIGKILL" in line]
    assert len(victim) == 1 and victim[0].startswith("chameleon-run: rank 1 (local rank 1, pid ")
    assert victim[0].endswith("every worker restarts (restart 1 of 2)"), victim
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in later} == {"1"}


@pytest.mark.timeout(120)
def test_a_script_that_follows_the_plan_is_not_warned_about_its_share(tmp_path, launch):
    job = two_device_job(tmp_path, replicas=True)
    run, later = _launch_and_kill(launch, tmp_path, ["--job", str(job)], "hold-following")
    log = run.log.read_text()
    assert "device 1 lost (SIGKILL)" in log and "relaunched 1 worker" in log, log
    assert "this plan gives" not in log, log
    assert {(r["env"]["WORLD_SIZE"], r["env"]["CHAMELEON_MICRO_BATCHES"],
             r["env"]["TORCHELASTIC_RESTART_COUNT"]) for r in later} == {("1", "8", "1")}


def test_the_console_echo_shows_only_what_was_written_while_every_worker_lived(tmp_path):
    log, console = tmp_path / "device0.0.stderr.log", io.BytesIO()
    log.write_bytes(b"")
    echo = ConsoleEcho(console)
    echo.follow(log)
    with open(log, "ab", buffering=0) as fh:
        fh.write(b"epoch 1: 10%\r")
        echo.look()
        fh.write(b"epoch 1: 20%\r")     # after the look: not yet
        echo.release()
        assert console.getvalue() == b"epoch 1: 10%\r"
        echo.look()
        fh.write(b"Traceback: Connection reset by peer\n")   # a peer died meanwhile
        echo.skip()
        echo.look()
        echo.release()
        assert console.getvalue() == b"epoch 1: 10%\r"   # the 20% and the complaint: skipped
        fh.write(b"done\n")
        echo.release(whole=True)      # the workers ended: everything up to now
    assert console.getvalue() == b"epoch 1: 10%\rdone\n"


@pytest.mark.timeout(120)
def test_rank_0s_stderr_reaches_the_console_but_not_a_survivors_complaint(tmp_path, launch):
    job = two_device_job(tmp_path, replicas=True)
    run, _ = _launch_and_kill(launch, tmp_path, ["--job", str(job), "--state-dir",
                                                 str(tmp_path / "state")], "hold-peers-loud")
    console = run.log.read_text()
    assert console.count("probe rank 0 is up") == 2, console   # the first launch and the relaunch
    assert "probe rank 1 is up" not in console   # rank 0's stderr only; rank 1's is in its file
    assert "survivor's complaint" not in console, console
    logs = "".join(p.read_text() for p in (tmp_path / "state" / "logs").glob("*.stderr.log"))
    assert "probe rank 1 is up" in logs
