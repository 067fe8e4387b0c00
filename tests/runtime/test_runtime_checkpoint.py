"""A checkpoint written under one plan resumes training under another, exactly.

World A trains 3 steps under the asymmetric 2+2+3 plan and commits a checkpoint; world B, under
the rerouted 4x2 plan (other devices hold other layers), loads it and trains steps 3..5. Losses
of steps 3..5 and the final parameters must equal 6 uninterrupted single-process steps (float64,
rtol 1e-9); SGD momentum makes the optimizer state part of what must survive.
"""

from __future__ import annotations

import numpy as np
import pytest

from chameleon_elastic.models.toy import (
    WeightEMA,
    featured_model,
    mlp_model,
    reference_run,
    reference_training,
)
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import (
    PipelineRuntimeError,
    PipelineTrainer,
    latest_step,
    load_checkpoint,
    save_checkpoint,
)
from chameleon_elastic.runtime.state.checkpoint import load_layers
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

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


# --------------------------------------------------------------------------- DCP, in the background


def four_devices() -> ExecutionPlan:
    return ExecutionPlan("initial", 0, (
        Pipeline((0, 1), ((0, 4), (4, 7)), 3), Pipeline((2, 3), ((0, 3), (3, 7)), 3))).validate()


def three_devices() -> ExecutionPlan:
    return ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 2), (2, 7)), 4), Pipeline((2,), ((0, 7),), 2))).validate()


def _dcp_model():
    return featured_model(groups=True)


def _dcp_run(rank: int, world: int, plan_json: str, directory: str, steps: int):
    """trainer.run with background saves every 2 steps (and after the last)."""
    plan = ExecutionPlan.from_json(plan_json)
    trainer = PipelineTrainer(_dcp_model(), plan, dense_rank_map(plan).device_of_rank[rank],
                              micro_batch_size=MBS, checkpoint_dir=directory,
                              layer_state={"ema": WeightEMA})
    start, losses = trainer.committed, []
    trainer.run(steps, lambda r: losses.append(r.loss), checkpoint_every=2)
    state = {layer: {k: v.numpy() for k, v in params.items()}
             for layer, params in trainer.state().items()}
    emas = {layer: {k: v.clone().numpy() for k, v in objects["ema"].shadow.items()}
            for layer, objects in trainer.extras.items()}
    trainer.close()
    return start, losses, state, emas


def _read_in_one_process(directory) -> dict:
    """What a user does with plain torch tools: every key of the checkpoint, read by DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata) and "." in k
               and not k.startswith(("optimizer.", "extra.", "trainer.", "job."))}
    dcp.load(tensors, checkpoint_id=str(directory), no_dist=True)
    return tensors


@pytest.mark.timeout(120)
def test_dcp_checkpoint_of_four_devices_reads_in_one_process_and_resumes_on_three(tmp_path):
    """A job of 4 devices (pipelines [2, 2]) saves in the background; plain DCP in one process
    reads the checkpoint as {parameter name: tensor} equal to the trainers' tensors; a job of 3
    devices under another plan resumes from it with losses, weights and EMA equal to 7
    single-process steps (float64, rtol 1e-9)."""
    a = run_local_world(_dcp_run, 4, four_devices().to_json(), str(tmp_path), 4, timeout_s=100)
    assert latest_step(tmp_path) == 4
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-4"]
    read = _read_in_one_process(tmp_path / "step-4")
    expected = {f"layers.{layer}.{k}": v for _, _, state, _ in a
                for layer, params in state.items() for k, v in params.items()}
    assert set(read) == set(expected) and len(read) == 2 * _dcp_model().num_layers
    for name, value in read.items():
        np.testing.assert_array_equal(value.numpy(), expected[name], err_msg=name)
    b = run_local_world(_dcp_run, 3, three_devices().to_json(), str(tmp_path), 7, timeout_s=100)
    assert b[0][0] == 4 and latest_step(tmp_path) == 7
    ema = {}

    def update(step, layers):
        for i, layer in enumerate(layers):
            for k, p in layer.named_parameters():
                ema[i, k] = 0.9 * ema[i, k] + 0.1 * p.detach()

    ref = reference_run(_dcp_model(), 0, 6, MBS)
    ema.update({(i, k): p.detach().clone() for i, m in enumerate(ref.layers)
                for k, p in m.named_parameters()})
    ref = reference_run(_dcp_model(), 7, 6, MBS, after_step=update)
    np.testing.assert_allclose(a[0][1] + b[0][1], ref.losses, rtol=1e-9, atol=1e-11)
    for _, _, state, emas in b:
        for layer, params in state.items():
            for k, value in params.items():
                np.testing.assert_allclose(value, ref.layers[layer].state_dict()[k].numpy(),
                                           rtol=1e-9, atol=1e-11, err_msg=f"{layer} {k}")
            for k, value in emas[layer].items():
                np.testing.assert_allclose(value, ema[layer, k].numpy(), rtol=1e-9,
                                           atol=1e-11, err_msg=f"EMA {layer} {k}")


def test_the_old_layer_file_format_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "layer-0.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("3\n")
    with pytest.raises(PipelineRuntimeError, match="old per-layer format") as caught:
        load_layers(tmp_path, 3, [0])
    assert "\n" not in str(caught.value)
