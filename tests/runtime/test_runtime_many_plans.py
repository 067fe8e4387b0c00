"""No deadlock and the right loss under many generated plans, in one live world.

Six gloo processes stay up while they train under 14 generated plans in turn: asymmetric
layouts (random pipeline lengths, layer splits and quotas), rerouted symmetric layouts with one
to three dead devices (several in one stage too), and rerouted asymmetric layouts. Each plan
builds and tears down its own process groups in the same processes (what in-place recovery
needs) and trains 2 steps; every plan must finish before the collective timeout and give the
single-process loss (float64, rtol 1e-9). Odd plans use the serial per-layer gradient sync,
even ones the colour rounds, so both paths are checked against the same reference.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from chameleon_elastic.models.toy import mlp_model, reference_training
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

WORKERS = 6
LAYERS = 7
STEPS = 2


def _split(rng: random.Random, stages: int) -> tuple[tuple[int, int], ...]:
    cuts = sorted(rng.sample(range(1, LAYERS), stages - 1))
    bounds = [0, *cuts, LAYERS]
    return tuple(itertools.pairwise(bounds))


def _reroute(pipelines, dead: list[int]) -> tuple[Reroute, ...]:
    out = []
    for d in dead:
        pi = next(i for i, p in enumerate(pipelines) if d in p.devices)
        si = pipelines[pi].devices.index(d)
        own = pipelines[pi].layers[si]
        peers = [p.devices[s] for p in pipelines for s in range(p.num_stages)
                 if p.layers[s] == own and p.devices[s] not in dead]
        quota, n = pipelines[pi].micro_batches, len(peers)
        shares = tuple(PeerShare(peer, (quota - j + n - 1) // n) for j, peer in enumerate(peers))
        out.append(Reroute(d, pi, si, shares))
    return tuple(out)


def asymmetric(rng: random.Random) -> ExecutionPlan:
    lengths: list[int] = []
    while sum(lengths) < WORKERS:
        lengths.append(rng.randint(1, min(4, WORKERS - sum(lengths))))
    devices = iter(rng.sample(range(10), WORKERS))
    pipes = tuple(Pipeline(tuple(next(devices) for _ in range(n)), _split(rng, n),
                           rng.randint(1, 4)) for n in lengths)
    return ExecutionPlan("replan", 1, pipes).validate()


def rerouted_symmetric(rng: random.Random) -> ExecutionPlan:
    dp, pp, dead_count = rng.choice([(4, 2, 2), (3, 3, 3), (7, 1, 1), (2, 4, 2), (8, 1, 2)])
    layers = _split(rng, pp)
    quota = rng.randint(1, 4)
    pipes = tuple(Pipeline(tuple(p * pp + s for s in range(pp)), layers, quota)
                  for p in range(dp))
    while True:  # every stage keeps a live replica
        dead = rng.sample(range(dp * pp), dead_count)
        if all(sum(p * pp + s not in dead for p in range(dp)) for s in range(pp)):
            break
    return ExecutionPlan("reroute", 1, pipes, failed_devices=tuple(sorted(dead)),
                         reroute=_reroute(pipes, sorted(dead))).validate()


def rerouted_asymmetric(rng: random.Random) -> ExecutionPlan:
    # pipelines (0,1) and (2,3) share a split; (4,5,6) differs; one of the first four dies
    split2 = _split(rng, 2)
    pipes = (Pipeline((0, 1), split2, rng.randint(1, 4)),
             Pipeline((2, 3), split2, rng.randint(1, 4)),
             Pipeline((4, 5, 6), _split(rng, 3), rng.randint(1, 4)))
    dead = [rng.choice([0, 1, 2, 3])]
    return ExecutionPlan("reroute", 1, pipes, failed_devices=tuple(dead),
                         reroute=_reroute(pipes, dead)).validate()


def generated_plans() -> list[ExecutionPlan]:
    rng = random.Random(20260522)
    plans = []
    for i in range(14):
        make = (asymmetric, rerouted_symmetric, rerouted_asymmetric)[i % 3]
        plan = make(rng)
        assert len(plan.working_devices) == WORKERS
        plans.append(plan)
    return plans


def _train_all(rank: int, world: int, plan_jsons: list[str]):
    out = []
    for i, text in enumerate(plan_jsons):
        plan = ExecutionPlan.from_json(text)
        device = dense_rank_map(plan).device_of_rank[rank]
        trainer = PipelineTrainer(mlp_model(), plan, device,
                                  sync_mode="serial" if i % 2 else "rounds")
        out.append([trainer.step(t).loss for t in range(STEPS)])
        trainer.close()
    return out


@pytest.mark.timeout(120)
def test_generated_plans_finish_with_reference_loss():
    plans = generated_plans()
    kinds = {p.policy for p in plans}
    assert kinds == {"replan", "reroute"}
    results = run_local_world(_train_all, WORKERS, [p.to_json() for p in plans],
                              timeout_s=110, collective_timeout_s=30)
    for i, plan in enumerate(plans):
        ref, _ = reference_training(mlp_model(), STEPS, plan.global_micro_batches)
        for rank_losses in results:
            np.testing.assert_allclose(rank_losses[i], ref, rtol=1e-9, atol=1e-12,
                                       err_msg=f"plan {i}: {plan.to_json(indent=None)}")
