"""Runtime and plugin pieces without a distributed world: data mapping, layer building, shapes,
plan/environment loading, rank numbering, holders, and the device back-end factory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from chameleon_elastic.models.toy import featured_model, mlp_model
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.plugins import PluginError, backend_names, get_backend, memory_stats
from chameleon_elastic.runtime import PipelineRuntimeError, PipelineTrainer, plan_from_env
from chameleon_elastic.runtime.data import sample_ids, step_sample_ids
from chameleon_elastic.runtime.execution.executor import PipelineExecutor, TensorSpec, boundary_spec
from chameleon_elastic.runtime.execution.layout import data_parallel_plan, layer_holders
from chameleon_elastic.runtime.model import build_layers, make_optimizer
from chameleon_elastic.runtime.topology import RankMap, dense_rank_map, device_from_env


def plans_with_eight_micro_batches() -> list[ExecutionPlan]:
    sym = ExecutionPlan("initial", 0, tuple(
        Pipeline((2 * p, 2 * p + 1), ((0, 4), (4, 7)), 2) for p in range(4)))
    asym = ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 4), (4, 7)), 3), Pipeline((2, 3), ((0, 3), (3, 7)), 1),
        Pipeline((4, 5, 6), ((0, 2), (2, 5), (5, 7)), 4)))
    rerouted = ExecutionPlan("reroute", 1, sym.pipelines, failed_devices=(3,), reroute=(
        Reroute(3, 1, 1, (PeerShare(1, 1), PeerShare(5, 1), PeerShare(7, 0))),))
    return [p.validate() for p in (sym, asym, rerouted, data_parallel_plan(3, 7, 8))]


@pytest.mark.parametrize("step", [0, 1, 17])
def test_every_plan_covers_the_global_batch_exactly_once(step):
    expected = list(step_sample_ids(step, 8, 3))
    for plan in plans_with_eight_micro_batches():
        taken = [i for pi, p in enumerate(plan.pipelines) for m in range(p.micro_batches)
                 for i in sample_ids(step, plan, pi, m, 3)]
        assert sorted(taken) == expected, plan


def test_sample_ids_reject_a_micro_batch_outside_the_quota():
    plan = plans_with_eight_micro_batches()[1]
    with pytest.raises(ValueError, match="quota of 1"):
        sample_ids(0, plan, 1, 1, 2)


def test_a_layer_has_the_same_weights_whoever_builds_it():
    model = mlp_model(layers=5)
    whole = build_layers(model, 0, 5)
    tail = build_layers(model, 3, 5)
    for a, b in zip(whole[3:], tail):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    assert not torch.equal(whole[0].linear.weight, whole[1].linear.weight)
    with pytest.raises(PipelineRuntimeError, match="not inside the model's 5 layers"):
        build_layers(model, 2, 6)


def test_boundary_spec_is_inferred_without_running_the_model():
    model = mlp_model(width=12)
    spec = boundary_spec(model, 3, micro_batch_size=5)
    assert spec.structure is None
    assert spec.leaves == (TensorSpec((5, 12), torch.float64, requires_grad=True),)


def test_boundary_spec_of_structured_stages_and_low_precision():
    model = featured_model(width=6, dtype=torch.float32)
    tuple_in = boundary_spec(model, 1, micro_batch_size=3)   # layer 0 returns a tuple
    assert tuple_in.structure == ("tuple", (None, None, None))
    assert [(s.shape, s.dtype, s.requires_grad) for s in tuple_in.leaves] == [
        ((3, 6), torch.float32, True), ((3, 6), torch.float32, False),
        ((3,), torch.int64, False)]
    dict_in = boundary_spec(model, 2, micro_batch_size=3, precision="bf16")
    assert dict_in.structure[:2] == ("dict", ("h", "mask", "count"))
    # under autocast the linear runs in bf16; the mask (fp32) promotes the product to fp32
    assert [s.dtype for s in dict_in.leaves] == [torch.float32, torch.float32, torch.int64]


class _Labelled(nn.Module):
    def forward(self, x):
        return x, "label"


def test_a_layer_returning_something_else_than_tensors_is_refused():
    base = mlp_model()
    model = type(base)(num_layers=3, build_layer=lambda i: _Labelled(), loss=base.loss,
                       make_optimizer=base.make_optimizer, sample=base.sample)
    with pytest.raises(PipelineRuntimeError, match="holds a str"):
        boundary_spec(model, 2, 1)


def _decay_by_layer(named, lr=0.1):
    named = list(named)
    return torch.optim.AdamW([{"params": [(n, p)], "weight_decay": 0.1 * i}
                              for i, (n, p) in enumerate(named)], lr=lr)


def test_the_optimizer_gets_model_wide_names_and_tied_copies_one_group():
    model = featured_model(layers=3, groups=True)
    layers = {i: build_layers(model, i, i + 1)[0] for i in (0, 2)}
    optimizer = make_optimizer(model, layers)
    names = [n for g in optimizer.param_groups for n in g["param_names"]]
    assert sorted(names) == ["layers.0.linear.bias", "layers.0.linear.weight",
                             "layers.2.linear.bias", "layers.2.linear.weight"]
    import dataclasses

    apart = dataclasses.replace(model, make_optimizer=_decay_by_layer)
    with pytest.raises(PipelineRuntimeError, match="tied copies .* different options"):
        make_optimizer(apart, layers)


def test_plan_and_device_come_from_the_environment(tmp_path):
    plan = plans_with_eight_micro_batches()[2]
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert plan_from_env({}) is None
    assert plan_from_env({"CHAMELEON_PLAN_FILE": str(path)}) == plan
    assert device_from_env(plan, {"CHAMELEON_DEVICE": "5"}) == 5
    assert device_from_env(plan, {"RANK": "3"}) == 4  # dense numbering skips dead device 3
    with pytest.raises(PipelineRuntimeError, match="cannot be read"):
        plan_from_env({"CHAMELEON_PLAN_FILE": str(tmp_path / "missing.json")})
    path.write_text("{not json")
    with pytest.raises(PipelineRuntimeError, match="does not hold a valid plan"):
        plan_from_env({"CHAMELEON_PLAN_FILE": str(path)})
    with pytest.raises(PipelineRuntimeError, match="only 7 devices"):
        device_from_env(plan, {"RANK": "7"})


def test_dense_ranks_skip_dead_devices_and_put_spares_last():
    plan = ExecutionPlan("reroute", 2, (
        Pipeline((0, 1), ((0, 2), (2, 4)), 2), Pipeline((2, 3), ((0, 2), (2, 4)), 2)),
        spare_devices=(4,), failed_devices=(1,),
        reroute=(Reroute(1, 0, 1, (PeerShare(3, 2),)),)).validate()
    ranks = dense_rank_map(plan)
    assert ranks.device_of_rank == (0, 2, 3, 4)
    assert ranks.ranks([3, 0]) == (0, 2)
    with pytest.raises(PipelineRuntimeError, match="device 1 has no rank"):
        RankMap(ranks.device_of_rank).rank(1)
    assert layer_holders(plan) == {0: (0, 2), 1: (0, 2), 2: (3,), 3: (3,)}


def test_data_parallel_plan_spreads_quotas_and_refuses_too_few_micro_batches():
    plan = data_parallel_plan(3, 7, 8)
    assert [p.micro_batches for p in plan.pipelines] == [3, 3, 2]
    with pytest.raises(PipelineRuntimeError, match="cannot feed 4 ranks"):
        data_parallel_plan(4, 7, 3)


def test_executor_refuses_another_devices_operations():
    plan = plans_with_eight_micro_batches()[0]
    from chameleon_elastic.planning.schedule import device_orders

    executor = PipelineExecutor(plan, 0, mlp_model(), None, 1, dense_rank_map(plan))
    with pytest.raises(PipelineRuntimeError, match="belongs to device 1"):
        executor.run(0, device_orders(plan)[1])


def test_a_superseded_generation_stops_the_step_before_its_next_operation():
    """A survivor that is computing when the agents publish a newer generation (its only
    transfers may be the step's gradient sums, at the end of its backward) gives the step up
    before its next operation, not at its next transfer: nothing runs once the flag is set."""
    import threading

    from chameleon_elastic.planning.schedule import device_orders
    from chameleon_elastic.runtime.errors import PeerLost

    plan = data_parallel_plan(1, 7, 2)
    executor = PipelineExecutor(plan, 0, mlp_model(), build_layers(mlp_model(), 0, 7), 1,
                                dense_rank_map(plan))
    superseded, ran = threading.Event(), []
    superseded.set()
    with pytest.raises(PeerLost, match="gave step 0 up: the agents published a newer plan"):
        executor.run(0, device_orders(plan)[0], on_phase=lambda s, p: ran.append(p),
                     superseded=superseded)
    assert ran == []
    superseded.clear()
    executor.run(0, device_orders(plan)[0], on_phase=lambda s, p: ran.append(p),
                 superseded=superseded)
    assert ran == ["forward", "backward"]


def test_trainer_needs_an_initialised_process_group():
    plan = plans_with_eight_micro_batches()[0]
    with pytest.raises(PipelineRuntimeError, match="not initialised"):
        PipelineTrainer(mlp_model(), plan, 0)


def test_backend_factory_names_aliases_and_errors():
    assert backend_names() == ("cpu", "cuda", "npu")
    assert get_backend("gloo").name == "cpu" and get_backend("cpu").dist_backend == "gloo"
    assert get_backend("nccl").dist_backend == "cpu:gloo,cuda:nccl"   # CPU tensors: gloo
    assert get_backend("hccl").name == "npu"
    assert get_backend(None).is_available()
    with pytest.raises(PluginError, match="unknown device back-end 'tpu'"):
        get_backend("tpu")
    if not get_backend("cuda").is_available():
        with pytest.raises(PluginError, match="not available"):
            get_backend("cuda").device(0)
    if not get_backend("npu").is_available():
        assert get_backend("npu").device_count() == 0


def test_cpu_memory_stats_are_plausible():
    stats = memory_stats("cpu")
    assert 0 < stats.allocated <= stats.peak
    assert stats.allocated < stats.total
    assert stats.to_dict()["free"] == stats.total - stats.reserved


def test_importing_plugins_does_not_import_torch():
    code = ("import sys, chameleon_elastic.plugins as p; p.get_backend('cpu'); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
