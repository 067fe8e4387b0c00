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


def test_the_launcher_without_a_job_imports_neither_the_runtime_nor_the_planner():
    """chameleon-run without --job is torchrun: its command line imports no torch (torchrun's
    imports it once it runs), and its agent neither the trainer nor the planner. Importing
    ``runtime.recording`` (the launcher re-exports record_step) used to load the whole runtime
    and networkx: ~0.3 s per launch, and torch's rendezvous, which walks ``sys.modules`` for
    each of its log lines, grew slower with every module loaded."""
    _import_leaves_out(["chameleon_elastic.launcher.cli"], ["torch"])
    _import_leaves_out(["chameleon_elastic.launcher.agent", "chameleon_elastic.launcher.launch"],
                       ["chameleon_elastic.runtime.trainer", "chameleon_elastic.planning",
                        "networkx", "scipy"])
