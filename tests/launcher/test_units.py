"""Launcher pieces that need no processes: classification, plan -> env, health, logs, CLI."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_elastic.launcher.detection.health import FileHealthCheck
from chameleon_elastic.launcher.failures import FailureKind, classify_exit
from chameleon_elastic.launcher.observation.profiler import (
    PROFILE_DIR_VAR,
    Profiler,
    per_layer_times,
    record_step,
)
from chameleon_elastic.launcher.observe import EventLog, StatusLine, recovery_line
from chameleon_elastic.launcher.plan_env import (
    CHAMELEON_VARS,
    chameleon_env,
    local_assignments,
    write_plan_file,
)
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.profile import ClusterFigures, MeasuredProfile, ModelFigures
from chameleon_elastic.spec import JobSpec


def _plan_2x2() -> ExecutionPlan:
    return ExecutionPlan(
        policy="initial", generation=0,
        pipelines=(Pipeline((0, 1), ((0, 4), (4, 8)), 4), Pipeline((2, 3), ((0, 4), (4, 8)), 4)),
    ).validate()


def _rerouted() -> ExecutionPlan:
    # device 1 (pipeline 0, stage 1) is dead; its 4 micro-batches go to its peer 3
    return ExecutionPlan(
        policy="reroute", generation=1,
        pipelines=_plan_2x2().pipelines, failed_devices=(1,),
        reroute=(Reroute(device=1, pipeline=0, stage=1, peers=(PeerShare(3, 4),)),),
    ).validate()


@pytest.mark.parametrize("code,kind,sig", [
    (-signal.SIGKILL, FailureKind.DEVICE_LOST, "SIGKILL"),
    (-signal.SIGSEGV, FailureKind.DEVICE_LOST, "SIGSEGV"),
    (128 + signal.SIGKILL, FailureKind.DEVICE_LOST, "SIGKILL"),
    (1, FailureKind.CRASH, None),
    (2, FailureKind.CRASH, None),
    (-signal.SIGTERM, FailureKind.CRASH, "SIGTERM"),
    (-signal.SIGINT, FailureKind.CRASH, "SIGINT"),
    (-signal.SIGABRT, FailureKind.CRASH, "SIGABRT"),   # the program aborted itself
])
def test_classify_exit(code, kind, sig):
    f = classify_exit(code, device=5, local_rank=1)
    assert (f.kind, f.signal, f.device, f.local_rank) == (kind, sig, 5, 1)
    assert f.stopped_on_request == (sig in ("SIGTERM", "SIGINT"))


def test_assignments_are_dense_and_skip_dead_devices():
    plan = _rerouted()
    node0 = local_assignments(plan, node=0, nproc_per_node=2)
    node1 = local_assignments(plan, node=1, nproc_per_node=2)
    assert [(a.local_rank, a.device, a.global_rank) for a in node0] == [(0, 0, 0)]
    assert [(a.local_rank, a.device, a.global_rank) for a in node1] == [(0, 2, 1), (1, 3, 2)]
    assert {a.world_size for a in node0 + node1} == {3}


def test_units_of_two_cards_get_consecutive_local_and_global_ranks():
    plan = _rerouted()   # devices 0-3 of the plan are units of 2 cards: cards 0-7, 4 per node
    node0 = local_assignments(plan, node=0, nproc_per_node=4, tp=2)
    node1 = local_assignments(plan, node=1, nproc_per_node=4, tp=2)
    assert [(a.local_rank, a.device, a.role.device, a.tp_rank, a.global_rank)
            for a in node0] == [(0, 0, 0, 0, 0), (1, 1, 0, 1, 1)]   # unit 1 is dead
    assert [(a.local_rank, a.role.device, a.tp_rank, a.global_rank) for a in node1] == [
        (0, 2, 0, 2), (1, 2, 1, 3), (2, 3, 0, 4), (3, 3, 1, 5)]
    assert {a.world_size for a in node0 + node1} == {6}
    assert [a.unit_ranks for a in node1] == [(2, 3), (2, 3), (4, 5), (4, 5)]


def test_peer_sees_absorbed_quota_in_env(tmp_path):
    plan = _rerouted()
    path = write_plan_file(plan, tmp_path)
    peer = next(a for a in local_assignments(plan, 1, 2) if a.device == 3)
    env = chameleon_env(plan, peer.role, path, peer.unit_ranks, peer.tp_rank)
    assert set(env) == set(CHAMELEON_VARS)
    assert (env["CHAMELEON_TP_RANK"], env["CHAMELEON_TP_SIZE"],
            env["CHAMELEON_TP_GROUP_RANKS"]) == ("0", "1", "2")
    assert env["CHAMELEON_MICRO_BATCHES"] == "8"          # own 4 + the dead device's 4
    assert env["CHAMELEON_GLOBAL_MICRO_BATCHES"] == "8"
    assert (env["CHAMELEON_STAGE"], env["CHAMELEON_NUM_STAGES"]) == ("1", "2")
    assert (env["CHAMELEON_LAYER_START"], env["CHAMELEON_LAYER_END"]) == ("4", "8")
    assert env["CHAMELEON_POLICY"] == "reroute"
    assert ExecutionPlan.from_json(Path(env["CHAMELEON_PLAN_FILE"]).read_text()) == plan
    assert not list(tmp_path.glob(".plan-*"))            # no half-written temp file left


def test_file_health_check(tmp_path):
    check = FileHealthCheck(tmp_path / "bad")
    assert check.unhealthy([0, 1, 2]) == frozenset()     # no file: all healthy
    (tmp_path / "bad").write_text("2\n# comment\n7 # not local\nxx\n")
    assert check.unhealthy([0, 1, 2]) == frozenset({2})


def test_event_log_is_jsonl_and_flushed(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl")
    log.emit("failure_seen", device=3, kind="device_lost")
    lines = (tmp_path / "ev.jsonl").read_text().splitlines()   # readable before close
    log.close()
    assert [json.loads(x)["event"] for x in lines] == ["failure_seen"]
    assert json.loads(lines[0])["device"] == 3


def test_status_line_plain_when_not_a_tty(tmp_path):
    with open(tmp_path / "s", "w") as fh:
        status = StatusLine(stream=fh)
        status.update(generation=1, policy="replan", live=3, devices=4, restarts=0,
                      max_restarts=2, state="running")
        status.update(generation=1)  # unchanged: no second line
    text = (tmp_path / "s").read_text()
    assert text.count("\n") == 1
    assert "gen 1" in text and "policy replan" in text and "live 3/4" in text


def test_status_line_off_a_terminal_says_what_changed_and_moving_figures_once_a_minute(
        tmp_path):
    """In a log file: a line per change of plan, devices, restarts or what the agent does; the
    seconds waited, a stall's length and the derived hang timeout at most once a minute (a
    node waiting 10 minutes wrote 60 lines; every new hang figure was a line)."""
    now = [0.0]
    with open(tmp_path / "s", "w") as fh:
        status = StatusLine(stream=fh, clock=lambda: now[0])
        base = {"generation": 0, "policy": "initial", "live": 4, "devices": 4, "restarts": 0,
                    "max_restarts": 0}
        status.update(**base, state="running")
        for t, fields in [(1, {"hang": "60 s (auto)"}), (5, {"hang": "5.13 s (auto)"}),
                          (7, {"hang": "6.01 s (auto)"}), (9, {"hang": "6.74 s (auto)"}),
                          (10, {"state": "waiting for 1 more node at h:2379 (0:10 so far)"}),
                          (20, {"state": "waiting for 1 more node at h:2379 (0:20 so far)"}),
                          (50, {"state": "waiting for 1 more node at h:2379 (0:50 so far)"}),
                          (75, {"state": "waiting for 1 more node at h:2379 (1:15 so far)"}),
                          (80, {"state": "running"}), (81, {"live": 3}),
                          (82, {"state": "device 2: no progress for 3 s (hung at 5 s, auto)"}),
                          (84, {"state": "device 2: no progress for 5 s (hung at 5 s, auto)"}),
                          (85, {"state": "succeeded"})]:
            now[0] = t
            status.update(**fields)
    lines = (tmp_path / "s").read_text().splitlines()
    assert [x.split(" | ")[-1] for x in lines] == [
        "running]", "running]", "running]", "waiting for 1 more node at h:2379 (0:10 so far)]",
        "waiting for 1 more node at h:2379 (1:15 so far)]", "running]", "running]",
        "device 2: no progress for 3 s (hung at 5 s, auto)]", "succeeded]"]
    # the hang timeout when it appears (60 s) and when it falls to a twelfth (5.13 s), not when
    # it drifts (6.01 s, 6.74 s: the latest is on the next line written)
    assert "hang timeout 60 s" in lines[1] and "hang timeout 5.13 s" in lines[2]
    assert "hang timeout 6.74 s" in lines[3] and "live 3/4" in lines[6]


def test_profile_round_trip_replaces_guesses():
    spec = JobSpec.preset("tiny-cpu")
    plan = _plan_2x2()
    # 2 stages, 4 micro-batches: 5 slots; 4 layers per stage; measured 0.2 s per step
    times = per_layer_times(spec, plan, {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2})
    assert times is not None
    f, b = times
    assert [x + y for x, y in zip(f, b)] == pytest.approx([0.2 / 5 / 4] * 8)
    assert f[0] / b[0] == pytest.approx(0.002 / 0.004)
    tuned = MeasuredProfile("steps", precision=spec.training.precision,
                            model=ModelFigures(forward_s=f, backward_s=b)).apply(spec)
    assert tuned.model.forward_s == pytest.approx(f)
    assert tuned.cluster == spec.cluster
    regrouped = MeasuredProfile("steps", cluster=ClusterFigures(regroup_s=0.12)).apply(spec)
    assert regrouped.cluster.regroup_s == 0.12 and regrouped.cluster.switch_s == 0.12


def test_per_layer_times_keep_the_job_files_shape():
    """Step times give the scale; the job file says which layers are heavier. The slowest
    stage (layers 4-7, last one 3x heavier) sets the pipeline's pace."""
    data = JobSpec.preset("tiny-cpu").to_dict()
    data["model"]["forward_s"] = [0.001] * 7 + [0.003]
    data["model"]["backward_s"] = [0.002] * 7 + [0.006]
    spec = JobSpec.from_dict(data)
    f, b = per_layer_times(spec, _plan_2x2(), {0: 0.2, 2: 0.2, 3: 0.2})   # device 1 silent
    slow_stage = sum(f[4:]) + sum(b[4:])
    assert slow_stage == pytest.approx(0.2 / 5)
    assert f[7] == pytest.approx(3 * f[0]) and b[7] == pytest.approx(2 * f[7])
    assert per_layer_times(spec, _plan_2x2(), {}) is None


