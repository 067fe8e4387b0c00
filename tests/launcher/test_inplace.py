"""In-place recovery end to end: chameleon-run, real gloo workers, real SIGKILL, a float64 model.

A fault is injected at each phase of a step (the commit protocol's point 3, see
runtime/state/commit.py). In every case the job must finish with exit 0 without relaunching anyone
(each device ran in one process), every step must be reported exactly once and none redone, and
the per-step loss and the final parameters of every surviving replica must equal single-process
training (float64, rtol 1e-9).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time

import numpy as np
import pytest

from chameleon_elastic.launcher.observation.reporter import RECOVERY_PHASES

from .conftest import (
    MLP_FAULTS,
    assert_single_process_results,
    mlp_reference,
    pid_alive,
    read_events,
    wait_for,
)
from .conftest import (
    launch_mlp as _launch_mlp,
)

STEPS = 6
# the tests of the paths without in-memory snapshots (tests/launcher/test_snapshots.py has
# theirs): a restore from disk, a start over, and the end of a job that has neither
NO_SNAPSHOTS = ("--snapshot-every", "0")

# DEVICE:STEP:PHASE:ACTION; tiny-cpu runs pipelines (0 1) and (2 3), layers 0-3 and 4-7
CASES = {
    "forward": (["3:3:forward:kill"], None),
    "backward": (["1:3:backward:kill"], None),
    "gradient-sync": (["2:3:sync:kill"], None),
    "vote-reporter": (["0:3:vote:kill"], None),
    # the reporting process dies right after printing step 3, as a person or a script that
    # kills it on seeing the line would: the next reporter must not print step 3 again
    "reporter-after-its-line": (["0:3:reported:kill"], None),
    # device 3 dies after the vote; device 1's vote result never arrived: it must not apply
    # step 3 on its own, and it may roll it forward only if a survivor committed it
    "between-vote-and-apply": (["3:3:apply:kill", "1:3:apply:lose-vote"], None),
    # device 1 applied step 3 (and died in step 4), its peer holder 3 did not: 3 rolls forward
    "between-holders-applies": (["1:4:forward:kill", "3:3:apply:lose-vote"], {3}),
    # the same roll forwards with tied weights, structured stage boundaries, a schedule and
    # clipping: the rolled-forward rank clips by the norm of the vote it never saw complete
    "between-vote-and-apply-featured": (["3:3:apply:kill", "1:3:apply:lose-vote"], None),
    "between-holders-applies-featured": (["1:4:forward:kill", "3:3:apply:lose-vote"], {3}),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(CASES))
def test_fault_in_every_phase_recovers_in_place_with_single_process_results(
        case, tmp_path, launch):
    faults, rolled = CASES[case]
    featured = case.endswith("featured")
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", MLP_FAULTS, str(out), str(STEPS), *faults,
                               *(["--featured"] if featured else [])])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]

    victims = {int(f.split(":")[0]) for f in faults if f.endswith(":kill")}
    survivors = sorted(set(range(4)) - victims)
    assert_single_process_results(out, survivors, STEPS, featured=featured)
    for device in victims:
        assert len((out / f"pid-{device}").read_text().split()) == 1

    events = read_events(state / "events.jsonl")
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1
    r = recovered[0]
    assert r["mode"] == "inplace" and r["started_devices"] == []
    assert sorted(r["kept_devices"]) == survivors
    assert r["redone_steps"] == 0 and r["resumed_step"] in (3, 4)
    if rolled is not None:
        assert set(r["rolled_forward"]) == rolled and r["resumed_step"] == 4
    assert all(e["restarts_used"] == 0 for e in recovered)
    _assert_phases_cover_the_path(r)
    assert "Traceback" not in run.log.read_text()


def _assert_phases_cover_the_path(recovered: dict) -> None:
    """The ``recovered`` event's phases follow one another from the fault to the first new
    step committed: none is missing and they leave nothing unnamed (clock reads apart)."""
    phases = [recovered[f"{name}_s"] for name in RECOVERY_PHASES]
    assert None not in phases and min(phases) >= -0.01, recovered
    assert sum(phases) == pytest.approx(recovered["total_s"], abs=0.05), recovered


def _reported(out) -> list[dict]:
    return [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.timeout(90)
def test_two_failures_in_a_row_are_both_recovered_in_place(tmp_path, launch):
    profile = tmp_path / "profile.json"
    run, out, state = _launch_mlp(launch, tmp_path, 9, "3:2:forward:kill", "1:6:backward:kill",
                                  flags=("--profile-out", str(profile)))
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 2], 9)
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert [e["mode"] for e in recovered] == ["inplace", "inplace"]
    assert [sorted(e["kept_devices"]) for e in recovered] == [[0, 1, 2], [0, 2]]
    assert "Traceback" not in run.log.read_text()
    # the measured cost of an in-place transition, for the planner (--profile)
    measured = json.loads(profile.read_text())["cluster"]["regroup_s"]
    assert measured > 0
    assert measured == pytest.approx(statistics.median(
        e["regroup_s"] + e["agree_s"] + e["rebuild_s"] for e in recovered))


@pytest.mark.timeout(90)
def test_every_replica_lost_restores_the_checkpoint_in_place_and_says_what_is_redone(
        tmp_path, launch):
    ckpt = tmp_path / "ckpt"
    run, out, state = _launch_mlp(launch, tmp_path, 7, "1:5:forward:kill-saved",
                                  "3:5:forward:kill-saved", "--checkpoint-dir", str(ckpt),
                                  flags=NO_SNAPSHOTS)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    reported = _reported(out)
    # steps 0-4 committed, checkpoint after step 4 (every 2 steps: 2, 4; the kills wait until
    # its background save has ended): step 4 is redone
    assert [(r["step"], r["redone"]) for r in reported] == [
        (0, False), (1, False), (2, False), (3, False), (4, False), (4, True), (5, False),
        (6, False)]
    ref_losses, _ = mlp_reference(7)
    np.testing.assert_allclose([r["loss"] for r in reported],
                               [ref_losses[r["step"]] for r in reported], rtol=1e-9, atol=1e-12)
    for device in (0, 2):   # restored in place: the survivors never restarted
        assert len((out / f"pid-{device}").read_text().split()) == 1
    r = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"][-1]
    assert r["mode"] == "inplace" and r["source"] == "checkpoint"
    assert r["resumed_step"] == 4 and r["redone_steps"] == 1
    line = next(x for x in run.log.read_text().splitlines() if "lost (SIGKILL)" in x)
    assert "restored from the checkpoint of step 4" in line and "step 4 will be trained again" \
        in line


@pytest.mark.timeout(90)
def test_every_replica_lost_without_a_checkpoint_ends_the_job_in_one_sentence(tmp_path, launch):
    """Exit 93, do not requeue: a requeue would start over from step 0 (issue 39)."""
    run, out, state = _launch_mlp(launch, tmp_path, 7, "1:3:forward:kill", "3:3:forward:kill",
                                  flags=NO_SNAPSHOTS)
    assert run.wait(80) == 93, run.log.read_text()[-3000:]
    log = run.log.read_text()
    assert "layers 4-7 were lost with every device that held them" in log
    assert "Traceback" not in log and "ChildFailedError" not in log
    events = read_events(state / "events.jsonl")
    assert [e["event"] for e in events][-2:] == ["planning_failed", "job_finished"]
    for device in (0, 2):
        pid = int((out / f"pid-{device}").read_text().split()[0])
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"device {device}'s worker to stop")


@pytest.mark.timeout(90)
def test_every_replica_lost_before_the_first_checkpoint_starts_over_from_step_0(tmp_path,
                                                                                 launch):
    run, out, state = _launch_mlp(launch, tmp_path, 5, "1:1:forward:kill", "3:1:forward:kill",
                                  "--checkpoint-dir", str(tmp_path / "ckpt"), flags=NO_SNAPSHOTS)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    steps = [r["step"] for r in _reported(out)]
    assert steps[-5:] == [0, 1, 2, 3, 4] and steps.count(0) == 2   # step 0 said twice
    assert "Traceback" not in run.log.read_text()
    # the agent sees both exits at once (one decision: relaunch from step 0), or one first
    # (a re-plan in place, whose transition the second loss cuts short: start over in place)
    restarted = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert restarted and restarted[-1]["source"] == "init" and restarted[-1]["resumed_step"] == 0
    assert restarted[-1]["mode"] in ("relaunch", "inplace")


@pytest.mark.timeout(90)
def test_a_second_loss_during_the_first_ones_transition_starts_over_in_place(tmp_path, launch):
    """Device 1 dies as it enters the plan made for device 3's loss: the next plan is made from
    a layout that never came to be, so it believes layers 4-7 (held by 1 and 3 only) still
    exist. The workers find out from the rows they agree on and start over from step 0."""
    run, out, state = _launch_mlp(launch, tmp_path, 5, "3:1:forward:kill", "1:1:enter:kill",
                                  "--checkpoint-dir", str(tmp_path / "ckpt"), flags=NO_SNAPSHOTS)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    steps = [r["step"] for r in _reported(out)]
    assert steps[-5:] == [0, 1, 2, 3, 4] and steps.count(0) == 2   # step 0 said twice
    assert "Traceback" not in run.log.read_text()
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert recovered[-1]["source"] == "init" and recovered[-1]["resumed_step"] == 0


@pytest.mark.timeout(90)
def test_a_second_loss_during_the_first_ones_transition_without_a_checkpoint_ends_the_job(
        tmp_path, launch):
    """As above, without a checkpoint: the workers find that layers 4-7 exist nowhere (the plan
    did not know), and the job ends with their sentence, not a crashed worker's."""
    run, _, state = _launch_mlp(launch, tmp_path, 5, "3:1:forward:kill", "1:1:enter:kill",
                                flags=NO_SNAPSHOTS)
    assert run.wait(80) == 93, run.log.read_text()[-3000:]
    lines = run.log.read_text().strip().splitlines()
    assert "layers 4-7 were lost with every device that held them" in lines[-2], lines
    assert "Traceback" not in "".join(lines)
    events = read_events(state / "events.jsonl")
    assert [e["event"] for e in events][-2:] == ["planning_failed", "job_finished"]


