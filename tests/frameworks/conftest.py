"""What the framework tests share: a dp=2 job, a launch with a real kill -9 of one worker at a
known step, a cheap reference run, and the comparison of per-step losses.

Each example under examples/frameworks/ writes one JSON line per optimizer step to
``OUT/steps.jsonl`` and, with ``--hold-after-step K``, makes rank 0 of the first plan wait after
step K for good (a stuck worker): the test kills that worker there, so the kill lands at a known
step with no race against the steps after it. Every wait polls a condition with a deadline and
names its phase when it times out; every process a test started is killed by pid at its end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "frameworks"
STEPS = 12
HOLD_AFTER = 4            # the victim is killed after logging this step
#: float32 losses summed in another order (2 ranks x 2 micro-batches, or 1 x 4)
RTOL = 1e-5

#: 2 cards, 2 data-parallel replicas of one stage, 4 micro-batches of 4 samples per step: 2 per
#: worker, 4 for a survivor
JOB = """
name = "frameworks"
[model]
layers = 2
forward_s = 0.002
backward_s = 0.004
param_bytes = 1.0e6
optimizer_bytes = 2.0e6
activation_bytes = 2.0e5
[cluster]
devices = 2
device_memory_bytes = 2e9
bandwidth_bytes_per_s = 1e9
restart_s = 2.0
failure_rate_per_hour = 0.1
[training]
dp = 2
pp = 1
global_micro_batches = 4
micro_batch_size = 4
"""


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             log: Path | None = None) -> object:
    """Poll ``predicate`` until it is true; past ``timeout`` fail naming ``what`` (the phase)
    with the tail of ``log``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out after {timeout:.0f} s {what}\n{tail}")
        time.sleep(0.05)


def read_steps(out: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x]
    except (OSError, json.JSONDecodeError):
        return []


def reference(script: str, out: Path, *args: str, torchrun: bool = False,
              timeout: float = 60) -> dict[int, float]:
    """The example alone (or under ``torchrun --nproc-per-node 1``): step -> loss."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "1"] if torchrun else [sys.executable])
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as fh:
        try:
            code = subprocess.run([*launcher, str(EXAMPLES / script), str(out), *args],
                                  stdout=fh, stderr=subprocess.STDOUT, env=env(),
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout:.0f} s running the reference "
                                 f"{script}\n{log.read_text()[-3000:]}") from None
    assert code == 0, f"reference {script} exited {code}\n{log.read_text()[-3000:]}"
    return {r["step"]: r["loss"] for r in read_steps(out)}


@dataclass
class KilledRun:
    """One chameleon-run --job launch whose device 0 was killed after logging HOLD_AFTER."""

    code: int
    records: list[dict]
    victim: int
    log: Path
    seconds: float
    seen: set[int] = field(default_factory=set)


@pytest.fixture
def killed_run(tmp_path: Path) -> Iterator[Callable[..., KilledRun]]:
    """``run(script, *args)``: the launch, the kill and the end, each phase with a deadline;
    whatever it started is killed by pid when the test ends."""
    started: list[tuple[subprocess.Popen, set[int]]] = []

    def run(script: str, *args: str, timeout: float = 90) -> KilledRun:
        job, out, log = tmp_path / "job.toml", tmp_path / "out", tmp_path / "launcher.log"
        job.write_text(JOB)
        begin = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
                 "--nproc-per-node", "2", "--job", str(job), "--max-restarts", "3",
                 "--monitor-interval", "0.05", "--no-status", str(EXAMPLES / script), str(out),
                 "--steps", str(STEPS), "--hold-after-step", str(HOLD_AFTER), *args],
                stdout=fh, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
        seen: set[int] = set()
        started.append((proc, seen))
        wait_for(lambda: any(r["step"] == HOLD_AFTER for r in read_steps(out))
                 or proc.poll() is not None, timeout / 2,
                 f"for step {HOLD_AFTER} of the first plan to be logged", log)
        assert proc.poll() is None, f"launcher ended before the kill\n{log.read_text()[-3000:]}"
        victim = wait_for(lambda: worker_of(proc.pid, 0, script, seen), 10,
                          "to find device 0's worker among the launcher's children", log)
        os.kill(victim, signal.SIGKILL)

        def ended() -> bool:
            worker_of(proc.pid, -1, script, seen)   # remember the relaunched workers too
            return proc.poll() is not None

        wait_for(ended, timeout - (time.monotonic() - begin),
                 "for the launcher to finish after the kill (re-plan, relaunch, training)", log)
        return KilledRun(proc.returncode, read_steps(out), victim, log,
                         time.monotonic() - begin, seen)

    yield run
    for proc, seen in started:
        for pid in [proc.pid, *seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def worker_of(launcher: int, device: int, script: str, seen: set[int]) -> int | None:
    """The pid of ``script``'s worker of ``device`` (``CHAMELEON_DEVICE``) among the launcher's
    descendants; every worker found goes into ``seen`` (to be killed at the test's end)."""
    try:
        children = psutil.Process(launcher).children(recursive=True)
    except psutil.Error:
        return None
    found = None
    for child in children:
        try:
            if script not in " ".join(child.cmdline()):
                continue
            seen.add(child.pid)
            if child.environ().get("CHAMELEON_DEVICE") == str(device):
                found = child.pid
        except psutil.Error:
            continue
    return found


def assert_follows_reference(run: KilledRun, ref: dict[int, float]) -> float:
    """Exit 0 and no warning about an unfollowed share; every step trained, each record's loss
    the reference's within float32's rounding; the first plan's records from 2 workers x 2 micro-batches, the survivor's from
    1 x 4 in a new process. Returns the largest difference."""
    tail = run.log.read_text()[-3000:]
    assert run.code == 0, f"launcher exited {run.code}\n{tail}"
    # the adapter announced that the script follows the plan: no line about a share it ignores
    # (launcher/observation/shares.py's share_change)
    assert "of its batch per step" not in run.log.read_text(), tail
    assert sorted(ref) == list(range(STEPS)), ref
    assert {r["step"] for r in run.records} == set(range(STEPS)), run.records
    before = [r for r in run.records if r["generation"] == 0]
    after = [r for r in run.records if r["generation"] > 0]
    assert max(r["step"] for r in before) == HOLD_AFTER, before
    assert all((r["world_size"], r["accumulation"]) == (2, 2) for r in before), before
    assert after and all((r["world_size"], r["accumulation"]) == (1, 4) for r in after), after
    assert run.victim in {r["pid"] for r in before}, (run.victim, before)
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}, run.records
    diffs = [abs(r["loss"] - ref[r["step"]]) for r in run.records]
    for r, diff in zip(run.records, diffs):
        assert diff <= RTOL * max(1.0, abs(ref[r["step"]])), (r, ref[r["step"]], diff)
    return max(diffs)