def _steps_profile(tmp_path, monkeypatch, spec, plan) -> Path:
    """What chameleon-run --profile-out writes, without processes: workers' record_step lines,
    one regroup, the agent's write at the end."""
    profiler = Profiler(tmp_path / "profile")
    monkeypatch.setenv(PROFILE_DIR_VAR, str(profiler.directory))
    for device in range(4):
        monkeypatch.setenv("CHAMELEON_DEVICE", str(device))
        for seconds in (0.1, 0.2, 0.3):
            record_step(seconds, device_memory_peak_bytes=1000 * (device + 1))
    with open(profiler.directory / "device-0.jsonl", "a") as fh:
        fh.write('{"step_s": 0.')                          # cut short by a kill -9
    profiler.note_regroup(0.4)
    profiler.note_regroup(0.2)
    profiler.note_regroup(0.3)
    path = tmp_path / "measured.json"
    profiler.write(path, spec, plan)
    return path


def test_agent_profile_feeds_the_planner(tmp_path, monkeypatch):
    spec = JobSpec.preset("tiny-cpu")
    path = _steps_profile(tmp_path, monkeypatch, spec, _plan_2x2())
    measured = MeasuredProfile.load(path)
    assert (measured.how, measured.job, measured.precision) == ("steps", "tiny-cpu", "bf16")
    assert measured.devices[2].step_time_s == 0.2
    assert measured.devices[2].device_memory_peak_bytes == 3000
    assert measured.cluster.regroup_s == 0.3
    tuned = measured.apply(spec)
    assert tuned.model.forward_s == pytest.approx((0.2 / 5 / 4 / 3,) * 8)
    assert tuned.model.backward_s == pytest.approx((0.2 / 5 / 4 * 2 / 3,) * 8)
    assert tuned.cluster.regroup_s == 0.3
    assert tuned.model.param_bytes == spec.model.param_bytes      # step times say nothing of it