@pytest.mark.timeout(90)
def test_a_generation_that_a_live_worker_cannot_enter_is_followed_by_another(tmp_path, launch):
    """Device 1 fails to enter the plan made for device 3's loss but stays alive (what a
    connect that times out looks like). Nobody died, so only the workers' word can make the
    agent form the next generation; they say so, and everyone enters that one."""
    run, out, state = _launch_mlp(launch, tmp_path, 6, "3:3:forward:kill", "1:3:enter:lose-vote")
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 1, 2], 6)
    events = read_events(state / "events.jsonl")
    assert [e.get("kind") for e in events if e["event"] == "failure_seen"] == [
        "device_lost", "peer_lost"]
    assert [e["generation"] for e in events if e["event"] == "plan_chosen"] == [1, 2]


@pytest.mark.timeout(90)
def test_a_device_that_comes_back_joins_in_place_and_receives_its_layers(tmp_path, launch):
    health = tmp_path / "bad-devices"
    run, out, state = _launch_mlp(launch, tmp_path, 14, "--pace", "0.2",
                                  flags=("--health-file", str(health)))
    wait_for(lambda: (out / "steps.jsonl").exists() and len(_reported(out)) >= 3, 60,
             "three steps")
    health.write_text("2\n")
    wait_for(lambda: any(e["event"] == "recovered"
                         for e in read_events(state / "events.jsonl")), 30, "device 2 out")
    steps_out = len(_reported(out))
    wait_for(lambda: len(_reported(out)) >= steps_out + 2, 30, "two steps without device 2")
    health.write_text("")
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert [e["mode"] for e in recovered] == ["inplace", "inplace"]
    assert recovered[0]["reason"] == "device_lost" and recovered[0]["started_devices"] == []
    assert recovered[1]["reason"] == "device_rejoined" and recovered[1]["started_devices"] == [2]
    for r in recovered:   # the second one's last worker to resume may be the started one
        _assert_phases_cover_the_path(r)
    assert_single_process_results(out, [0, 1, 2, 3], 14, restarted=(2,))
    # the returning worker started with its layers from its peers (its script says so)
    assert (out / "started-2").read_text().split() == ["init", "peers"]
    assert "Traceback" not in run.log.read_text()


