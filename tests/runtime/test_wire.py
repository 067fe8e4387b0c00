"""Point-to-point transfers through host memory (runtime/world/wire.py): which device tensors
need it, asked of the device plugins, and the staged path carrying real training and a restore.

No GPU here: the staged path is driven with CPU tensors by a LABELLED FAKE (``_needs_host``
told to say yes for the CPU), so what runs is the path a CUDA tensor takes on a gloo world,
minus the copies between the device and the host. benchmarks/cuda_smoke.py ``--procs N`` runs
it with CUDA tensors on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from chameleon_elastic.models.toy import mlp_model, reference_training
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.plugins import get_backend
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.state.snapshots import Snapshots
from chameleon_elastic.runtime.world import wire
from chameleon_elastic.runtime.world.local_world import run_local_world

MBS = 2


@pytest.mark.parametrize(("backend", "device_type", "staged"), [
    ("gloo", "cuda", True),                      # several processes on one GPU
    ("cpu:gloo,cuda:nccl", "cuda", False),       # the cuda plugin's world: NCCL reads the GPU
    ("cpu:gloo,cuda:nccl-legacy", "cuda", False),
    ("nccl2", "cuda", False),
    ("gloo", "cpu", False),
    ("cpu:gloo,cuda:nccl", "cpu", False),        # the runtime's rows and votes
    ("hccl", "npu", False),
    ("gloo", "npu", True),
    ("gloo", "meta", False),                     # no plugin: left to torch
])
def test_the_device_plugin_says_which_tensors_go_through_the_host(backend, device_type, staged):
    assert wire._needs_host(backend, device_type) is staged


def test_the_backend_serving_a_device_type_is_read_as_torch_reads_it():
    assert wire.serving_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert wire.serving_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert wire.serving_backend("gloo", "cuda") == "gloo"   # torch: cpu and cuda for gloo
    assert wire.serving_backend("cpu:gloo", "cuda") is None
    assert get_backend("cpu").through_host("gloo") is False
    assert get_backend("cuda").through_host("gloo") is True


def _staged_training(rank: int, world: int, steps: int) -> dict:
    """FAKE: every CPU tensor is played as a device tensor that must go through the host. Two
    ranks, one pipeline of two stages with snapshots every 2 steps; then device 1 forgets
    everything (a new process in its place) and both enter the next generation, device 1's
    layers coming back from device 0's snapshot."""
    staged = {"asked": 0, "received_into": []}
    real_recv = dist.recv

    def needs_host(backend: str, device_type: str) -> bool:
        staged["asked"] += 1
        return True

    def spy_recv(tensor, *args, **kwargs):
        staged["received_into"].append(tensor)
        return real_recv(tensor, *args, **kwargs)

    wire._needs_host = needs_host
    wire.dist.recv = spy_recv
    buf = torch.zeros(5, dtype=torch.float64)
    if rank == 0:
        wire.isend(torch.arange(5, dtype=torch.float64), dst=1, tag=1).wait()
    else:
        wire.recv(buf, src=0, tag=1)
    direct = (buf.tolist(), any(t is buf for t in staged["received_into"]))
    plan = ExecutionPlan("initial", 0, (Pipeline((0, 1), ((0, 4), (4, 7)), 8),)).validate()
    trainer = PipelineTrainer(mlp_model(), plan, rank, micro_batch_size=MBS, snapshot_every=2)
    losses: list[tuple[int, bool, float]] = []
    trainer.run(steps, lambda r: losses.append((r.step, r.redone, r.loss)))
    trainer.snapshots.settle()
    trainer.release_groups()
    if rank == 1:
        trainer.layers, trainer.optimizer, trainer.committed = {}, None, None
        trainer.extras, trainer.scheduler = {}, None
        trainer.snapshots = Snapshots(2)
    asked = staged["asked"]
    entry = trainer.enter(ExecutionPlan("replan", 1, plan.pipelines).validate(), None)
    restore_asked = staged["asked"] - asked
    trainer.run(steps + 2, lambda r: losses.append((r.step, r.redone, r.loss)))
    state = {x: {k: v.numpy() for k, v in p.items()} for x, p in trainer.state().items()}
    trainer.close()
    return {"direct": direct, "asked": staged["asked"], "restore_asked": restore_asked,
            "source": entry.source, "losses": losses, "state": state}


@pytest.mark.timeout(90)
def test_staged_transfers_carry_training_and_a_restore_from_a_snapshot():
    steps = 3
    out = run_local_world(_staged_training, 2, steps, timeout_s=80)
    ref_losses, ref_layers = reference_training(mlp_model(), steps + 2, 8, MBS)
    values, into_the_callers_buffer = out[1]["direct"]
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0] and not into_the_callers_buffer
    for rank, got in enumerate(out):
        assert got["asked"] > 0 and got["restore_asked"] > 0   # the staged path was taken
        assert got["source"] == "snapshot"
        for x, params in got["state"].items():
            for k, v in params.items():
                np.testing.assert_allclose(v, ref_layers[x].state_dict()[k].numpy(),
                                           rtol=1e-9, atol=1e-12)
    losses = out[0]["losses"]   # the reporter's: step 2 trained again from snapshot 2
    assert [(s, again) for s, again, _ in losses] == [(0, False), (1, False), (2, False),
                                                      (2, True), (3, False), (4, False)]
    np.testing.assert_allclose([loss for *_, loss in losses], [ref_losses[s] for s, *_ in losses],
                               rtol=1e-9, atol=1e-12)