def _session_with_profile(path: Path, tmp_path: Path):
    from chameleon_elastic.launcher.cli import build_parser
    from chameleon_elastic.launcher.launch import _make_session

    parser = build_parser()
    args = parser.parse_args(["--preset", "tiny-cpu", "--nproc-per-node", "4", "--plan-cache",
                              "0", "--profile", str(path), "x.py"])
    return _make_session(parser, args, 4, 1, tmp_path / "state")


def test_both_producers_profiles_load_through_chameleon_run_profile(tmp_path, monkeypatch):
    import torch

    from chameleon_elastic.models.toy import mlp_model
    from chameleon_elastic.runtime.profiler import profile_layers

    spec = JobSpec.preset("tiny-cpu")
    steps = _steps_profile(tmp_path, monkeypatch, spec, _plan_2x2())
    session = _session_with_profile(steps, tmp_path)
    assert session.spec.cluster.regroup_s == 0.3
    assert session.spec.model.forward_s == pytest.approx((0.2 / 5 / 4 / 3,) * 8)

    layers = profile_layers(mlp_model(layers=8, width=8, dtype=torch.float32), repeats=1,
                            warmup=0, precision="bf16").write(tmp_path / "layers.json")
    session = _session_with_profile(layers, tmp_path)   # tiny-cpu trains in bf16
    assert session.spec.model.boundary_bytes == (8 * 2.0,) * 8
    assert session.spec.cluster.regroup_s == spec.cluster.regroup_s
    assert session.plan.num_layers == 8