@pytest.mark.timeout(90)
def test_recovery_relaunch_restarts_everyone_from_the_checkpoint(tmp_path, launch):
    ckpt = tmp_path / "ckpt"
    run, out, state = _launch_mlp(launch, tmp_path, 7, "3:5:forward:kill-saved",
                                  "--checkpoint-dir", str(ckpt), flags=("--recovery", "relaunch"))
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    reported = _reported(out)
    assert [r["step"] for r in reported if r["redone"]] == [4]
    assert sorted({r["step"] for r in reported}) == list(range(7))
    for device in (0, 1, 2):
        assert len((out / f"pid-{device}").read_text().split()) == 2   # relaunched
        assert (out / f"started-{device}").read_text().split() == ["init", "checkpoint"]
    r = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"][-1]
    assert r["mode"] == "relaunch" and r["source"] == "checkpoint" and r["resumed_step"] == 4
    _assert_phases_cover_the_path(r)   # a started process: its start-up is its regroup


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_declared_hung_killed_and_recovered_in_place(tmp_path, launch):
    """SIGSTOP, not SIGKILL: no socket resets, the peers just wait. The agent sees device 1's
    progress count stand still for --hang-timeout while the process is stopped (its peers are
    asleep in their transfers), kills it, and the survivors recover in place. Meanwhile the
    status line names the stalled device, and the recovery is timed from its last progress."""
    run, out, state = _launch_mlp(launch, tmp_path, 12, "--pace", "0.2",
                                  flags=("--hang-timeout", "3"), status=True)
    wait_for(lambda: (out / "steps.jsonl").exists() and len(_reported(out)) >= 3, 60,
             "three steps")
    victim = int((out / "pid-1").read_text().split()[0])
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 2, 3], 12)
    events = read_events(state / "events.jsonl")
    seen = [e for e in events if e["event"] == "failure_seen"]
    assert [e["device"] for e in seen] == [1] and "hung: no progress for " in seen[0]["reason"]
    stalled_s = float(seen[0]["reason"].split("no progress for ")[1].split(" s")[0])
    assert stalled_s >= 3
    # not before the hang timeout, counted from the last progress the agent saw, which may
    # precede the SIGSTOP by up to one paced step (0.2 s) and one poll (measured: 2.996 s)
    assert seen[0]["ts"] - stopped_at >= 3 - 0.5
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["mode"] == "inplace"
    assert recovered[0]["detect_s"] >= stalled_s - 0.1          # counted from the last progress
    assert recovered[0]["total_s"] >= recovered[0]["detect_s"]
    log = run.log.read_text()
    waiting = log.index("device 1: no progress for ")          # said while it waited
    assert "(hung at 3 s)" in log[waiting:waiting + 60]
    assert waiting < log.index("device 1 lost (stopped: no progress for ")
    assert not pid_alive(victim)


