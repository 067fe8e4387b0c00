"""What the runtime's process-level tests share: rank scripts started on a real TCPStore."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

#: a rank script's arguments: its rank, the store's port, then the test's own
Start = Callable[..., list[subprocess.Popen]]


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[tuple[dist.TCPStore, Start]]:
    """(the store, ``start(script, world, *args, drop_env=())``): ``start`` writes the
    script and runs ``world`` ranks of it (stdout and stderr piped, text); every rank started
    is reaped at the end (killed if it has not exited 20 s after the test)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    started: list[subprocess.Popen] = []

    def start(script: str, world: int, *args: str,
              drop_env: tuple[str, ...] = ()) -> list[subprocess.Popen]:
        path = tmp_path / "rank.py"
        path.write_text(script)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        for name in drop_env:
            env.pop(name, None)
        procs = [subprocess.Popen([sys.executable, str(path), str(r), str(server.port), *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for r in range(world)]
        started.extend(procs)
        return procs

    yield server, start
    deadline = time.monotonic() + 20
    for proc in started:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
