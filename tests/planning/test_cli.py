"""chameleon-plan: tables by default, JSON on request, exit 2 with one sentence on bad requests."""

import json
import subprocess
import sys

import pytest

from chameleon_elastic.planning.cli import main, parse_ids


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chameleon_elastic.planning.cli", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_parse_ids():
    assert parse_ids("3") == [3]
    assert parse_ids("1,4-6,4") == [1, 4, 5, 6]


def test_json_shape(capsys):
    assert main(["--preset", "llama2-7b-910b", "--fail", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("policy", "generation", "pipelines", "spare_devices", "reroute", "transfers",
                "allreduce_rounds", "estimate", "decisions"):
        assert key in out
    assert out["generation"] == 1
    assert set(out["pipelines"][0]) >= {"devices", "layers", "micro_batches"}
    assert set(out["estimate"]) >= {"step_time_s", "transition_time_s", "peak_memory_bytes",
                                    "throughput", "score"}
    (decision,) = out["decisions"]
    assert decision["failed"] == [5]
    assert set(decision["scores"]) == {"reroute", "replan"}
    assert decision["chosen"] == out["policy"]
    assert decision["scores"][out["policy"]] == max(decision["scores"].values())
    assert all(5 not in p["devices"] for p in out["pipelines"]) or 5 in out["failed_devices"]


def test_sequential_events_and_fail_count(capsys):
    assert main(["--preset", "llama2-7b-910b-32", "--fail", "1", "--fail-count", "3",
                 "--seed", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["generation"] for d in out["decisions"]] == [1, 2]
    assert len(out["decisions"][1]["failed"]) == 3
    assert out["global_micro_batches"] == 64


def test_table_explains_the_choice(capsys):
    assert main(["--preset", "llama2-7b-910b", "--fail", "5"]) == 0
    text = capsys.readouterr().out
    assert "layout" in text and "reroute" in text and "replan" in text and "scores" in text


@pytest.mark.parametrize(
    "args, words",
    [
        (["--preset", "nope"], "unknown preset"),
        ([], "no job given"),
        (["--preset", "llama2-7b-910b", "--fail", "42"], "not live"),
        (["--preset", "llama2-7b-910b", "--fail", "0-7"], "must survive"),
        (["--preset", "llama2-7b-910b", "--fail", "0,4", "--policy", "reroute"],
         "lost every replica"),
        (["--preset", "llama2-7b-910b", "--fail-count", "8"], "no live device"),
        (["--preset", "llama2-7b-910b", "--fail", "x"], "not a device list"),
        (["--job", "/nonexistent.toml"], "cannot read job file"),
    ],
)
def test_bad_requests_exit_2_without_traceback(args, words):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_documents_every_flag():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for flag in ("--job", "--preset", "--fail", "--fail-count", "--seed", "--policy", "--json"):
        assert flag in proc.stdout