@pytest.mark.timeout(90)
def test_a_worker_tearing_down_after_its_last_step_is_neither_stalled_nor_hung(tmp_path,
                                                                              launch):
    """After success a worker may take seconds to leave (freeing groups, torch's teardown),
    busy and beating no more: with the automatic hang timeout derived from its pace (5 s) the
    status line said 'device 3: no progress for 3 s (hung at 5 s, auto)' after the last step,
    and a longer teardown was killed as a hang. Leaving is a slow stretch: held to the
    ceiling (60 s), named only after 10 s."""
    run, _out, state = _launch_mlp(launch, tmp_path, 14, "--pace", "0.2", "3:14:closed:linger-4",
                                  status=True)
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    log = run.log.read_text()
    leaving = log[log.index("device 3 closed its trainer"):]
    assert "no progress" not in leaving, leaving[-2000:]
    assert not [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]


@pytest.mark.timeout(90)
def test_a_spinning_worker_is_declared_hung_too(tmp_path, launch):
    """A hang that burns a core: running, not stopped, and using its core (so not merely
    starved of one by other load): hung once the confirmation second has passed."""
    run, out, state = _launch_mlp(launch, tmp_path, 8, "1:3:forward:spin",
                                  flags=("--hang-timeout", "3"))
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 2, 3], 8)
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    assert [e["device"] for e in seen] == [1]
    assert seen[0]["reason"].startswith("hung: no progress for ")
    assert seen[0]["reason"].endswith(" s, process running")


