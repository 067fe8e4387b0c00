"""The planner must stay importable without torch: the simulator and chameleon-plan rely on it."""

import subprocess
import sys


def test_planning_and_cli_do_not_import_torch():
    code = (
        "import sys; import chameleon_elastic.planning, chameleon_elastic.planning.cli, "
        "chameleon_elastic.spec, chameleon_elastic.plan; "
        "bad = [m for m in ('torch', 'torch.distributed') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_agent_and_the_runtime_start_without_dcp_or_dtensor():
    """torch.distributed.checkpoint and torch.distributed.tensor cost about a second of import
    per process (sympy, torch.export): every agent and every worker paid it at start-up,
    whether the job checkpoints or shards layers or not. They load when first used."""
    code = (
        "import sys; import chameleon_elastic.launcher.cli, chameleon_elastic.runtime; "
        "bad = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', "
        "'sympy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
