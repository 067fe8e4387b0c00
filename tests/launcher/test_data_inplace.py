"""A dataset and evaluation through in-place recoveries: chameleon-run, real gloo workers, real
SIGKILL, the float64 MLP of workers/mlp_faults.py reading a map-style dataset in seeded
epochs (20 samples, 8 per step: steps span epochs) and evaluated every 2 steps.

Device 1 is killed in a forward (a re-plan to 3 devices), then device 3 in the middle of an
evaluation (a second re-plan, to 2 devices). The job must finish without relaunching anyone,
every step must be reported once, and each step's loss, each evaluation and the final
parameters must equal single-process training on the same epochs (float64, rtol 1e-9): so
every sample was trained exactly once per epoch, whatever the plans, and the interrupted
evaluation was run again under the new plan.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from .conftest import MLP_FAULTS, read_events
from .workers.mlp_faults import EVAL_SAMPLES, EVAL_SEED

STEPS = 6
SAMPLES = 20


@pytest.mark.timeout(90)
def test_a_dataset_and_its_evaluations_survive_two_kills_in_place(tmp_path, launch):
    from chameleon_elastic.models.toy import (
        RegressionData,
        mlp_model,
        reference_evaluation,
        reference_run,
    )

    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", MLP_FAULTS, str(out), str(STEPS),
                               "1:2:forward:kill", "3:4:evaluate:kill",
                               "--dataset", str(SAMPLES), "--eval-every", "2"])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert "Traceback" not in run.log.read_text()

    def model():
        return mlp_model(layers=8, dataset=RegressionData(SAMPLES))

    held_out = RegressionData(EVAL_SAMPLES, seed=EVAL_SEED)
    ref = reference_run(model(), STEPS, 8)
    evals = {k - 1: reference_evaluation(model(), reference_run(model(), k, 8).layers, held_out)
             for k in (2, 4, 6)}
    reported = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reported] == list(range(STEPS))
    assert not any(r["redone"] for r in reported)
    np.testing.assert_allclose([r["loss"] for r in reported], ref.losses, rtol=1e-9,
                               atol=1e-12)
    assert {r["step"] for r in reported if r["eval_loss"] is not None} == set(evals)
    np.testing.assert_allclose([r["eval_loss"] for r in reported if r["step"] in evals],
                               list(evals.values()), rtol=1e-9)
    for device in (0, 2):   # in place: the survivors never restarted
        assert len((out / f"pid-{device}").read_text().split()) == 1
        params = torch.load(out / f"params-{device}.pt", weights_only=True)
        for layer, tensors in params.items():
            for name, value in tensors.items():
                np.testing.assert_allclose(
                    value.numpy(), ref.layers[layer].state_dict()[name].detach().numpy(),
                    rtol=1e-9, atol=1e-12, err_msg=f"device {device} layer {layer} {name}")
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert [e["mode"] for e in recovered] == ["inplace", "inplace"]
    assert [sorted(e["kept_devices"]) for e in recovered] == [[0, 2, 3], [0, 2]]


@pytest.mark.timeout(120)
def test_a_device_that_comes_back_joins_while_every_step_is_evaluated(tmp_path, launch):
    """Every step is an evaluation step, so each new generation starts at one: the survivors
    and the process that joins (it has evaluated nothing) must agree to evaluate it."""
    from chameleon_elastic.models.toy import (
        RegressionData,
        mlp_model,
        reference_evaluation,
        reference_run,
    )

    from .conftest import wait_for

    steps, health = 12, tmp_path / "bad-devices"
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", "--health-file", str(health), MLP_FAULTS,
                               str(out), str(steps), "--pace", "0.2",
                               "--dataset", str(SAMPLES), "--eval-every", "1"])

    def reported() -> list[dict]:
        path = out / "steps.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    wait_for(lambda: len(reported()) >= 2, 60, "two steps")
    health.write_text("2\n")
    wait_for(lambda: any(e["event"] == "recovered"
                         for e in read_events(state / "events.jsonl")), 30, "device 2 out")
    seen = len(reported())
    wait_for(lambda: len(reported()) >= seen + 2, 30, "two steps without device 2")
    health.write_text("")
    assert run.wait(100) == 0, run.log.read_text()[-3000:]
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    assert [e["mode"] for e in recovered] == ["inplace", "inplace"]
    assert recovered[1]["started_devices"] == [2]

    def model():
        return mlp_model(layers=8, dataset=RegressionData(SAMPLES))

    held_out = RegressionData(EVAL_SAMPLES, seed=EVAL_SEED)
    ref = reference_run(model(), steps, 8)
    got = reported()
    assert [r["step"] for r in got] == list(range(steps))
    np.testing.assert_allclose([r["loss"] for r in got], ref.losses, rtol=1e-9, atol=1e-12)
    evals = [reference_evaluation(model(), reference_run(model(), k + 1, 8).layers, held_out)
             for k in range(steps)]
    np.testing.assert_allclose([r["eval_loss"] for r in got], evals, rtol=1e-9)
