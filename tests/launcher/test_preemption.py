"""Preemption with nothing lost: SIGTERM (or SIGUSR1 given in --signals-to-handle) to
chameleon-run during the tiny GPT's training; the workers stop at one step boundary with a
checkpoint, the launcher exits PREEMPTED, and the same command goes on at the next step with
the losses of an uninterrupted run. The GPT runs on two workers as one pipeline of two stages
(conftest.TWO_DEVICES): the stop is still agreed between processes, at half the start-ups of
the preset's four."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.runtime.state.checkpoint import latest_step

from .conftest import Launcher, pid_alive, two_device_job, wait_for

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")
STEPS = 24   # the signal comes at step 10 at the latest: 14 steps to spare
STEP_LINE = re.compile(r"^step +(\d+) +loss (\d+\.\d{4})", re.MULTILINE)


def gpt_args(tmp_path: Path, checkpoints: bool = True) -> list[str]:
    return ["--standalone", "--nproc-per-node", "2", "--job", str(two_device_job(tmp_path)),
            "--no-status", "--state-dir", str(tmp_path / "state"), GPT, "--steps", str(STEPS),
            "--log-every", "1", "--precision", "fp32",
            *(["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"]
              if checkpoints else [])]


def losses(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for step, loss in STEP_LINE.findall(text):
        assert int(step) not in found, f"step {step} printed twice"
        found[int(step)] = loss
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    """The printed losses of the same run without a signal (the baseline)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run = Launcher("chameleon", gpt_args(tmp), tmp / "launcher.log")
    try:
        assert run.wait(120) == 0, run.log.read_text()[-2000:]
    finally:
        if run.proc.poll() is None:
            run.kill()
    found = losses(run.log.read_text())
    assert sorted(found) == list(range(STEPS))
    return found


def _workers(launcher_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher_pid).children(recursive=True)
            if any("train_gpt.py" in part for part in p.cmdline())]


@pytest.mark.timeout(240)   # three runs of the tiny GPT, one of them the baseline
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_sigterm_at_step_10_commits_a_checkpoint_and_the_same_command_resumes_exactly(
        tmp_path, launch, uninterrupted, sig):
    args = gpt_args(tmp_path)
    run = launch("chameleon", args, name="first")
    wait_for(lambda: re.search(r"^step +10 ", run.log.read_text(), re.MULTILINE), 90, "step 10")
    workers = _workers(run.proc.pid)
    assert len(workers) == 2
    os.kill(run.proc.pid, sig)
    assert run.wait(30) == ExitStatus.PREEMPTED, run.log.read_text()[-2000:]
    for worker in workers:
        wait_for(lambda w=worker: not pid_alive(w.pid), 5, f"worker {worker.pid} to be gone")
    first = run.log.read_text()
    done = losses(first)
    last = max(done)
    assert sorted(done) == list(range(last + 1)) and last >= 10
    assert (f"chameleon-run: preempted ({sig.name}): every worker stopped after step {last} "
            f"with its checkpoint committed; run the same command to resume at step "
            f"{last + 1}") in first
    assert "Traceback" not in first

    again = launch("chameleon", args, name="second")
    assert again.wait(90) == 0, again.log.read_text()[-2000:]
    second = again.log.read_text()
    assert f"resumed from the checkpoint after step {last}" in second
    rest = losses(second)
    assert sorted(rest) == list(range(last + 1, STEPS))   # nothing redone, nothing skipped
    assert {**done, **rest} == uninterrupted


@pytest.mark.timeout(150)
def test_sigterm_without_a_checkpoint_directory_says_what_was_lost(tmp_path, launch):
    run = launch("chameleon", gpt_args(tmp_path, checkpoints=False))
    wait_for(lambda: re.search(r"^step +3 ", run.log.read_text(), re.MULTILINE), 90, "step 3")
    workers = _workers(run.proc.pid)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(30) == ExitStatus.PREEMPTED, run.log.read_text()[-2000:]
    last = re.findall(r"chameleon-run: preempted.*", run.log.read_text())
    assert len(last) == 1
    assert re.fullmatch(r"chameleon-run: preempted \(SIGTERM\): workers stopped; the job writes "
                        r"no checkpoints \(no --checkpoint-dir\), so the \d+ steps trained are "
                        r"lost \(exit status 75: requeue\)", last[0]), last
    for worker in workers:
        wait_for(lambda w=worker: not pid_alive(w.pid), 5, f"worker {worker.pid} to be gone")


@pytest.mark.timeout(150)
def test_sigusr1_from_signals_to_handle_is_a_preemption_too(tmp_path, launch):
    args = gpt_args(tmp_path)
    run = launch("chameleon", ["--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", *args])
    wait_for(lambda: re.search(r"^step +3 ", run.log.read_text(), re.MULTILINE), 90, "step 3")
    os.kill(run.proc.pid, signal.SIGUSR1)
    assert run.wait(30) == ExitStatus.PREEMPTED, run.log.read_text()[-2000:]
    text = run.log.read_text()
    last = max(losses(text))
    assert (f"preempted (SIGUSR1): every worker stopped after step {last} with its checkpoint "
            f"committed") in text
    assert latest_step(tmp_path / "ckpt") == last + 1   # the committed steps, 0..last


@pytest.mark.timeout(150)
def test_a_worker_signalled_alone_stops_the_job_at_one_step_and_the_agent_ends_preempted(
        tmp_path, launch):
    """What a node sees when another node is preempted: its workers stop (the vote carries the
    stop to every rank) and exit 75 without its agent having a signal of its own. Here one
    worker gets SIGUSR1 straight from the "scheduler"."""
    run = launch("chameleon", ["--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1",
                               *gpt_args(tmp_path)])
    wait_for(lambda: re.search(r"^step +3 ", run.log.read_text(), re.MULTILINE), 90, "step 3")
    os.kill(_workers(run.proc.pid)[-1].pid, signal.SIGUSR1)
    assert run.wait(30) == ExitStatus.PREEMPTED, run.log.read_text()[-2000:]
    text = run.log.read_text()
    last = max(losses(text))
    assert (f"preempted (on another node, or by a signal to the workers): every worker stopped "
            f"after step {last} with its checkpoint committed") in text
    assert latest_step(tmp_path / "ckpt") == last + 1
