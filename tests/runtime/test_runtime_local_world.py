"""The local gloo world used by tests and benchmarks reports failures and leaves no orphans;
the GPT example, as it runs by default, trains like single-process training under data
parallelism, asymmetric pipelines and a rerouted layout."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from chameleon_elastic.models.toy import mlp_model, reference_run
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.execution.layout import data_parallel_plan
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import LocalWorldError, run_local_world

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return os.getpid()


def _hang(rank: int, world: int) -> None:
    buf = torch.zeros(1)
    dist.recv(buf, src=(rank + 1) % world)  # nobody sends: a deadlock


def _workers() -> set[int]:
    """Our descendants except multiprocessing's long-lived helpers (forkserver, tracker)."""
    helpers = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
    return {p.pid for p in psutil.Process().children(recursive=True)
            if not any(h in " ".join(p.cmdline()) for h in helpers)}


@pytest.mark.timeout(60)
def test_a_failing_rank_surfaces_its_traceback():
    with pytest.raises(LocalWorldError, match="rank 1 failed(.|\n)*rank one refuses"):
        run_local_world(_raise_on_rank_one, 2, timeout_s=50)
    assert not _workers()


@pytest.mark.timeout(60)
def test_a_deadlock_hits_the_deadline_and_leaves_no_process():
    run_local_world(_raise_on_rank_one, 1, timeout_s=50)  # warm the forkserver
    with pytest.raises(LocalWorldError, match="missed its 5 s deadline"):
        run_local_world(_hang, 2, timeout_s=5, collective_timeout_s=60)
    assert not _workers()


GPT_OPTIONS = {"precision": "bf16", "max_grad_norm": 1.0}   # the example's defaults


def _gpt(steps: int, dropout: float = 0.0):
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.gpt_model(blocks=2, context=16, width=32, heads=2, lr=3e-3,
                             corpus=example.stdlib_corpus(100_000), seed=0, tie=True,
                             warmup=2, total_steps=steps, dropout=dropout)


def _gpt_losses(rank: int, world: int, plan_json: str, steps: int) -> list[float]:
    plan = ExecutionPlan.from_json(plan_json)
    trainer = PipelineTrainer(_gpt(steps), plan, dense_rank_map(plan).device_of_rank[rank],
                              micro_batch_size=2, **GPT_OPTIONS)
    losses = [trainer.step(t).loss for t in range(steps)]
    trainer.close()
    return losses


@pytest.mark.timeout(120)
def test_gpt_example_trains_like_single_process_under_every_plan_kind():
    """The example as it runs by default (tied embedding, bf16 autocast, clipping, warm-up +
    cosine) under data parallelism, asymmetric pipelines and a rerouted layout, against the
    same model trained in one process with torch's own tools. Step 0 runs the same bf16
    operations on the same weights everywhere (rtol 1e-6: only fp32 sums differ in order);
    later steps inherit weights that differ by fp32 rounding, which can flip a bf16 rounding:
    rtol 2e-3, half of bf16's resolution (runtime/test_runtime_features.py measures it)."""
    steps = 4
    ref = reference_run(_gpt(steps), steps, 4, 2, **GPT_OPTIONS)
    dp = data_parallel_plan(2, 4, 4)
    asymmetric = ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 2), (2, 4)), 1),
        Pipeline((2, 3, 4), ((0, 1), (1, 3), (3, 4)), 3))).validate()
    rerouted = ExecutionPlan("reroute", 1, (
        Pipeline((0, 1), ((0, 3), (3, 4)), 2), Pipeline((2, 3), ((0, 3), (3, 4)), 2)),
        failed_devices=(3,), reroute=(Reroute(3, 1, 1, (PeerShare(1, 2),)),)).validate()
    assert ref.losses[-1] < ref.losses[0]
    for plan in (dp, asymmetric, rerouted):
        losses = run_local_world(_gpt_losses, len(plan.live_devices), plan.to_json(), steps,
                                 timeout_s=100)[0]
        np.testing.assert_allclose(losses[0], ref.losses[0], rtol=1e-6)
        np.testing.assert_allclose(losses, ref.losses, rtol=2e-3)


