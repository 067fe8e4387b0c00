"""A layer-wise checkpoint written under one plan resumes training under another, exactly.

World A trains 3 steps under the asymmetric 2+2+3 plan and commits a checkpoint; world B, under
the rerouted 4x2 plan (other devices hold other layers), loads it and trains steps 3..5. Losses
of steps 3..5 and the final parameters must equal 6 uninterrupted single-process steps (float64,
rtol 1e-9); SGD momentum makes the optimizer state part of what must survive.
"""

from __future__ import annotations

import numpy as np
import pytest

from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import (
    PipelineRuntimeError,
    PipelineTrainer,
    latest_step,
    load_checkpoint,
    save_checkpoint,
)
from chameleon_elastic.runtime.local_world import run_local_world
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.toy import mlp_model, reference_training

MBS = 2


def asymmetric_plan() -> ExecutionPlan:
    return ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 4), (4, 7)), 3),
        Pipeline((2, 3), ((0, 3), (3, 7)), 2),
        Pipeline((4, 5, 6), ((0, 2), (2, 5), (5, 7)), 3),
    )).validate()


def rerouted_plan() -> ExecutionPlan:
    pipes = tuple(Pipeline((2 * p, 2 * p + 1), ((0, 2), (2, 7)), 2) for p in range(4))
    return ExecutionPlan("reroute", 2, pipes, failed_devices=(2,), reroute=(
        Reroute(2, 1, 0, (PeerShare(0, 1), PeerShare(4, 1), PeerShare(6, 0))),
    )).validate()


def _segment(rank: int, world: int, plan_json: str, directory: str, steps: int):
    plan = ExecutionPlan.from_json(plan_json)
    trainer = PipelineTrainer(mlp_model(), plan, dense_rank_map(plan).device_of_rank[rank],
                              micro_batch_size=MBS)
    start = load_checkpoint(trainer, directory)
    losses = [trainer.step(t).loss for t in range(start, start + steps)]
    save_checkpoint(trainer, directory, start + steps)
    state = {layer: {k: v.numpy() for k, v in params.items()}
             for layer, params in trainer.state().items()}
    trainer.close()
    return start, losses, state


@pytest.mark.timeout(90)
def test_checkpoint_moves_training_to_another_plan(tmp_path):
    first, second = asymmetric_plan(), rerouted_plan()
    a = run_local_world(_segment, len(first.working_devices), first.to_json(), str(tmp_path), 3,
                        timeout_s=80)
    assert latest_step(tmp_path) == 3 and a[0][0] == 0
    b = run_local_world(_segment, len(second.working_devices), second.to_json(), str(tmp_path),
                        3, timeout_s=80)
    assert latest_step(tmp_path) == 6
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-6"]
    ref_losses, ref_layers = reference_training(mlp_model(), 6, 8, MBS)
    np.testing.assert_allclose(a[0][1] + b[0][1], ref_losses, rtol=1e-9, atol=1e-11)
    for start, _, state in b:
        assert start == 3
        for layer, params in state.items():
            for name, value in params.items():
                expected = ref_layers[layer].state_dict()[name].detach().numpy()
                np.testing.assert_allclose(value, expected, rtol=1e-9, atol=1e-11)


def test_a_damaged_latest_marker_is_reported(tmp_path):
    (tmp_path / "latest").write_text("three")
    with pytest.raises(PipelineRuntimeError, match="does not hold a step number"):
        latest_step(tmp_path)
    assert latest_step(tmp_path / "absent") is None
