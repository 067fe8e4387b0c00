"""The run's state directory outlives the run only when it holds something to read
(launcher/observation/state_dir.py), and the ones kept are bounded: chameleon-run made one per
run and kept them all (78 on a machine tried for an afternoon), then one per run with a
recovery, even with every worker log empty (23 after an afternoon)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from chameleon_elastic.launcher.observation.state_dir import OWNER, StateDir, prune

from .conftest import MLP_FAULTS, PROBE, two_device_job, wait_for

STARTED = [{"event": "agent_started"}, {"event": "workers_started"},
           {"event": "job_finished", "state": "SUCCEEDED"}]
RECOVERED = [*STARTED, {"event": "failure_seen"}, {"event": "plan_chosen"},
             {"event": "recovered"}]


def _made(tmp_path: Path, stderr: str = "") -> StateDir:
    path = tmp_path / "chameleon-run-x"
    (path / "logs").mkdir(parents=True)
    (path / "logs" / "device0.0.stderr.log").write_text(stderr)
    return StateDir(path, made=True)


@pytest.mark.parametrize("why,outcome,records", [
    ("a quiet success", "succeeded", STARTED),
    ("a success with recoveries: the lines said what happened", "succeeded", RECOVERED),
    ("a node that joined", "succeeded", [*STARTED, {"event": "membership_change"}]),
    ("Ctrl-C: the person asked for the end", "interrupted", RECOVERED),
    ("no worker ever started", "failed", [{"event": "agent_started"}]),
])
def test_a_directory_with_nothing_to_read_goes(tmp_path, why, outcome, records):
    state = _made(tmp_path)
    assert state.close(outcome, records) is None, why
    assert not state.path.exists()


@pytest.mark.parametrize("outcome,records,stderr,says", [
    ("failed", STARTED, "", "the run did not succeed"),
    ("succeeded", RECOVERED, "UserWarning: something to read\n",
     "workers wrote to stderr (logs/device0.0.stderr.log)"),
    ("interrupted", STARTED, "Traceback ...\n",
     "workers wrote to stderr (logs/device0.0.stderr.log)"),
])
def test_a_directory_with_something_to_read_is_kept_and_says_why(tmp_path, outcome, records,
                                                                 stderr, says):
    state = _made(tmp_path, stderr)
    assert state.close(outcome, records) == says
    assert state.path.exists()


def test_a_given_directory_stays_whatever_happened(tmp_path):
    given = StateDir.open(str(tmp_path / "mine"), needed=True)
    assert given is not None and not given.made
    assert given.close("succeeded", STARTED) == "given" and given.path.exists()
    assert StateDir.open(None, needed=False) is None


def test_only_the_newest_kept_directories_stay_and_none_in_use_or_not_ours_is_touched(tmp_path):
    """Each new directory removes the oldest beyond the newest N that chameleon-run made (a
    dead launcher named in ``.launcher``); one a live launcher uses, and one of an older
    version (no ``.launcher``), are left alone."""
    said = "import psutil; p = psutil.Process(); print(p.pid, p.create_time())"
    dead = subprocess.run([sys.executable, "-c", said], capture_output=True, text=True,
                          check=True).stdout   # a launcher that has ended
    names = [f"chameleon-run-20260101-0000{i:02d}-x" for i in range(8)]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER).write_text(dead)
    live = tmp_path / "chameleon-run-20250101-000000-live"   # the oldest, but in use
    live.mkdir()
    me = psutil.Process()
    (live / OWNER).write_text(f"{os.getpid()} {me.create_time()}\n")
    legacy = tmp_path / "chameleon-run-20240101-000000-old"
    legacy.mkdir()
    removed = prune(tmp_path, keep=3, spare=tmp_path / names[-1])
    assert sorted(p.name for p in removed) == names[:5]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [legacy.name, live.name, *names[5:]])


def _tmp_env(tmp_path: Path) -> dict[str, str]:
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    return {"TMPDIR": str(temp)}


def _named(log: str) -> Path:
    first = re.search(r"workers' stderr in (\S+)", log)
    assert first, log
    return Path(first.group(1))


@pytest.mark.timeout(60)
def test_chameleon_run_removes_its_state_directory_after_a_quiet_success(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--no-status", PROBE, str(out), "ok"], env=_tmp_env(tmp_path))
    assert run.wait(50) == 0
    log = run.log.read_text()
    state = _named(log)
    assert not state.exists()
    assert log.strip().splitlines()[-1] == (
        f"chameleon-run: removed {state}: the run succeeded and left nothing to read there "
        "(--state-dir DIR keeps it)")


@pytest.mark.timeout(60)
def test_a_success_after_a_recovery_leaves_nothing_when_the_workers_wrote_nothing(tmp_path,
                                                                                  launch):
    """kill -9 of one of two data-parallel replicas: the survivor recovers in place and
    finishes; the recovery line said what happened, and no worker wrote to stderr."""
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--job",
                               str(two_device_job(tmp_path, replicas=True)), "--no-status",
                               "--monitor-interval", "0.05", MLP_FAULTS, str(out), "8",
                               "1:3:forward:kill"], env=_tmp_env(tmp_path))
    assert run.wait(50) == 0, run.log.read_text()[-3000:]
    log = run.log.read_text()
    state = _named(log)
    assert "device 1 lost (SIGKILL)" in log and not state.exists(), log[-2000:]
    assert log.strip().splitlines()[-1].startswith(f"chameleon-run: removed {state}: ")


@pytest.mark.timeout(60)
def test_ctrl_c_leaves_no_traceback_in_the_workers_logs_and_no_directory(tmp_path, launch):
    """Ctrl-C reaches chameleon-run alone (its workers run in sessions of their own); torch's
    agent passed the SIGINT on, and each runtime worker wrote a KeyboardInterrupt traceback
    (and gloo's "terminate called without an active exception") into its log, which kept the
    directory. The workers are stopped with SIGTERM: their logs stay empty, and the directory
    goes with them."""
    def start(out: Path, name: str, state: list[str], env: dict | None = None):
        out.mkdir()
        return launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--job",
                                    str(two_device_job(tmp_path, replicas=True)), "--no-status",
                                    *state, MLP_FAULTS, str(out), "400", "--pace", "0.05"],
                      name=name, env=env)

    def interrupted(run, out: Path) -> str:
        wait_for(lambda: (out / "steps.jsonl").exists() and len(
            (out / "steps.jsonl").read_text().splitlines()) >= 3, 45, "step 3 trained")
        os.kill(run.proc.pid, signal.SIGINT)
        assert run.wait(40) == 1
        log = run.log.read_text()
        assert log.strip().splitlines()[-1] == (
            "chameleon-run: interrupted (SIGINT): workers stopped"), log[-2000:]
        return log

    state = tmp_path / "given"
    interrupted(start(tmp_path / "out", "given", ["--state-dir", str(state)]), tmp_path / "out")
    logs = {p.name: p.read_text() for p in (state / "logs").glob("*.stderr.log")}
    assert len(logs) == 2 and all(text == "" for text in logs.values()), logs
    # the same in the temporary directory: nothing was written, so nothing is kept
    log = interrupted(start(tmp_path / "again", "again", [], _tmp_env(tmp_path)),
                      tmp_path / "again")
    made = _named(log)
    assert not made.exists(), log[-2000:]
    assert f"chameleon-run: removed {made}: the workers wrote nothing to stderr" in log
