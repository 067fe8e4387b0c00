"""In-place recovery end to end: chameleon-run, real gloo workers, real SIGKILL, a float64 model.

A fault is injected at each phase of a step (the commit protocol's point 3, see
runtime/commit.py). In every case the job must finish with exit 0 without relaunching anyone
(each device ran in one process), every step must be reported exactly once and none redone, and
the per-step loss and the final parameters of every surviving replica must equal single-process
training (float64, rtol 1e-9).
"""

from __future__ import annotations

import pytest

from .conftest import MLP_FAULTS, assert_single_process_results, read_events

STEPS = 6

# DEVICE:STEP:PHASE:ACTION; tiny-cpu runs pipelines (0 1) and (2 3), layers 0-3 and 4-7
CASES = {
    "forward": (["3:3:forward:kill"], None),
    "backward": (["1:3:backward:kill"], None),
    "gradient-sync": (["2:3:sync:kill"], None),
    "vote-reporter": (["0:3:vote:kill"], None),
    # device 3 dies after the vote; device 1's vote result never arrived: it must not apply
    # step 3 on its own, and it may roll it forward only if a survivor committed it
    "between-vote-and-apply": (["3:3:apply:kill", "1:3:apply:lose-vote"], None),
    # device 1 applied step 3 (and died in step 4), its peer holder 3 did not: 3 rolls forward
    "between-holders-applies": (["1:4:forward:kill", "3:3:apply:lose-vote"], {3}),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(CASES))
def test_fault_in_every_phase_recovers_in_place_with_single_process_results(
        case, tmp_path, launch):
    faults, rolled = CASES[case]
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", MLP_FAULTS, str(out), str(STEPS), *faults])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]

    victims = {int(f.split(":")[0]) for f in faults if f.endswith(":kill")}
    survivors = sorted(set(range(4)) - victims)
    assert_single_process_results(out, survivors, STEPS)
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
    assert "Traceback" not in run.log.read_text()
