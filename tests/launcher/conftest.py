"""Helpers for launcher tests: start launchers as real process trees, poll with deadlines, and
kill whatever a test started (by its own process group) when it ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

PROBE = str(Path(__file__).parent / "workers" / "probe.py")


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def read_envs(out: Path) -> list[dict]:
    """Every worker launch recorded by probe.py, oldest first."""
    records = []
    for path in out.glob("env-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(records, key=lambda r: r["time"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launcher:
    """One launcher process (chameleon-run or torchrun) in its own process group."""

    def __init__(self, tool: str, args: list[str], log: Path, env: dict | None = None) -> None:
        module = {"chameleon": "chameleon_elastic.launcher.cli",
                  "torchrun": "torch.distributed.run"}[tool]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.log = log
        self._fh = open(log, "w")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=self._fh,
                                     stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher did not finish in {timeout:.0f} s; log:\n"
                                 + self.log.read_text()[-3000:]) from None
        finally:
            self._fh.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._fh.close()


@pytest.fixture
def launch(tmp_path):
    started: list[Launcher] = []
    worker_pids: list[int] = []

    def start(tool: str, args: list[str], name: str = "launcher", env: dict | None = None):
        launcher = Launcher(tool, args, tmp_path / f"{name}.log", env)
        started.append(launcher)
        return launcher

    start.worker_pids = worker_pids
    yield start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.kill()
    # workers run in their own sessions: end any that a failed test left behind (by pid)
    for out in tmp_path.rglob("env-*.json"):
        try:
            pid = json.loads(out.read_text())["pid"]
        except (OSError, json.JSONDecodeError, KeyError):
            continue
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