def _gpt_dropout_losses(rank: int, world: int, plan_json: str, steps: int) -> list[float]:
    plan = ExecutionPlan.from_json(plan_json)
    trainer = PipelineTrainer(_gpt(steps, dropout=0.1), plan,
                              dense_rank_map(plan).device_of_rank[rank], micro_batch_size=2,
                              max_grad_norm=1.0, precision="fp32")
    losses = [trainer.step(t).loss for t in range(steps)]
    trainer.close()
    return losses


@pytest.mark.timeout(120)
def test_gpt_example_with_dropout_trains_like_single_process():
    """--dropout 0.1: the masks depend on (seed, step, micro-batch, layer) only, so a rerouted
    plan (device 1 runs the dead device 3's micro-batches too) trains as one process does
    (fp32: only sums differ in order)."""
    steps = 3
    ref = reference_run(_gpt(steps, dropout=0.1), steps, 4, 2, max_grad_norm=1.0)
    without = reference_run(_gpt(steps), steps, 4, 2, max_grad_norm=1.0)
    assert abs(ref.losses[0] - without.losses[0]) > 1e-3   # the dropout draws masks
    rerouted = ExecutionPlan("reroute", 1, (
        Pipeline((0, 1), ((0, 1), (1, 4)), 2), Pipeline((2, 3), ((0, 1), (1, 4)), 2)),
        failed_devices=(3,), reroute=(Reroute(3, 1, 1, (PeerShare(1, 2),)),)).validate()
    losses = run_local_world(_gpt_dropout_losses, len(rerouted.live_devices),
                             rerouted.to_json(), steps, timeout_s=100)[0]
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)


def _gpt_tp_losses(rank: int, world: int, plan_json: str, steps: int,
                   precision: str) -> list[float]:
    plan = ExecutionPlan.from_json(plan_json)
    ranks = dense_rank_map(plan, 2)
    trainer = PipelineTrainer(_gpt(steps), plan, ranks.device_of_rank[rank], micro_batch_size=2,
                              max_grad_norm=1.0, precision=precision,
                              tp_rank=ranks.tp_rank_of_rank[rank], tp_size=2)
    losses = [trainer.step(t).loss for t in range(steps)]
    trainer.close()
    return losses


@pytest.mark.timeout(120)
def test_gpt_example_with_tensor_parallel_units_trains_like_single_process():
    """The example's own tensor-parallel plan (vocabulary-split embedding tied to the head,
    attention split by heads, MLP by columns then rows) on units of 2 cards: pipelines of 2 units
    and of 1 unit holding both tied layers. fp32 within 1e-5 (only partial sums differ);
    bf16 within 2e-3 (a row-split matmul rounds its partial products to bf16 before the sum)."""
    steps = 4
    plan = ExecutionPlan("initial", 0, (Pipeline((0, 1), ((0, 2), (2, 4)), 2),
                                        Pipeline((2,), ((0, 4),), 2))).validate()
    for precision, rtol in (("fp32", 1e-5), ("bf16", 2e-3)):
        ref = reference_run(_gpt(steps), steps, 4, 2, precision=precision, max_grad_norm=1.0)
        losses = run_local_world(_gpt_tp_losses, 6, plan.to_json(), steps, precision,
                                 timeout_s=100)[0]
        np.testing.assert_allclose(losses, ref.losses, rtol=rtol, err_msg=precision)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["--width", "30", "--heads", "4"], "must be a multiple of --heads"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--eval-samples", "1000", "--corpus-bytes", "8192"], "leave no training text"),
])
def test_gpt_example_usage_error_exits_2_without_traceback(args, message):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(EXAMPLE), *args],
                          check=False, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _join_plan(rank: int, world: int, plan_json: str) -> None:
    plan = ExecutionPlan.from_json(plan_json)
    PipelineTrainer(mlp_model(), plan, dense_rank_map(plan).device_of_rank[rank])


@pytest.mark.timeout(60)
def test_a_world_smaller_than_the_plan_fails_with_a_clear_error():
    plan = data_parallel_plan(3, 7, 6)
    with pytest.raises(LocalWorldError, match=r"devices \[2\] have work but no process"):
        run_local_world(_join_plan, 2, plan.to_json(), timeout_s=50)