def test_recovery_line_says_what_was_lost_what_moved_and_where_training_resumed():
    plan = _plan_2x2()
    line = recovery_line("device 3 lost (SIGKILL)", replace(plan, policy="replan"),
                         inplace=True, started=0, moved_layers=3, moved_bytes=1.2e6,
                         source="peers", resumed_step=8, redone=0, seconds=0.41)
    assert line == ("device 3 lost (SIGKILL) at step 8; re-planned to 2 pipelines: devices 0, 1 | "
                    "devices 2, 3; moved 3 layers from peers (1.2 MB to this node); resumed at "
                    "step 8 in 0.41 s")
    elsewhere = recovery_line("devices 2, 3 back", replace(plan, policy="replan"),
                              inplace=True, started=0, moved_layers=4, moved_bytes=0,
                              source="peers", resumed_step=8, redone=0, seconds=0.41)
    assert "moved 4 layers from peers (none to this node)" in elsewhere
    units = recovery_line("unit 1 (cards 2-3) lost (SIGKILL)", _rerouted(), inplace=True,
                          started=0, moved_layers=0, moved_bytes=0, source="none",
                          resumed_step=6, redone=0, seconds=0.25, tp=2)
    assert "rerouted to data-parallel peers: unit 3 (cards 6-7)" in units
    back = recovery_line("devices 1, 3 lost (SIGKILL)", replace(plan, policy="replan"),
                         inplace=True, started=0, moved_layers=0, moved_bytes=0,
                         source="checkpoint", resumed_step=10, redone=2, seconds=0.9)
    assert "at step 12" in back and "restored from the checkpoint of step 10" in back
    assert "steps 10-11 will be trained again" in back
    relaunch = recovery_line("device 2: worker exited with code 1", plan, inplace=False,
                             started=4, moved_layers=0, moved_bytes=0, source="",
                             resumed_step=None, redone=0, seconds=None, same_layout=True)
    assert relaunch == ("device 2: worker exited with code 1; kept the plan (2 pipelines: "
                        "devices 0, 1 | devices 2, 3); relaunched 4 workers")
    replaced = recovery_line("device 2: worker exited with code 1", plan, inplace=True,
                             started=1, moved_layers=0, moved_bytes=0, source="none",
                             resumed_step=5, redone=0, seconds=0.3, same_layout=True)
    assert "kept the plan" in replaced and "re-planned" not in replaced
    assert "started 1 worker in place of the failed" in replaced


