"""The run's state directory outlives the run only when it holds something to read
(launcher/observation/state_dir.py): chameleon-run made one per run and kept them all (78 on a machine
tried for an afternoon)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chameleon_elastic.launcher.observation.state_dir import StateDir

from .conftest import PROBE

STARTED = [{"event": "agent_started"}, {"event": "workers_started"},
           {"event": "job_finished", "state": "SUCCEEDED"}]


def _made(tmp_path: Path, stderr: str = "") -> StateDir:
    path = tmp_path / "chameleon-run-x"
    (path / "logs").mkdir(parents=True)
    (path / "logs" / "device0.0.stderr.log").write_text(stderr)
    return StateDir(path, made=True)


def test_a_quiet_success_leaves_nothing_behind(tmp_path):
    state = _made(tmp_path)
    assert state.close(succeeded=True, records=STARTED)
    assert not state.path.exists()


@pytest.mark.parametrize("why,succeeded,records,stderr", [
    ("a failure", False, STARTED, ""),
    ("a recovery", True, [*STARTED, {"event": "failure_seen"}, {"event": "recovered"}], ""),
    ("a node that joined", True, [*STARTED, {"event": "membership_change"}], ""),
    ("a worker's warning", True, STARTED, "UserWarning: something to read\n"),
])
def test_a_directory_with_something_to_read_is_kept(tmp_path, why, succeeded, records, stderr):
    state = _made(tmp_path, stderr)
    assert not state.close(succeeded=succeeded, records=records), why
    assert state.path.exists()


def test_a_run_that_never_started_a_worker_leaves_nothing_and_a_given_directory_stays(tmp_path):
    assert _made(tmp_path).close(succeeded=False, records=[{"event": "agent_started"}])
    given = StateDir.open(str(tmp_path / "mine"), needed=True)
    assert given is not None and not given.made
    assert not given.close(succeeded=True, records=STARTED) and given.path.exists()
    assert StateDir.open(None, needed=False) is None


@pytest.mark.timeout(60)
def test_chameleon_run_removes_its_state_directory_after_a_quiet_success(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--no-status", PROBE, str(out), "ok"])
    assert run.wait(50) == 0
    log = run.log.read_text()
    first = re.search(r"workers' stderr in (\S+)", log)
    assert first, log
    state = Path(first.group(1))
    assert not state.exists()
    assert log.strip().splitlines()[-1] == (
        f"chameleon-run: removed {state}: the run succeeded and left nothing to read there "
        "(--state-dir DIR keeps it)")
