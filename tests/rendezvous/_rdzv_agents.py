"""Helpers shared by the agent tests: real agent processes, their logs, the workers' progress.

The tests start torch elastic agents (plain torchrun or chameleon-run) as subprocesses that
run ``_gloo_worker.py``; every agent and its workers are SIGKILLed at teardown (the ``agents``
fixture in conftest.py), and every wait polls with a deadline and shows the logs on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psutil

HERE = Path(__file__).parent
WORKER = str(HERE / "_gloo_worker.py")
NODE_AGENT = str(HERE / "_node_agent.py")
TTL = 2
# torch's keep-alive: a node is dead after interval x attempts without a heartbeat; with 2
# attempts a heartbeat that fires a hair early is skipped and live nodes get evicted, so 3.
RDZV_CONF = (
    "join_timeout=40,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,"
    "keep_alive_max_attempt=3,heartbeat_timeout=5,read_timeout=40,retry_timeout=40"
)
T = TypeVar("T")


def torchrun_args(endpoint: str, run_id: str, nnodes: str, out: Path, steps: int,
                  nproc: int = 1) -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd-v3",
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF,
        "--max-restarts", "3", "--monitor-interval", "0.5", "--local-addr", "127.0.0.1",
        WORKER, str(out), str(steps),
    ]


def kill_tree(proc: psutil.Process | subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and all its descendants at once, as a node loss would."""
    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


class Agents:
    """Agent processes of one test; every one of them (and its workers) dies at teardown."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def tails(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(self.logs.glob("*.log"))
        )

    def wait_until(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.tails()}")

    def wait_exit(self, procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
        codes = self.wait_until(
            "agents to exit", lambda: [p.poll() for p in procs]
            if all(p.poll() is not None for p in procs) else None, timeout)
        return codes

    def kill_all(self) -> None:
        for proc in self.procs:
            kill_tree(proc)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def progress(out: Path) -> list[dict[str, Any]]:
    reports = []
    for path in out.glob("progress-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def live_reports(out: Path, world: int, min_step: int) -> list[dict[str, Any]] | None:
    """Reports of running workers in a world of ``world`` that reached ``min_step``."""
    found = [r for r in progress(out) if r["world_size"] == world and r["step"] >= min_step
             and psutil.pid_exists(r["pid"])]
    return found if len(found) == world else None


def chameleon_run() -> list[str]:
    """The chameleon-run console entry point, run by this interpreter."""
    return [sys.executable, "-c",
            "from chameleon_elastic.launcher.cli import console; console()"]
