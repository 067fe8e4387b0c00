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
