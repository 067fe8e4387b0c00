"""chameleon-run vs torchrun on the same flags: same worker environment, same exit codes.

Both launchers run side by side (concurrently, to halve the wall time) on probe.py, which
records its environment. Values must be equal except run ids, ports and the paths derived from
the run id (error files).
"""

from __future__ import annotations

import os

import pytest

from .conftest import PROBE, free_port, read_envs

# Values that legitimately differ between two runs of the same launcher.
RUN_SPECIFIC = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# Set in the launcher's own environment by chameleon-run (inherited, not a worker variable).
OURS_INHERITED = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}


def _side_by_side(tmp_path, launch, flags: list[str], mode: list[str], timeout: float = 50):
    runs = {}
    for tool in ("torchrun", "chameleon"):
        out = tmp_path / tool
        out.mkdir()
        extra = ["--no-status"] if tool == "chameleon" else []
        mine = [f.format(port=free_port()) for f in flags]  # each its own port: they run at once
        runs[tool] = (launch(tool, [*mine, *extra, PROBE, str(out), *mode], name=tool), out)
    codes = {tool: run.wait(timeout) for tool, (run, _) in runs.items()}
    records = {tool: read_envs(out) for tool, (_, out) in runs.items()}
    return codes, records


def _launcher_vars(record: dict) -> dict[str, str]:
    """What the launcher gave the worker: its variables minus the test's own environment."""
    env = record["env"]
    return {k: v for k, v in env.items()
            if k not in os.environ or os.environ[k] != v or k == "OMP_NUM_THREADS"}


def _by_rank(records: list[dict]) -> dict[str, dict]:
    return {r["env"]["RANK"]: r for r in records}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [
    ["--standalone", "--nproc-per-node", "2"],
    ["--nnodes", "1", "--nproc_per_node", "2", "--master-port", "{port}", "--max_restarts", "1"],
], ids=["standalone", "static-master-port"])
def test_same_standard_environment_as_torchrun(tmp_path, launch, flags):
    codes, records = _side_by_side(tmp_path, launch, flags, ["ok"])
    assert codes == {"torchrun": 0, "chameleon": 0}
    theirs, ours = _by_rank(records["torchrun"]), _by_rank(records["chameleon"])
    assert sorted(theirs) == sorted(ours) == ["0", "1"]
    for rank in theirs:
        a, b = _launcher_vars(theirs[rank]), _launcher_vars(ours[rank])
        assert set(a) == set(b) - OURS_INHERITED, (set(a) ^ set(b))
        differing = {k for k in a if a[k] != b[k]}
        assert differing <= RUN_SPECIFIC, {k: (a[k], b[k]) for k in differing}
        assert not any(k.startswith("CHAMELEON_") for k in b)   # no --job: torchrun's world
        assert theirs[rank]["argv"][1:] == ours[rank]["argv"][1:]  # [0] is the output dir


@pytest.mark.timeout(60)
def test_failing_script_exit_code_matches(tmp_path, launch):
    codes, _ = _side_by_side(tmp_path, launch,
                                   ["--standalone", "--nproc-per-node", "2"], ["fail"])
    assert codes["torchrun"] != 0
    assert codes == {"torchrun": codes["torchrun"], "chameleon": codes["torchrun"]}


@pytest.mark.timeout(60)
def test_max_restarts_used_up_exit_code_and_launch_count_match(tmp_path, launch):
    codes, records = _side_by_side(tmp_path, launch,
                                   ["--standalone", "--nproc-per-node", "1", "--max-restarts", "2"],
                                   ["fail"])
    assert codes["torchrun"] != 0
    assert codes["chameleon"] == codes["torchrun"]
    counts = {tool: sorted(r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in recs)
              for tool, recs in records.items()}
    assert counts["torchrun"] == counts["chameleon"] == ["0", "1", "2"]
