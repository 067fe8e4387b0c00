"""Every exit status of chameleon-run (chameleon_elastic/exit_status.py), each produced by a real
launcher: 0, 1 and 2 as torchrun's, 75 for a preemption, 93 for a job no plan can run any more
(the runtime's preemption with a checkpoint is in test_preemption.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from chameleon_elastic.exit_status import ExitStatus

from .conftest import PROBE, pid_alive, read_envs, wait_for

# fits dp=1 x pp=4 on 4 devices of 9 MB; on 3 devices no layout fits (chameleon-plan says so)
TIGHT_JOB = """
name = "tight"
[model]
layers = 8
forward_s = 0.002
backward_s = 0.004
param_bytes = 1.0e6
optimizer_bytes = 2.0e6
activation_bytes = 1.0e3
[cluster]
devices = 4
device_memory_bytes = 9.0e6
bandwidth_bytes_per_s = 1e9
restart_s = 2.0
failure_rate_per_hour = 0.1
[training]
dp = 1
pp = 4
global_micro_batches = 4
"""


def test_the_codes_keep_torchruns_and_add_preempted_and_do_not_requeue():
    assert [int(s) for s in ExitStatus] == [0, 1, 2, 75, 93]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "status"), [("ok", ExitStatus.SUCCESS),
                                              ("fail", ExitStatus.FAILED)])
def test_success_and_failure_are_torchruns(tmp_path, launch, mode, status):
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--no-status",
                               PROBE, str(out), mode])
    assert run.wait(50) == status, run.log.read_text()[-2000:]


@pytest.mark.timeout(60)
def test_a_usage_error_is_2(tmp_path, launch):
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--metrics-port",
                               "70000", PROBE, str(tmp_path), "ok"])
    assert run.wait(50) == ExitStatus.USAGE
    assert "--metrics-port 70000 is not a port" in run.log.read_text()


@pytest.mark.timeout(60)
def test_sigterm_to_a_plain_script_is_forwarded_and_the_run_is_preempted(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--no-status",
                               PROBE, str(out), "hold"])
    workers = wait_for(lambda: len(read_envs(out)) == 2 and read_envs(out), 45,
                       "the two workers to start")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(40) == ExitStatus.PREEMPTED
    assert run.log.read_text().strip().splitlines()[-1] == (
        "chameleon-run: preempted (SIGTERM): the signal was forwarded to the workers, which "
        "stopped; what the script did not save is lost (exit status 75: requeue)")
    for record in workers:
        wait_for(lambda r=record: not pid_alive(r["pid"]), 10, "the workers to be gone")


@pytest.mark.timeout(60)
def test_no_plan_for_the_devices_left_is_do_not_requeue(tmp_path, launch):
    job = tmp_path / "tight.toml"
    job.write_text(TIGHT_JOB)
    out = tmp_path / "out"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--job", str(job),
                               "--no-status", "--state-dir", str(tmp_path / "state"),
                               PROBE, str(out), "hold"])
    workers = wait_for(lambda: len(read_envs(out)) == 4 and read_envs(out), 45,
                       "the four workers to start")
    victim = next(r for r in workers if r["env"]["CHAMELEON_DEVICE"] == "3")
    os.kill(victim["pid"], signal.SIGKILL)
    assert run.wait(40) == ExitStatus.DO_NOT_REQUEUE, run.log.read_text()[-2000:]
    lines = run.log.read_text().strip().splitlines()
    assert any("no layout of 3 live devices fits in memory" in x for x in lines), lines
    assert "Traceback" not in "".join(lines)
    for record in workers:
        wait_for(lambda r=record: not pid_alive(r["pid"]), 10, "the workers to be gone")


def test_the_docs_table_lists_every_status():
    text = (Path(__file__).resolve().parents[2] / "docs" / "launcher.md").read_text()
    for status in ExitStatus:
        assert f"| {int(status)} | `{status.name}`" in text, status
