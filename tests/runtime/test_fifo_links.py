"""Every plan runs where point-to-point messages match first-in first-out (NCCL, HCCL).

The executor reads each link in its send order (runtime/execution/inbox.py). On CPU the FIFO path is
forced (``CHAMELEON_FIFO_P2P=1``: gloo then gets no tags, so it matches in order as NCCL does):
a rerouted asymmetric plan whose receivers consume a link out of send order trains like one
process. A property test replays the planner's plans, with failures drawn at random, on a model
of FIFO links that reads them as the executor does: every receive gets the message it names,
and no device waits forever.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.models.toy import mlp_model, reference_run
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.planning.schedule import device_orders, fifo_violations, link_messages
from chameleon_elastic.planning.search import PlanningError, decide, initial_plan
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.execution.layout import FIFO_ENV
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world
from chameleon_elastic.spec import JobSpec

STEPS, MBS = 3, 2


def _out_of_order_plan() -> ExecutionPlan:
    """Pipelines of 3 and 4 stages sharing their first two stages' layers; both of the short
    one's first stages died and their micro-batches run on the long one's: the link 3 -> 4
    carries both pipelines' activations, and device 4 consumes them in another order."""
    short = Pipeline((0, 1, 2), ((0, 1), (1, 2), (2, 4)), 3)
    long = Pipeline((3, 4, 5, 6), ((0, 1), (1, 2), (2, 3), (3, 4)), 3)
    return ExecutionPlan("reroute", 1, (short, long), failed_devices=(0, 1), reroute=(
        Reroute(0, 0, 0, (PeerShare(3, 3),)), Reroute(1, 0, 1, (PeerShare(4, 3),)))).validate()


def _losses(rank: int, world: int, plan_json: str) -> list[float]:
    os.environ[FIFO_ENV] = "1"
    plan = ExecutionPlan.from_json(plan_json)
    trainer = PipelineTrainer(mlp_model(4), plan, dense_rank_map(plan).device_of_rank[rank],
                              micro_batch_size=MBS)
    losses = [trainer.step(t).loss for t in range(STEPS)]
    trainer.close()
    return losses


@pytest.mark.timeout(90)
def test_a_plan_whose_links_are_consumed_out_of_order_trains_like_one_process_on_fifo_links():
    plan = _out_of_order_plan()
    assert fifo_violations(device_orders(plan))  # the plan the trainer used to refuse
    ref = reference_run(mlp_model(4), STEPS, plan.global_micro_batches, MBS)
    losses = run_local_world(_losses, len(plan.working_devices), plan.to_json(), timeout_s=80)
    for got in losses:
        np.testing.assert_allclose(got, ref.losses, rtol=1e-9)


# --------------------------------------------------------------------------- FIFO links, modelled


def _replay(plan: ExecutionPlan) -> int:
    """Run the plan's orders on FIFO links, each device reading a link in send order and
    keeping what it does not need yet (as the executor's inbox does). Fails on a device that
    gets another message than it names or waits forever; returns the messages kept early."""
    orders = {d: list(ops) for d, ops in device_orders(plan).items()}
    sends = link_messages(orders)  # what the inbox reads each link by
    wire: dict[tuple[int, int], list[tuple]] = {link: [] for link in sends}
    read = {link: 0 for link in sends}
    early: dict[int, set[tuple]] = {d: set() for d in orders}
    at = {d: 0 for d in orders}
    kept = 0
    while any(at[d] < len(orders[d]) for d in orders):
        progressed = False
        for d, order in orders.items():
            while at[d] < len(order):
                op = order[at[d]]
                if op.source is not None:
                    wanted = (("F", op.pipeline, op.micro_batch, op.stage - 1) if op.kind == "F"
                              else ("B", op.pipeline, op.micro_batch, op.stage + 1))
                    link = (op.source, d)
                    while wanted not in early[d] and read[link] < len(wire[link]):
                        message = wire[link][read[link]]
                        read[link] += 1
                        expected = sends[link][read[link] - 1].key
                        assert message == expected, "the link's order is not its send order"
                        early[d].add(message)
                        kept += message != wanted
                    if wanted not in early[d]:
                        break  # blocked until the peer sends
                    early[d].remove(wanted)
                if op.dest is not None:
                    wire[(d, op.dest)].append(op.key)
                at[d] += 1
                progressed = True
        assert progressed, f"FIFO links deadlock: devices wait at {at}"
    assert all(not e for e in early.values()) and all(read[k] == len(v) for k, v in wire.items())
    return kept


def test_the_fifo_model_keeps_messages_early_where_the_order_is_broken():
    assert _replay(_out_of_order_plan()) > 0


def _spec(dp: int, pp: int, layers: int, costs: list[float], batches: int) -> JobSpec:
    return JobSpec.from_dict({
        "model": {"layers": layers, "forward_s": costs, "backward_s": [2 * c for c in costs],
                  "param_bytes": 1e6, "optimizer_bytes": 0.0, "activation_bytes": 1e3},
        "cluster": {"devices": dp * pp, "device_memory_bytes": 1e12,
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 1.0,
                    "failure_rate_per_hour": 0.1},
        "training": {"dp": dp, "pp": pp, "global_micro_batches": batches},
    })


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.integers(2, 4), st.integers(0, 6), st.integers(0, 10),
       st.integers(0, 2**31), st.lists(st.sampled_from(["auto", "replan", "reroute"]),
                                       min_size=1, max_size=3))
def test_every_plan_the_planner_chooses_runs_on_fifo_links(dp, pp, extra_layers, extra_batches,
                                                           seed, policies):
    rng = random.Random(seed)
    layers = pp + extra_layers
    spec = _spec(dp, pp, layers, [rng.choice([1.0, 2.0, 3.0]) for _ in range(layers)],
                 dp + extra_batches)
    plan = initial_plan(spec)
    _replay(plan)
    for policy in policies:
        live = list(plan.live_devices)
        if len(live) < 2:
            break
        failed = rng.sample(live, rng.randint(1, min(3, len(live) - 1)))
        try:
            plan = decide(spec, plan, failed, policy=policy).chosen
        except PlanningError:
            break
        _replay(plan)
