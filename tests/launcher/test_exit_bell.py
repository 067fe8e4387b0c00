"""The agent's SIGCHLD bell (launcher/workers/processes.py ``ExitBell``) under a storm of child exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A child that forks many short-lived children and waits for each with the bell, as the agent's
# monitor loop does: the handler runs at arbitrary points of the main thread's ``wait``.
STORM = """
import os, sys
from chameleon_elastic.launcher.workers.processes import ExitBell
with ExitBell() as bell:
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        while os.waitpid(pid, os.WNOHANG)[0] != pid:
            bell.wait(0.0001)
print("reaped all")
"""


@pytest.mark.timeout(60)
def test_the_exit_bell_survives_a_storm_of_child_exits():
    """The handler used to set a threading.Event, whose lock the main thread could be holding
    in the same Event's wait: the agent deadlocked with a zombie worker (4 runs in 5 of this
    storm hung). Writing to a pipe takes no lock."""
    try:
        done = subprocess.run([sys.executable, "-c", STORM, "300"], check=False,
                              capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("the bell's wait deadlocked: 300 child exits were not all reaped in 45 s")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "reaped all"
