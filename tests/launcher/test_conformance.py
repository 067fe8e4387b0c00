"""chameleon-run vs torchrun on the same flags: same worker environment, same exceptions and
exit codes.

Both launchers run side by side (concurrently, to halve the wall time) on probe.py, which
records its environment. Values must be equal except run ids, ports and the paths derived from
the run id (error files). Bad combinations of torch's own flags are driven through both
programmatic entry points (``torch.distributed.run.main(args)`` and ``cli.main(args)``) and both
commands.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed.run as torchrun

from chameleon_elastic.launcher import cli

from .conftest import PROBE, free_port, read_envs

# Values that legitimately differ between two runs of the same launcher.
RUN_SPECIFIC = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


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
    # a function entry point: torch starts it through multiprocessing, not subprocess
    ["--standalone", "--nproc-per-node", "2", "--run-path"],
], ids=["standalone", "static-master-port", "run-path"])
def test_same_standard_environment_as_torchrun(tmp_path, launch, flags):
    codes, records = _side_by_side(tmp_path, launch, flags, ["ok"])
    assert codes == {"torchrun": 0, "chameleon": 0}
    theirs, ours = _by_rank(records["torchrun"]), _by_rank(records["chameleon"])
    assert sorted(theirs) == sorted(ours) == ["0", "1"]
    for rank in theirs:
        a, b = _launcher_vars(theirs[rank]), _launcher_vars(ours[rank])
        assert set(a) == set(b), (set(a) ^ set(b))
        differing = {k for k in a if a[k] != b[k]}
        assert differing <= RUN_SPECIFIC, {k: (a[k], b[k]) for k in differing}
        assert not any(k.startswith("CHAMELEON_") for k in b)   # no --job: torchrun's world
        assert theirs[rank]["argv"][1:] == ours[rank]["argv"][1:]  # [0] is the output dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", [[], ["--run-path"]], ids=["script", "run-path"])
def test_failing_script_exit_code_matches(tmp_path, launch, entry):
    codes, _ = _side_by_side(tmp_path, launch,
                             ["--standalone", "--nproc-per-node", "2", *entry], ["fail"])
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


@pytest.mark.timeout(60)
def test_with_a_preset_workers_get_torchruns_environment_plus_chameleon_variables(tmp_path,
                                                                                 launch):
    flags = ["--standalone", "--nproc-per-node", "4"]
    runs = {}
    for tool, extra in (("torchrun", []), ("chameleon", ["--no-status", "--preset", "tiny-cpu",
                                                         "--state-dir", str(tmp_path / "s")])):
        out = tmp_path / tool
        out.mkdir()
        runs[tool] = (launch(tool, [*flags, *extra, PROBE, str(out), "ok"], name=tool), out)
    assert {tool: run.wait(50) for tool, (run, _) in runs.items()} == {"torchrun": 0,
                                                                       "chameleon": 0}
    theirs = _by_rank(read_envs(runs["torchrun"][1]))
    ours = _by_rank(read_envs(runs["chameleon"][1]))
    for rank in theirs:
        a, b = _launcher_vars(theirs[rank]), _launcher_vars(ours[rank])
        extra = set(b) - set(a)
        assert set(a) <= set(b) and extra and all(k.startswith("CHAMELEON_") for k in extra), extra
        # one of torchrun's variables differs with a job, on purpose: NCCL's watchdog must not
        # tear a survivor down (launcher/workers/worker_env.py), unless the user chose
        watchdog = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
        assert {k for k in a if a[k] != b[k]} <= RUN_SPECIFIC | {watchdog}
        assert ours[rank]["env"][watchdog] == os.environ.get(watchdog, "0")


# torch's own flags, combined wrongly: torchrun raises ValueError before starting anything
BAD_TORCH_FLAGS = {
    "no-python-with-module": ["--no-python", "--module", "--standalone", "x"],
    "nproc-per-node-word": ["--standalone", "--nproc-per-node", "many", "x.py"],
    "unknown-logs-specs": ["--standalone", "--logs-specs", "no-such-specs", "x.py"],
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", BAD_TORCH_FLAGS.values(), ids=BAD_TORCH_FLAGS.keys())
def test_bad_torch_flags_raise_what_torchrun_raises(monkeypatch, argv):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # torch sets it in its own environment
    with pytest.raises(Exception) as theirs:
        torchrun.main(list(argv))
    with pytest.raises(Exception) as ours:
        cli.main(list(argv))
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
    assert type(theirs.value) is ValueError


def _command(tool: str, argv: list[str], cwd) -> subprocess.CompletedProcess:
    module = "torch.distributed.run" if tool == "torchrun" else "chameleon_elastic.launcher.cli"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # the banner shows
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env=env, check=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [*BAD_TORCH_FLAGS.values(),
                                  ["--standalone", "--nproc-per-node", "2", "no_such_script.py"]],
                         ids=[*BAD_TORCH_FLAGS.keys(), "missing-script"])
def test_the_command_exits_like_torchrun_with_one_sentence(tmp_path, argv):
    theirs, ours = _command("torchrun", argv, tmp_path), _command("chameleon", argv, tmp_path)
    assert theirs.returncode == ours.returncode == 1
    lines = ours.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chameleon-run: "), ours.stderr
    assert "Traceback" not in ours.stderr + ours.stdout and "OMP_NUM_THREADS" not in ours.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [
    ["--no-such-flag"],                 # torch's parser refuses it
    ["--policy", "reroute"],            # ours: only with --job/--preset
    ["--stragglers", "off"],            # ours: only with --job/--preset
    ["--preset", "tiny-cpu", "--stragglers", "sometimes"],   # not auto or off
    ["--preset", "no-such-preset"],     # ours: an unknown preset
    # more than one process: torch's OMP_NUM_THREADS banner is due, but not before our error
    ["--nproc-per-node", "4", "--preset", "no-such-preset"],
    ["--nproc-per-node", "3", "--preset", "tiny-cpu"],     # 3 devices for a 4-device job
], ids=["unknown-flag", "policy-without-job", "stragglers-without-job", "stragglers-bad",
        "unknown-preset", "unknown-preset-nproc-4", "job-device-mismatch"])
def test_a_usage_error_is_one_sentence_and_exit_2(tmp_path, argv):
    argv = [*argv, PROBE, str(tmp_path), "ok"]
    ours = _command("chameleon", argv, tmp_path)
    assert ours.returncode == 2
    lines = ours.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("; see chameleon-run --help"), ours.stderr
    if argv[0] == "--no-such-flag":
        assert _command("torchrun", argv, tmp_path).returncode == 2


@pytest.mark.timeout(60)
def test_the_agent_records_torchs_failure_event_when_it_raises(tmp_path):
    # a second node never comes: the agent's rendezvous raises a timeout
    argv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "alone",   # port 0: no race
            "--rdzv-conf", "join_timeout=3,is_host=true",
            "--event-log-handler", "console", "--no-status", PROBE, str(tmp_path), "ok"]
    ours = _command("chameleon", argv, tmp_path)
    assert ours.returncode == 1
    assert "torchelastic.worker.status.FAILED" in ours.stderr, ours.stderr[-2000:]
    said = [x for x in ours.stderr.splitlines() if not x.startswith("{")]   # not the event
    assert said[-1].startswith("chameleon-run: the rendezvous failed"), said
    assert "Traceback" not in "\n".join(said)


@pytest.mark.timeout(60)
def test_on_a_terminal_the_status_line_never_swallows_a_worker_line(tmp_path):
    import re
    import shlex
    import shutil

    if shutil.which("script") is None:
        pytest.skip("util-linux `script` (a pseudo-terminal) is not installed")
    cmd = shlex.join([sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
                      "--nproc-per-node", "2", "--no-python", "echo", "hello-from-a-worker"])
    run = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True,
                         timeout=50, cwd=tmp_path, check=False, env={**os.environ, "COLUMNS": "80"})
    assert run.returncode == 0, run.stdout[-2000:]
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip("\r") for x in run.stdout.splitlines()]
    workers = [x for x in lines if "hello-from-a-worker" in x]
    status = [x for x in lines if "chameleon-run gen" in x]
    assert len(workers) == 2 and all(x == "hello-from-a-worker" for x in workers), lines
    assert status and all(x.startswith("[chameleon-run gen") and x.endswith("]") for x in status)
