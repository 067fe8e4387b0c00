"""chameleon-plan: tables by default, JSON on request; one line on stderr and exit 2 for a bad
request, exit 1 when a sound request has no plan."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_elastic.planning.cli import main, parse_ids
from chameleon_elastic.spec import JobSpec


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
        (["--preset", "llama2-7b-910b", "--fail", "3", "--fail", "3"], "not live in plan generation 1"),
        (["--preset", "llama2-7b-910b", "--fail-count", "8"], "no live device"),
        (["--preset", "llama2-7b-910b", "--fail", "x"], "not a device list"),
        (["--job", "/nonexistent.toml"], "cannot read job file"),
        (["--preset", "tiny-cpu", "--slow", "3"], "is not DEVICE=FACTOR"),
        (["--preset", "tiny-cpu", "--slow", "3=0"], "positive speed factor"),
        (["--preset", "tiny-cpu", "--slow", "3=nan"], "is not DEVICE=FACTOR"),
        (["--preset", "tiny-cpu", "--slow", "7=0.5"], "device 7 is not live"),
        (["--preset", "tiny-cpu", "--fail", "3", "--slow", "3=0.5"], "not live in plan"),
    ],
)
def test_bad_requests_exit_2_without_traceback(args, words):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "see chameleon-plan --help" in proc.stderr


TINY_MEMORY_JOB = (
    'name = "huge"\n'
    "[model]\nlayers = 4\nforward_s = 0.01\nbackward_s = 0.02\nparam_bytes = 1e9\n"
    "optimizer_bytes = 6e9\nactivation_bytes = 1e7\n"
    "[cluster]\ndevices = 4\ndevice_memory_bytes = 1e9\nbandwidth_bytes_per_s = 1e10\n"
    "restart_s = 3.0\nfailure_rate_per_hour = 0.1\n"
    "[training]\ndp = 2\npp = 2\nglobal_micro_batches = 4\n"
)


def test_no_plan_for_a_sound_request_exits_1(tmp_path):
    # Well-formed requests the planner cannot satisfy: a failure of the work, not of usage.
    job = tmp_path / "huge.toml"
    job.write_text(TINY_MEMORY_JOB)
    for args, words in (
        (["--preset", "llama2-7b-910b", "--fail", "0,4", "--policy", "reroute"],
         "lost every replica"),
        (["--job", str(job)], "does not fit"),
    ):
        proc = run_cli(*args)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith("chameleon-plan: error: ") and words in proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "--help" not in proc.stderr and proc.stdout == ""


def test_help_documents_every_flag():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for flag in ("--job", "--preset", "--fail", "--fail-count", "--seed", "--policy",
                 "--recovery", "--json", "--slow"):
        assert flag in proc.stdout


def test_losing_every_replica_replans_from_the_checkpoint(capsys):
    # tiny-cpu: dp = 2 x pp = 2, devices 1 and 3 hold layers [4, 8); no snapshots.
    assert main(["--preset", "tiny-cpu", "--fail", "1,3", "--snapshot-every", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("│")[1:-1] for line in out.splitlines()
            if line.startswith("│ checkpoint")]
    assert sorted(cell.strip() for row in rows for cell in row[1:3]) == ["0", "2", "4-7", "4-7"]
    text = " ".join(out.split())  # the console wraps long lines
    assert "chose replan" in text
    assert "layers 4-7 was lost: they come from the checkpoint" in text
    assert main(["--preset", "tiny-cpu", "--fail", "1,3", "--json", "--snapshot-every", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "replan"
    lost = [t for t in out["transfers"] if t["src"] == "checkpoint"]
    assert lost and all(t["layers"] == [4, 5, 6, 7] for t in lost)
    assert {t["dst"] for t in lost} == {0, 2}
    assert out["decisions"][0]["checkpoint_layers"] == [4, 5, 6, 7]
    assert out["snapshots"]["every"] == 0


def test_losing_every_replica_replans_from_the_snapshots_a_partner_keeps(capsys, tmp_path):
    # one pipeline of four stages on two nodes of two: each device's partner sits on the
    # other node (0->2, 1->3, 2->1, 3->0), so node 1's layers 4-7 survive on node 0
    text = (Path(__file__).parents[2] / "chameleon_elastic/presets/tiny-cpu.toml").read_text()
    job = tmp_path / "pp4.toml"
    job.write_text(text.replace("dp = 2", "dp = 1").replace("pp = 2", "pp = 4").replace(
        "devices = 4", "devices = 4\ndevices_per_node = 2\nhost_memory_bytes = 1e8"))
    assert main(["--job", str(job), "--fail", "2,3", "--snapshot-every", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    snap = out["snapshots"]
    assert snap["every"] == 4 and snap["host_memory_bytes"] == 1e8
    assert snap["partners"] == {}   # the final plan: two replicas of every layer
    taken = [t for t in out["transfers"] if t.get("snapshot")]
    assert sorted(x for t in taken for x in t["layers"]) == [4, 4, 5, 5, 6, 6, 7, 7]
    assert {t["src"] for t in taken} == {0, 1}   # 2's copy on 1, 3's on 0
    assert not [t for t in out["transfers"] if t["src"] == "checkpoint"]
    decision = out["decisions"][0]
    assert (decision["snapshot_layers"], decision["checkpoint_layers"]) == ([4, 5, 6, 7], [])
    assert main(["--job", str(job), "--snapshot-every", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = " ".join(x for x in lines if x.startswith("snapshots"))
    assert line == ("snapshots: every 4 steps, copies kept by 0->2 1->3 2->1 3->0; host memory "
                    "per node: node 0 0.05 GB, node 1 0.05 GB of 0.10 GB")


def test_snapshots_that_overflow_host_memory_leave_no_initial_plan(capsys, tmp_path):
    text = (Path(__file__).parents[2] / "chameleon_elastic/presets/tiny-cpu.toml").read_text()
    job = tmp_path / "small.toml"
    job.write_text(text.replace("devices = 4", "devices = 4\nhost_memory_bytes = 1e7"))
    assert main(["--job", str(job), "--snapshot-every", "1"]) == 1
    err = capsys.readouterr().err
    # 4 devices, each its own 12 MB and a partner's, two snapshots deep
    assert "node 0 would keep 0.19 GB of snapshots in host memory but " \
           "cluster.host_memory_bytes is 0.01 GB" in err
    assert main(["--job", str(job), "--snapshot-every", "0"]) == 0


def test_recovery_flag_overrides_the_jobs_switch_cost(capsys):
    # tiny-cpu regroups in place (regroup_s = 0.3); --recovery relaunch pays restart_s = 2.0.
    spec = JobSpec.preset("tiny-cpu")
    transition = {}
    for mode in ("inplace", "relaunch"):
        assert main(["--preset", "tiny-cpu", "--fail", "1,3", "--recovery", mode,
                     "--json", "--snapshot-every", "0"]) == 0   # no steps trained again
        out = json.loads(capsys.readouterr().out)
        received: dict[int, float] = {}
        for t in out["transfers"]:
            received[t["dst"]] = received.get(t["dst"], 0.0) + t["bytes"]
        transfer_s = max(received.values()) / spec.cluster.bandwidth_bytes_per_s
        transition[mode] = out["estimate"]["transition_time_s"] - transfer_s
    assert transition["inplace"] == pytest.approx(0.3)
    assert transition["relaunch"] == pytest.approx(2.0)


RECOMPUTE_JOB = (
    'name = "tight"\n'
    "[model]\nlayers = 2\nforward_s = 1.0\nbackward_s = 2.0\nparam_bytes = 10\n"
    "optimizer_bytes = 20\nactivation_bytes = 100\nboundary_bytes = 5\n"
    "[cluster]\ndevices = 2\ndevice_memory_bytes = 200\nbandwidth_bytes_per_s = 1e9\n"
    "restart_s = 3.0\nfailure_rate_per_hour = 0.1\n"
    "[training]\ndp = 1\npp = 2\nglobal_micro_batches = 3\n"
)


def test_recomputing_stages_are_shown_in_the_table_and_the_json(tmp_path, capsys):
    # Stage 0 holds 2 micro-batches: 240 bytes without recomputation, 140 with; stage 1 fits.
    job = tmp_path / "tight.toml"
    job.write_text(RECOMPUTE_JOB)
    assert main(["--job", str(job), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipelines"][0]["recompute"] == [True, False]
    assert out["estimate"]["step_time_s"] == 14.0
    assert main(["--job", str(job)]) == 0
    text = capsys.readouterr().out
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│ 0")]
    assert [cell.strip() for cell in rows[0]][-1] == "stage 0"
    assert "recompute auto" in " ".join(text.split())
    assert main(["--preset", "tiny-cpu"]) == 0
    rows = [line.split("│")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│ 0")]
    assert [cell.strip() for cell in rows[0]][-1] == "-"


# --------------------------------------------------------------------------- tensor parallelism

TP_PRESET = "llama2-7b-910b-tp8"  # 32 cards as 4 units of 8, (PP, DP, TP) = (2, 2, 8)


def test_a_card_failure_loses_its_whole_unit_and_shows_the_new_layout():
    proc = run_cli("--preset", TP_PRESET, "--fail", "0")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # the console may wrap long lines
    assert "3/4 units of 8 cards live (24/32 cards)" in text
    assert "failure of card 0, which lost unit u0 (cards 0-7): chose replan" in text
    layout = [line for line in proc.stdout.splitlines() if line.startswith("│ ")]
    assert any("units (stage order)" in line for line in proc.stdout.splitlines())
    cells = " ".join(layout)
    assert "u0 (cards 0-7)" not in cells  # the lost unit is gone from the layout
    for unit in ("u1 (cards 8-15)", "u2 (cards 16-23)", "u3 (cards 24-31)"):
        assert unit in cells
    assert "size per card" in proc.stdout and "per card" in text


def test_tp_json_keeps_unit_ids_and_maps_them_to_cards(capsys):
    assert main(["--preset", TP_PRESET, "--fail", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tp"] == 8
    assert out["units"] == {str(u): list(range(8 * u, 8 * u + 8)) for u in range(4)}
    (decision,) = out["decisions"]
    assert decision["failed"] == [1] and decision["failed_cards"] == [12]
    live = {d for p in out["pipelines"] for d in p["devices"]} | set(out["spare_devices"])
    assert live == {0, 2, 3}
    assert sum(p["micro_batches"] for p in out["pipelines"]) == 64


def test_tp_fail_count_draws_cards_of_live_units(capsys):
    assert main(["--preset", TP_PRESET, "--fail", "3", "--fail-count", "1", "--seed", "4",
                 "--json"]) == 0
    first, second = json.loads(capsys.readouterr().out)["decisions"]
    assert first["failed"] == [0]
    (card,) = second["failed_cards"]
    assert 8 <= card < 32 and second["failed"] == [card // 8]


def test_one_json_without_tp_keys_for_tp_1(capsys):
    assert main(["--preset", "llama2-7b-910b", "--fail", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tp" not in out and "units" not in out and "failed_cards" not in out["decisions"][0]


@pytest.mark.parametrize("args, words", [
    (["--fail", "32"], "card 32 does not exist: the job has cards 0-31"),
    (["--fail", "0", "--fail", "7"], "card 7 cannot fail: its unit u0 (cards 0-7) is not live"),
    (["--fail", "0,8,16,24"], "would take all 4 live units"),
    (["--fail-count", "32"], "would leave no live card of 32"),
])
def test_tp_bad_cards_exit_2_in_one_line(args, words):
    proc = run_cli("--preset", TP_PRESET, *args)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_help_says_fail_takes_cards_with_tp():
    proc = run_cli("--help")
    text = " ".join(proc.stdout.split())
    assert "--fail and --fail-count take CARD ids; a card's failure loses its whole unit" in text
    assert TP_PRESET in text


def test_a_slow_device_gets_less_work_and_the_choice_is_explained(capsys):
    assert main(["--preset", "tiny-cpu", "--slow", "3=0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (decision,) = out["decisions"]
    assert decision["slow"] == {"3": 0.5} and decision["failed"] is None
    assert set(decision["scores"]) == {"keep", "reduce", "spare"}
    assert decision["scores"][decision["chosen"]] == max(decision["scores"].values())
    assert decision["chosen"] != "keep"
    pipe = next(p for p in out["pipelines"] if 3 in p["devices"])
    assert pipe["micro_batches"] < 4 or pipe["layers"][pipe["devices"].index(3)] != [4, 8]
    assert main(["--preset", "tiny-cpu", "--slow", "3=0.5"]) == 0
    assert "slow 3 at 0.5x: chose" in capsys.readouterr().out
