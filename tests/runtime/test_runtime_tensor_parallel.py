"""Tensor parallelism inside a stage (tp = 2): training under symmetric, asymmetric and rerouted
plans of units of two cards equals single-process training (float64, rtol 1e-9), plan changes
move shards between live units, and a checkpoint written by units of two cards loads into a
world of single cards (and trains on to the same result).

One world of 8 gloo processes: 4 units of 2 cards. Plans over the units (a spare unit where a
plan has work for only 3):

- symmetric: pipelines (0 1) and (2 3), layers [0, 3) and [3, 6), 2 micro-batches each;
- asymmetric: (0 1) and (2), unit 3 spare;
- rerouted: (0 1) and (2 4) with unit 4 dead, its micro-batches served by unit 1; unit 3 spare.

Each layer is a residual MLP block whose ``up`` projection is sharded column-wise and ``down``
row-wise by torch's ``parallelize_module``; AdamW and global gradient-norm clipping run on the
shards. Only the order of floating-point sums differs from the single process (the row-wise
all-reduce, the data-parallel sums), which float64 keeps within 1e-9.
"""

from __future__ import annotations

import numpy as np
import pytest

from chameleon_elastic.models.toy import reference_run, tp_mlp_model
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import PipelineTrainer, save_checkpoint
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

TP = 2
MBS = 2
STEPS = 3
CLIP = 0.5
RTOL, ATOL = 1e-9, 1e-11


def plans() -> dict[str, ExecutionPlan]:
    split = ((0, 3), (3, 6))
    return {
        "symmetric": ExecutionPlan("initial", 0, (Pipeline((0, 1), split, 2),
                                                  Pipeline((2, 3), split, 2))),
        "asymmetric": ExecutionPlan("replan", 1, (Pipeline((0, 1), ((0, 2), (2, 6)), 2),
                                                  Pipeline((2,), ((0, 6),), 2)),
                                    spare_devices=(3,)),
        "rerouted": ExecutionPlan("reroute", 2, (Pipeline((0, 1), split, 2),
                                                 Pipeline((2, 4), split, 2)),
                                  spare_devices=(3,), failed_devices=(4,),
                                  reroute=(Reroute(4, 1, 1, (PeerShare(1, 2),)),)),
    }


def _card(plan: ExecutionPlan, rank: int) -> tuple[int, int]:
    ranks = dense_rank_map(plan, TP)
    return ranks.device_of_rank[rank], ranks.tp_rank_of_rank[rank]


def _numpy(state):   # tensors would travel back through file descriptors of a dead process
    return {layer: {k: v.numpy() for k, v in params.items()} for layer, params in state.items()}


def _run(rank: int, world: int, directory: str):
    out = {}
    for kind, plan in plans().items():   # each plan from step 0, in its own trainer
        device, tp_rank = _card(plan, rank)
        trainer = PipelineTrainer(tp_mlp_model(), plan, device, micro_batch_size=MBS,
                                  max_grad_norm=CLIP, tp_rank=tp_rank, tp_size=TP)
        losses = [trainer.step(t).loss for t in range(STEPS)]
        for module in trainer.layers.values():   # really sharded: half of each matrix here
            assert tuple(module.up.weight.to_local().shape) == (8, 8)
            assert tuple(module.down.weight.to_local().shape) == (8, 8)
        out[kind] = (losses, _numpy(trainer.state()))
        trainer.close()
    # the three plans in turn in one live trainer: shards move with their optimizer state
    chain = list(plans().values())
    device, tp_rank = _card(chain[0], rank)
    trainer = PipelineTrainer(tp_mlp_model(), chain[0], device, micro_batch_size=MBS,
                              max_grad_norm=CLIP, tp_rank=tp_rank, tp_size=TP)
    steps = []
    for i, plan in enumerate(chain):
        if i:
            assert _card(plan, rank) == (device, tp_rank)
            trainer.release_groups()
            trainer.enter(plan, None)
        steps += [trainer.step(trainer.committed).loss for _ in range(2)]
    save_checkpoint(trainer, directory, trainer.committed)
    trainer.close()
    # the checkpoint of units of two cards, loaded by 8 single cards (4 pipelines x 2 stages)
    singles = ExecutionPlan("initial", 0, tuple(
        Pipeline((2 * p, 2 * p + 1), ((0, 3), (3, 6)), 1) for p in range(4)))
    restored = PipelineTrainer(tp_mlp_model(), singles, rank, micro_batch_size=MBS,
                               max_grad_norm=CLIP, checkpoint_dir=directory)
    assert restored.committed == 6
    steps += [restored.step(restored.committed).loss for _ in range(2)]
    out["chain"] = (steps, _numpy(restored.state()))
    restored.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp-checkpoint")
    return run_local_world(_run, 4 * TP, str(directory), timeout_s=100)


def _check(name: str, runs, steps: int) -> None:
    ref = reference_run(tp_mlp_model(), steps, 4, MBS, max_grad_norm=CLIP)
    assert max(ref.grad_norms) > CLIP   # clipping bites
    ref_state = {i: {k: v.detach().numpy() for k, v in m.state_dict().items()}
                 for i, m in enumerate(ref.layers)}
    seen = set()
    for rank, result in enumerate(runs):
        losses, state = result[name]
        np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name}: rank {rank}'s losses")
        for layer, params in state.items():
            seen.add(layer)
            for pname, value in params.items():
                np.testing.assert_allclose(value, ref_state[layer][pname], rtol=RTOL,
                                           atol=ATOL, err_msg=f"{name}: layer {layer} {pname}")
    assert seen == set(range(6))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(plans()))
def test_tensor_parallel_units_train_like_single_process(kind, runs):
    _check(kind, runs, STEPS)


@pytest.mark.timeout(120)
def test_shards_move_between_live_units_and_a_checkpoint_reshards_to_single_cards(runs):
    _check("chain", runs, 8)


def test_dense_ranks_of_units_are_consecutive_cards():
    ranks = dense_rank_map(plans()["rerouted"], TP)
    assert ranks.device_of_rank == (0, 0, 1, 1, 2, 2, 3, 3)
    assert ranks.unit(1) == (2, 3) and ranks.ranks([2, 0], 1) == (1, 5)
    assert ranks.every_tp_rank((0, 2)) == [(0, 4), (1, 5)]
