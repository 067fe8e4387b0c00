"""What the kill -9 benchmarks share: finding a launcher's worker, and waiting for a launcher
with a deadline while remembering every process it started, so that none outlives the trial."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

__all__ = ["busy_loops", "supervise", "worker_of"]


def worker_of(launcher: int, device: int, script: str = "train_gpt") -> int | None:
    """The pid of ``script``'s worker of ``device`` (``CHAMELEON_DEVICE``, or ``RANK`` under
    torchrun) among the launcher's descendants."""
    try:
        children = psutil.Process(launcher).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            env = child.environ()
            if (env.get("CHAMELEON_DEVICE", env.get("RANK")) == str(device)
                    and script in " ".join(child.cmdline())):
                return child.pid
        except psutil.Error:
            continue
    return None


def supervise(proc: subprocess.Popen, deadline_s: float) -> int | None:
    """Wait for the launcher until ``deadline_s``; then SIGKILL it and every process it was
    seen to start. Returns its exit code, None when the deadline passed."""
    family: set[int] = {proc.pid}
    end = time.monotonic() + deadline_s
    code = None
    while code is None and time.monotonic() < end:
        try:
            family.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:
            pass
        try:
            code = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return code


@contextlib.contextmanager
def busy_loops(n: int):
    """``n`` processes spinning on a core each for as long as the block runs: a shared, loaded
    machine, on which the tail of a recovery shows."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()
