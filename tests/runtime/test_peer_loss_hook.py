"""Under chameleon-run a step-driven script that ends on a lost peer says so in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
from chameleon_elastic.runtime.errors import PeerLost, say_peer_loss_in_one_line
say_peer_loss_in_one_line(3)
raise {exc}("gloo: Connection reset by peer")
"""


def _run(exc: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(exc=exc)], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.timeout(90)
def test_a_peer_loss_is_one_line_and_any_other_error_keeps_its_traceback():
    lost = _run("PeerLost")
    assert lost.returncode == 1 and "Traceback" not in lost.stderr
    assert lost.stderr.strip().splitlines() == [
        ("device 3: stopped, a peer was lost (gloo: Connection reset by peer); chameleon-run "
        "handles the loss")]
    bug = _run("ValueError")
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "ValueError" in bug.stderr