@pytest.mark.timeout(90)
def test_a_replacement_workers_start_is_not_a_hang(tmp_path, launch):
    """The process that replaces a crashed worker is busy starting for longer than
    --hang-timeout (as heavy imports on a busy machine are): it is hang-checked from its own
    first beat, not by its predecessor's count standing still."""
    run, out, state = _launch_mlp(launch, tmp_path, 8, "2:4:backward:raise", "--busy-start", "5",
                                  flags=("--max-restarts", "1", "--hang-timeout", "3"))
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 1, 2, 3], 8, restarted=(2,))
    seen = [e for e in read_events(state / "events.jsonl") if e["event"] == "failure_seen"]
    # under load a survivor may report its lost peer ("peer_lost", no device) before the
    # crashed process's exit is seen; no device but the crashed one is ever named
    assert [(e["device"], e["kind"]) for e in seen if "device" in e] == [(2, "crash")]
    assert not [e for e in seen if "hang_s" in e]


@pytest.mark.timeout(90)
def test_a_crashed_worker_is_replaced_in_place_and_its_peers_keep_their_state(tmp_path, launch):
    """A worker that raises is a crash (restart budget spent, as torchrun), but only it starts
    again: its peers keep their processes, and the new process takes its layers from them."""
    run, out, state = _launch_mlp(launch, tmp_path, 8, "2:4:backward:raise",
                                  flags=("--max-restarts", "1"))
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 1, 2, 3], 8, restarted=(2,))
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert len(recovered) == 1
    r = recovered[0]
    assert r["reason"] == "crash" and r["mode"] == "inplace" and r["restarts_used"] == 1
    assert r["started_devices"] == [2] and sorted(r["kept_devices"]) == [0, 1, 3]


TP_JOB = """
name = "tp2-mlp"
[model]
layers = 8
forward_s = 0.001
backward_s = 0.002
param_bytes = 1e3
optimizer_bytes = 2e3
activation_bytes = 1e3
[cluster]
devices = 8
device_memory_bytes = 1e9
bandwidth_bytes_per_s = 1e9
restart_s = 1.0
failure_rate_per_hour = 0.1
regroup_s = 0.1
[training]
tp = 2
dp = 2
pp = 2
global_micro_batches = 8
"""


@pytest.mark.timeout(120)
def test_a_card_lost_takes_its_tensor_parallel_unit_and_the_rest_recover_in_place(
        tmp_path, launch):
    """8 cards as 4 units of 2 ((PP, DP, TP) = (2, 2, 2)), layers sharded by torch's tensor
    parallelism: card 7 (unit 3, tensor-parallel rank 1) is killed; its unit is lost whole (the
    agent stops card 6), the other units recover in place, and training equals one process."""
    from chameleon_elastic.models.toy import reference_run, tp_mlp_model

    job = tmp_path / "job.toml"
    job.write_text(TP_JOB)
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    steps = 5
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "8", "--job", str(job),
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", MLP_FAULTS, str(out), str(steps),
                               "7:2:backward:kill", "--tp-model"])
    assert run.wait(110) == 0, run.log.read_text()[-3000:]
    log = run.log.read_text()
    assert "unit 3 (cards 6-7) lost (SIGKILL)" in log and "Traceback" not in log

    ref = reference_run(tp_mlp_model(layers=8), steps, 8)
    reported = _reported(out)
    assert [r["step"] for r in reported] == list(range(steps))
    np.testing.assert_allclose([r["loss"] for r in reported], ref.losses, rtol=1e-9, atol=1e-12)
    for unit in (0, 1, 2):   # the survivors hold single-process parameters
        params = __import__("torch").load(out / f"params-{unit}.pt", weights_only=True)
        for layer, tensors in params.items():
            for name, value in tensors.items():
                np.testing.assert_allclose(value.numpy(),
                                           ref.layers[layer].state_dict()[name].numpy(),
                                           rtol=1e-9, atol=1e-12)
    for card in range(6):   # one process per surviving card, the whole run
        assert len((out / f"pid-{card}").read_text().split()) == 1
    partner = int((out / "pid-6").read_text().split()[0])
    wait_for(lambda: not pid_alive(partner), 10, "the lost unit's other card to be stopped")

    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["mode"] == "inplace"
    assert sorted(recovered[0]["kept_devices"]) == list(range(6))
    chosen = [e for e in read_events(state / "events.jsonl") if e["event"] == "plan_chosen"]
    assert chosen[-1]["lost"] == [3]
