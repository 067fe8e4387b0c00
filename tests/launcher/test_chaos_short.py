"""The chaos benchmark's short version (issue #16 asks the suite to run one): trials of
chameleon-run on 2 nodes x 2 gloo workers with a three-member etcd cluster, against the
failure-free run's losses: a worker ``kill -9`` and the etcd leader killed; a slowed device and
an etcd member restarted (issue #22)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = "14"   # each run's, the reference's too: a trial is compared step by step


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> Path:
    """The module's chaos.py --journal, holding the failure-free reference run that every
    trial is compared with (``--trials 0``): made once, before the first trial, so that no
    test carries it (the first one took 60 s with it)."""
    path = tmp_path_factory.mktemp("chaos") / "journal.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--trials", "0",
         "--launchers", "chameleon", "--steps", STEPS, "--no-netns", "--journal", str(path)],
        capture_output=True, text=True, timeout=90, cwd=path.parent, check=False)
    assert run.returncode == 0 and path.exists(), (
        f"the failure-free reference run failed: {run.stderr[-3000:]}")
    return path


def _one_trial(tmp_path: Path, journal: Path, faults: str, deadline: int) -> dict:
    """One chameleon-run trial of benchmarks/chaos.py with ``faults``, on loopback, after the
    trials already in ``journal`` (whose reference it reuses). A trial that did not finish
    carries the tails of its launchers' output and events under ``logs`` (for the assertion's
    message: a hang here once left nothing to read)."""
    done = len(journal.read_text().splitlines()) - 1
    logs = tmp_path / "logs"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--trials", str(done + 1),
         "--launchers", "chameleon", "--faults", faults, "--steps", STEPS,
         "--stall", "45", "--deadline", str(deadline), "--no-netns", "--json",
         "--journal", str(journal), "--logs", str(logs), "--resume"],
        capture_output=True, text=True, timeout=140, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)["results"]
    assert len(results) == done + 1, results
    trial = results[-1]
    if trial["outcome"] != "finished":
        trial["logs"] = {f.name: f.read_text().splitlines()[-12:]
                         for f in sorted(logs.glob(f"{done + 1:03d}-*node*.log"))
                         + sorted(logs.glob(f"{done + 1:03d}-*events.log"))}
    return trial


@pytest.mark.timeout(150)   # about 45 s on 2 quiet cores; the timeouts leave room for load
def test_one_chaos_trial_finishes_with_the_failure_free_losses(tmp_path, journal):
    trial = _one_trial(tmp_path, journal, "worker-kill,etcd-leader", 80)
    assert trial["outcome"] == "finished", trial
    kinds = [f["kind"] for f in trial["faults"]]
    assert kinds == ["worker-kill", "etcd-leader"]
    kill = trial["faults"][0]
    assert kill["detect_s"] is not None and kill["recovery_s"] is not None
    assert trial["losses_differ"] == 0   # every printed step, 4 decimals


@pytest.mark.timeout(150)
def test_a_slowed_device_and_a_restarted_etcd_member_cost_nothing_but_time(tmp_path, journal):
    """Issue #22's two faults: one worker is slowed to half speed for 10 s (stopped 60 ms of
    every 120 ms from outside), then an etcd member (any of the three) is killed and started
    again. Neither is a lost device: the run finishes with the failure-free losses and no
    device declared hung."""
    trial = _one_trial(tmp_path, journal, "slow-device,etcd-restart", 110)
    assert trial["outcome"] == "finished", trial
    assert [f["kind"] for f in trial["faults"]] == ["slow-device", "etcd-restart"]
    assert trial["hung_declared"] == 0
    assert trial["losses_differ"] == 0
