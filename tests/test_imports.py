"""What importing a part of the package must not pull in: the planner stays importable without
torch (the simulator and chameleon-plan rely on it), and every process start stays lean."""

import subprocess
import sys


def _import_leaves_out(modules: list[str], absent: list[str]) -> None:
    """Import ``modules`` in a fresh interpreter; fail naming any of ``absent`` it loaded."""
    code = (f"import sys; import {', '.join(modules)}; "
            f"bad = [m for m in {absent!r} if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_planning_and_cli_do_not_import_torch():
    _import_leaves_out(["chameleon_elastic.planning", "chameleon_elastic.planning.cli",
                        "chameleon_elastic.spec", "chameleon_elastic.plan"],
                       ["torch", "torch.distributed"])


def test_the_agent_and_the_runtime_start_without_dcp_or_dtensor():
    """torch.distributed.checkpoint and torch.distributed.tensor cost about a second of import
    per process (sympy, torch.export): every agent and every worker paid it at start-up,
    whether the job checkpoints or shards layers or not. They load when first used."""
    _import_leaves_out(["chameleon_elastic.launcher.cli", "chameleon_elastic.runtime"],
                       ["torch.distributed.checkpoint", "torch.distributed.tensor", "sympy"])