def _run_cli(argv, capsys, monkeypatch, tmp_path):
    """Runs the ``chameleon-run`` command in a directory where the script exists, so that only
    the error under test can stop it."""
    from chameleon_elastic.launcher.cli import console

    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps torch's one-time warning out of stderr
    monkeypatch.setattr(sys, "argv", ["chameleon-run", *argv])
    with pytest.raises(SystemExit) as info:
        console()
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,needle,code", [
    (["--policy", "sometimes", "x.py"], "--policy", 2),
    (["--job", "a.toml", "--preset", "tiny-cpu", "x.py"], "mutually exclusive", 2),
    (["--preset", "no-such-job", "x.py"], "unknown preset", 2),
    (["--preset", "tiny-cpu", "--nproc-per-node", "3", "x.py"], "cluster.devices", 2),
    (["--health-file", "bad", "x.py"], "only applies with --job", 2),
    (["--policy", "replan", "x.py"], "--policy only applies with --job", 2),
    (["--preset", "tiny-cpu", "--nproc-per-node", "4", "--plan-cache", "-1", "x.py"],
     "--plan-cache -1 is invalid", 2),
    (["--preset", "tiny-cpu", "--nproc-per-node", "4", "--profile", "none.json", "x.py"],
     "cannot read measured profile 'none.json'", 2),
    # torchrun's own validation (a ValueError, exit 1 there too), as one sentence
    (["--nnodes", "3:1", "x.py"], "invalid launch configuration", 1),
    # a malformed rendezvous endpoint, refused before anything connects (issue 39)
    (["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "^step +15", "x.py"],
     "--rdzv-endpoint entry '^step +15' is not host:port", 2),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "^step +15", "x.py"],
     "--rdzv-endpoint '^step +15': The hostname", 2),
    (["--nnodes", "2", "--rdzv-endpoint", "host:x", "x.py"], "port number", 2),
    (["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:2379",
      "--rdzv-conf", "lease_ttl=x", "x.py"], "lease_ttl='x' is not a whole number", 2),
])
def test_usage_errors_end_in_one_line_without_traceback(argv, needle, code, capsys, monkeypatch,
                                                        tmp_path):
    got, err = _run_cli(argv, capsys, monkeypatch, tmp_path)
    assert got == code
    assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("profile,needle", [
    (MeasuredProfile("layers", model=ModelFigures(layers=5)).to_json(),
     ("--profile p.json: the measured profile covers 5 layers but job 'tiny-cpu' has "
      "model.layers = 8")),
    (MeasuredProfile("steps", cluster=ClusterFigures(regroup_s=0.1)).to_json()[:40],
     "measured profile 'p.json' is not valid JSON"),
])
def test_a_profile_that_cannot_be_used_is_a_usage_error(profile, needle, capsys, monkeypatch,
                                                         tmp_path):
    (tmp_path / "p.json").write_text(profile)
    got, err = _run_cli(["--preset", "tiny-cpu", "--nproc-per-node", "4", "--profile", "p.json",
                         "x.py"], capsys, monkeypatch, tmp_path)
    assert got == 2 and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_help_lists_torchrun_and_our_flags(capsys, monkeypatch):
    from chameleon_elastic.launcher.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--max-restarts",
                 "--job", "--preset", "--policy", "--plan-cache"):
        assert flag in text


def test_pet_environment_overrides_our_flags(monkeypatch):
    monkeypatch.setenv("PET_POLICY", "replan")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    from chameleon_elastic.launcher.cli import build_parser

    args = build_parser().parse_args(["x.py"])
    assert args.policy == "replan"
    assert args.nproc_per_node == "3"


@pytest.mark.parametrize("exitcode,says", [
    (-6, ("was killed by SIGABRT; a signal leaves no Python traceback: what the worker printed "
         "last, if anything, is above.")),
    (1, "exited with code 1; what it printed, if anything, is above."),
])
def test_a_failed_worker_without_a_log_is_never_said_to_have_left_a_traceback(exitcode, says):
    """Without --job the worker's output goes to the console, uncaptured: the failure sentence
    must not point at a traceback that may not exist (a SIGABRT at teardown printed none)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from chameleon_elastic.launcher.cli import _failure_sentence

    failure = ProcessFailure(local_rank=1, pid=123, exitcode=exitcode, error_file="/nonexistent")
    sentence = _failure_sentence(ChildFailedError("train.py", {1: failure}))
    assert sentence == f"train.py failed: rank 1 (pid 123) {says}"
    assert "traceback is in" not in sentence
