"""chameleon-sim end to end: files written, JSON shape, usage errors exit 2 with one sentence,
work that cannot be done (a job that cannot start, an unwritable --out) exits 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chameleon_elastic.sim.cli import main
from chameleon_elastic.sim.traces import FailureTrace, TraceEvent, read_trace, write_trace

ARGS = ["--preset", "llama2-7b-910b", "--hours", "1", "--failure-rate", "0.5", "--no-progress",
        "--jobs", "1"]


@pytest.mark.timeout(60)
def test_json_report_files_and_plots(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main([*ARGS, "--seeds", "2", "--policies", "chameleon,recycle,checkpoint",
                 "--out", str(out), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["policies"]) == {"chameleon", "recycle", "checkpoint"}
    for entry in doc["policies"].values():
        assert entry["avg_throughput"] > 0
        assert entry["spread"]["avg_throughput"]["n"] == 2
    assert set(doc["ratios"]) == {"chameleon/recycle", "chameleon/checkpoint"}
    assert doc["ratios"]["chameleon/recycle"]["paper"] == 1.355
    assert doc["seeds"] == [0, 1]
    for name in ("summary.json", "runs.csv", "throughput.png", "relative.png", "devices.png"):
        assert (out / name).is_file()
    for name in ("throughput.png", "relative.png", "devices.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
    assert json.loads((out / "summary.json").read_text())["policies"] == doc["policies"]
    rows = (out / "runs.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 2
    # The traces written out replay to the same numbers.
    trace = read_trace(out / "traces" / "seed-1.csv")
    assert trace.devices == 8 and trace.horizon_s == 3600.0
    assert not list(tmp_path.glob(".chameleon-sim-*")), "temporary folder left behind"


@pytest.mark.timeout(60)
def test_replaying_a_trace_file(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    write_trace(FailureTrace(8, 7200.0, (TraceEvent(300.0, 2, "fail"),)), path)
    code = main(["--preset", "llama2-7b-910b", "--trace", str(path), "--no-progress",
                 "--policies", "chameleon,oobleck", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setting"]["hours"] == 2.0 and doc["setting"]["mean_failures"] == 1
    assert doc["policies"]["oobleck"]["decisions_total"] == {"replan": 1}


@pytest.mark.timeout(60)
def test_table_output(capsys) -> None:
    assert main([*ARGS, "--seeds", "1", "--policies", "chameleon,oobleck"]) == 0
    text = capsys.readouterr().out
    assert "chameleon" in text and "oobleck" in text and "chameleon/oobleck" in text


@pytest.mark.parametrize("argv, message", [
    (["--preset", "llama2-7b-910b", "--policies", "chameleon,bamboo"], "unknown policy 'bamboo'"),
    (["--preset", "llama2-7b-910b", "--seeds", "0"], "--seeds 0 is invalid"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "llama2-7b-910b", "--job", "x.toml"], "mutually exclusive"),
    ([], "no job given"),
    (["--preset", "llama2-7b-910b", "--failure-rate", "-1"], "--failure-rate -1.0 is invalid"),
    (["--preset", "llama2-7b-910b", "--trace", "/no/such.csv"], "cannot read trace file"),
    (["--preset", "llama2-7b-910b", "--mttr-s", "0"], "MTTR"),
])
def test_usage_errors_exit_2_with_the_fix(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_job_that_cannot_start_exits_1(tmp_path, capsys) -> None:
    job = tmp_path / "huge.toml"
    job.write_text(
        'name = "huge"\n'
        "[model]\nlayers = 4\nforward_s = 0.01\nbackward_s = 0.02\nparam_bytes = 1e9\n"
        "optimizer_bytes = 6e9\nactivation_bytes = 1e7\n"
        "[cluster]\ndevices = 4\ndevice_memory_bytes = 1e9\nbandwidth_bytes_per_s = 1e10\n"
        "restart_s = 3.0\nfailure_rate_per_hour = 0.1\n"
        "[training]\ndp = 2\npp = 2\nglobal_micro_batches = 4\n"
    )
    out = tmp_path / "out"
    assert main(["--job", str(job), "--seeds", "1", "--no-progress", "--jobs", "1",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("chameleon-sim: error: the job cannot start") and "does not fit" in err
    assert err.count("\n") == 1 and not out.exists()


def test_unwritable_out_exits_1_and_writes_nothing(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = blocker / "out"  # its parent is a file: cannot be created
    assert main([*ARGS, "--seeds", "1", "--policies", "recycle", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"chameleon-sim: error: cannot write --out {out}")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == "" and blocker.read_text() == "not a directory"


def test_trace_for_another_job_size_is_a_usage_error(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    write_trace(FailureTrace(32, 3600.0, (TraceEvent(10.0, 20, "fail"),)), path)
    with pytest.raises(SystemExit) as info:
        main(["--preset", "llama2-7b-910b", "--trace", str(path), "--no-progress"])
    assert info.value.code == 2
    assert "outside 0..7" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_console_script_runs_without_torch() -> None:
    code = ("import sys; from chameleon_elastic.sim.cli import main; "
            "rc = main(['--preset', 'llama2-7b-910b', '--hours', '0.5', '--seeds', '1', "
            "'--no-progress', '--policies', 'recycle', '--json']); "
            "assert 'torch' not in sys.modules, 'sim imported torch'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["policies"]["recycle"]["avg_throughput"] > 0


@pytest.mark.timeout(60)
def test_hourly_traces_with_repairs(tmp_path, capsys) -> None:
    out = tmp_path / "o"
    code = main([*ARGS, "--seeds", "2", "--trace-model", "hourly", "--mttr-s", "600",
                 "--policies", "chameleon,oobleck,recycle,checkpoint", "--out", str(out),
                 "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setting"]["trace_model"] == "hourly" and doc["setting"]["mttr_s"] == 600.0
    traces = [read_trace(out / "traces" / f"seed-{s}.csv") for s in (0, 1)]
    assert any(e.kind == "join" for t in traces for e in t.events)
    # A repaired device takes its slot back under recycle; oobleck never scales up.
    kinds = {name: entry["decisions_total"] for name, entry in doc["policies"].items()}
    assert kinds["recycle"].get("rejoin", 0) > 0
    assert set(kinds["oobleck"]) <= {"replan", "spare"} and kinds["oobleck"].get("spare", 0) > 0


@pytest.mark.timeout(60)
def test_job_file(tmp_path, capsys) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        'name = "six"\n'
        "[model]\nlayers = 6\nforward_s = 0.01\nbackward_s = 0.02\nparam_bytes = 1e8\n"
        "optimizer_bytes = 6e8\nactivation_bytes = 1e7\n"
        "[cluster]\ndevices = 6\ndevice_memory_bytes = 8e9\nbandwidth_bytes_per_s = 1e10\n"
        "restart_s = 3.0\nfailure_rate_per_hour = 0.5\n"
        "[training]\ndp = 3\npp = 2\nglobal_micro_batches = 12\n"
    )
    code = main(["--job", str(job), "--hours", "2", "--seeds", "2", "--no-progress", "--json",
                 "--policies", "chameleon,hybrid,oobleck,recycle,checkpoint"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"] == "six" and doc["setting"]["devices"] == 6
    ff = doc["fault_free_throughput"]
    for entry in doc["policies"].values():
        assert 0 < entry["avg_throughput"] <= ff * (1 + 1e-9)


@pytest.mark.timeout(60)
def test_no_templates_searches_only_the_paper_window(tmp_path, capsys) -> None:
    # The paper's setting on 10 Gb/s links: the templates escape the all-reduce-bound 8 x 4
    # layout at the first re-plan, the paper's window cannot.
    from importlib import resources

    text = resources.files("chameleon_elastic.presets").joinpath(
        "llama2-7b-910b-32.toml").read_text()
    job = tmp_path / "slow.toml"
    job.write_text(text.replace("bandwidth_bytes_per_s = 25e9", "bandwidth_bytes_per_s = 1.25e9"))
    docs = {}
    for extra in ([], ["--no-templates"]):
        assert main(["--job", str(job), "--hours", "2", "--seeds", "1", "--no-progress",
                     "--json", "--policies", "chameleon", *extra]) == 0
        docs[bool(extra)] = json.loads(capsys.readouterr().out)
    assert docs[False]["setting"]["planner"]["templates"] is True
    assert docs[True]["setting"]["planner"]["templates"] is False
    wide, window = (docs[k]["policies"]["chameleon"]["avg_throughput"] for k in (False, True))
    assert wide > 1.05 * window


@pytest.mark.timeout(60)
def test_worker_processes_give_the_same_report(capsys) -> None:
    docs = []
    for jobs in ("1", "2"):
        assert main([*ARGS[:-2], "--jobs", jobs, "--seeds", "3", "--json",
                     "--policies", "chameleon,oobleck,recycle"]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    for doc in docs:  # measured, so not comparable between runs
        for entry in doc["policies"].values():
            for key in [k for k in entry if "latency" in k]:
                del entry[key]
            for key in [k for k in entry["spread"] if "latency" in k]:
                del entry["spread"][key]
    assert docs[0] == docs[1]


@pytest.mark.timeout(60)
def test_recovery_flag_sets_chameleons_switch_cost(tmp_path, capsys) -> None:
    # One failure on the paper's 8 devices (which relaunch, restart_s = 5): in place the re-plan
    # pauses regroup_s (1 s by default) instead, plus the same transfer; Oobleck's
    # reconfiguration stays a restart either way.
    path = tmp_path / "t.csv"
    write_trace(FailureTrace(8, 7200.0, (TraceEvent(300.0, 2, "fail"),)), path)
    docs = {}
    for mode in ("relaunch", "inplace"):
        assert main(["--preset", "llama2-7b-910b", "--trace", str(path), "--no-progress",
                     "--policies", "chameleon,oobleck", "--recovery", mode, "--json"]) == 0
        docs[mode] = json.loads(capsys.readouterr().out)
    for mode, switch in (("relaunch", 5.0), ("inplace", 1.0)):
        constants = docs[mode]["setting"]["constants"]
        assert (constants["recovery"], constants["switch_s"]) == (mode, switch)
        assert constants["oobleck_reconfigure_s"] == 5.0
        assert docs[mode]["policies"]["chameleon"]["decisions_total"] == {"replan": 1}
    pause = {m: docs[m]["policies"]["chameleon"]["transition_s"] for m in docs}
    assert pause["relaunch"] - pause["inplace"] == pytest.approx(4.0)
    oobleck = [docs[m]["policies"]["oobleck"] for m in docs]
    for key in ("avg_throughput", "transition_s", "lost_samples"):
        assert oobleck[0][key] == oobleck[1][key]


@pytest.mark.timeout(60)
def test_tensor_parallel_job_runs_on_units(tmp_path, capsys) -> None:
    # 32 cards as 4 units of 8: a unit fails at 8 x the card rate, and the report says so.
    out = tmp_path / "out"
    assert main(["--preset", "llama2-7b-910b-tp8", "--hours", "1", "--seeds", "2",
                 "--failure-rate", "0.02", "--no-progress", "--jobs", "1",
                 "--policies", "chameleon,recycle", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    setting = doc["setting"]
    assert (setting["devices"], setting["tp"], setting["units"]) == (32, 8, 4)
    assert setting["failure_rate_per_hour"] == 0.02
    assert setting["unit_failure_rate_per_hour"] == pytest.approx(0.16)
    for entry in doc["policies"].values():
        assert 0 < entry["avg_throughput"] and entry["final_working_devices"] <= 4
    # Written traces name cards (each unit event as its unit's first card).
    trace = read_trace(out / "traces" / "seed-0.csv")
    assert trace.devices == 32 and all(e.device % 8 == 0 for e in trace.events)
    assert main(["--preset", "llama2-7b-910b-tp8", "--hours", "1", "--seeds", "1",
                 "--no-progress", "--jobs", "1", "--policies", "chameleon"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "32 cards as 4 units of 8" in text and "units working at end" in text


@pytest.mark.timeout(60)
def test_a_card_trace_is_replayed_on_units(tmp_path, capsys) -> None:
    path = tmp_path / "cards.csv"
    # Cards 3 and 5 are both in unit 0: one unit failure; card 20 takes unit 2.
    write_trace(FailureTrace(32, 7200.0, (TraceEvent(300.0, 3, "fail"),
                                          TraceEvent(400.0, 5, "fail"),
                                          TraceEvent(900.0, 20, "fail"))), path)
    assert main(["--preset", "llama2-7b-910b-tp8", "--trace", str(path), "--no-progress",
                 "--policies", "chameleon,oobleck", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setting"]["mean_failures"] == 2
    for entry in doc["policies"].values():
        assert entry["decisions_total"] == {"replan": 2} and entry["final_working_devices"] == 2
    bad = tmp_path / "bad.csv"  # card 40 of 32
    bad.write_text("# devices=32\n# horizon_s=3600\ntime_s,device,event\n10.0,40,fail\n")
    with pytest.raises(SystemExit) as info:
        main(["--preset", "llama2-7b-910b-tp8", "--trace", str(bad), "--no-progress"])
    assert info.value.code == 2
    assert "outside 0..31" in capsys.readouterr().err
