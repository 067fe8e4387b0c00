"""Training under a symmetric, an asymmetric and a rerouted plan equals single-process training.

Real gloo processes (one per working device), a 7-layer Linear+tanh model in float64, SGD with
momentum, 8 global micro-batches of 2 samples, 20 steps. Tolerance: 1e-9 relative + 1e-11
absolute on every per-step loss and on every parameter after training. Only the order of
floating-point sums differs between the runs (all-reduce vs sequential accumulation), which in
float64 moves results by ~1e-15 per operation; anything structurally wrong (a lost or doubled
micro-batch, a wrong weight, a stale gradient) moves them by more than 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from chameleon_elastic.models.toy import mlp_model, reference_training
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

STEPS = 20
GLOBAL_MB = 8
MBS = 2
RTOL, ATOL = 1e-9, 1e-11


def symmetric_plan() -> ExecutionPlan:
    layers = ((0, 4), (4, 7))
    return ExecutionPlan("initial", 0, tuple(
        Pipeline((2 * p, 2 * p + 1), layers, 2) for p in range(4))).validate()


def asymmetric_plan() -> ExecutionPlan:
    return ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 4), (4, 7)), 3),
        Pipeline((2, 3), ((0, 3), (3, 7)), 2),
        Pipeline((4, 5, 6), ((0, 2), (2, 5), (5, 7)), 3),
    ), failed_devices=(), spare_devices=()).validate()


def rerouted_plan() -> ExecutionPlan:
    base = symmetric_plan()
    return ExecutionPlan("reroute", 1, base.pipelines, failed_devices=(3,), reroute=(
        Reroute(3, 1, 1, (PeerShare(1, 1), PeerShare(5, 1), PeerShare(7, 0))),
    )).validate()


def _train(rank: int, world: int, plan_json: str, steps: int):
    plan = ExecutionPlan.from_json(plan_json)
    device = dense_rank_map(plan).device_of_rank[rank]
    trainer = PipelineTrainer(mlp_model(), plan, device, micro_batch_size=MBS)
    losses = [trainer.step(t).loss for t in range(steps)]
    state = {layer: {k: v.numpy() for k, v in params.items()}
             for layer, params in trainer.state().items()}
    trainer.close()
    return losses, state


@pytest.fixture(scope="module")
def reference():
    losses, layers = reference_training(mlp_model(), STEPS, GLOBAL_MB, MBS)
    state = {i: {k: v.detach().numpy() for k, v in m.state_dict().items()}
             for i, m in enumerate(layers)}
    return losses, state


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make_plan", [symmetric_plan, asymmetric_plan, rerouted_plan],
                         ids=["symmetric-4x2", "asymmetric-2-2-3", "rerouted-1-dead"])
def test_plan_trains_like_single_process(make_plan, reference):
    plan = make_plan()
    assert plan.global_micro_batches == GLOBAL_MB
    ref_losses, ref_state = reference
    results = run_local_world(_train, len(plan.working_devices), plan.to_json(), STEPS,
                              timeout_s=80)
    for losses, _ in results:  # every rank reports the same global loss
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert ref_losses[-1] < ref_losses[0]  # it actually trained
    seen: dict[int, int] = {}
    for _, state in results:
        for layer, params in state.items():
            seen[layer] = seen.get(layer, 0) + 1
            for name, value in params.items():
                np.testing.assert_allclose(value, ref_state[layer][name], rtol=RTOL, atol=ATOL,
                                           err_msg=f"layer {layer} {name}")
    # every layer is held (and checked) once per pipeline whose holder is alive
    assert sorted(seen) == list(range(7))
