"""The agent's transitions (launcher/reactions.py), in process: each row of the state table in
its docstring, from the facts a tick saw to the reaction, with no process launched."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from chameleon_elastic.launcher.failures import Trigger, WorkerFailure, classify_exit
from chameleon_elastic.launcher.reactions import Tick, react

HEALTHY, FAILED, UNHEALTHY = WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.UNHEALTHY
PLANNED = {"planned": True, "inplace_wanted": True, "runtime": True}


def _killed(card: int) -> WorkerFailure:
    return classify_exit(-9, card, card % 2)


def _crashed(card: int) -> WorkerFailure:
    return classify_exit(1, card, card % 2)


def test_nothing_new_keeps_monitoring():
    assert react(Tick(HEALTHY, **PLANNED)).action == "monitor"


def test_our_lost_lease_fences_before_anything_else():
    r = react(Tick(FAILED, failures=(_killed(1),), lease=Trigger.FENCED, **PLANNED))
    assert (r.action, r.trigger, r.inplace) == ("fence", Trigger.FENCED, True)


def test_a_lost_lease_after_the_script_ended_here_restarts_nothing():
    """Chaos: the lease lapsed (an etcd member restarted, load 12) just as the workers exited
    after the last step. Fenced, they started again for a job that had ended, waiting for
    peers that were gone. A worker that finished the script means the training is over here:
    the rest are stopped, and the node ends with the job."""
    r = react(Tick(FAILED, failures=(_killed(1),), lease=Trigger.FENCED, some_succeeded=True,
                   live=frozenset({0}), **PLANNED))
    assert (r.action, r.kill, r.trigger) == ("monitor", frozenset({0}), None)
    # the same when the other node's workers finished the script as the fence came
    r = react(Tick(FAILED, failures=(_killed(1),), lease=Trigger.FENCED, live=frozenset({0}),
                   finished_elsewhere=True, **PLANNED))
    assert (r.action, r.kill) == ("monitor", frozenset({0}))
    # a fence in the middle of the job: rejoin
    r = react(Tick(FAILED, failures=(_killed(1),), lease=Trigger.FENCED, live=frozenset({0}),
                   **PLANNED))
    assert r.action == "fence"


def test_a_workers_sentence_ends_the_job_with_the_status_it_calls_for():
    r = react(Tick(FAILED, failures=(_crashed(0),), ended="layers 4-7 were lost",
                   ended_status=93, **PLANNED))
    assert (r.action, r.reason, r.status) == ("end", "layers 4-7 were lost", 93)
    gave_up = react(Tick(FAILED, failures=(_crashed(0),), ended="3 generations failed",
                         **PLANNED))
    assert gave_up.status == 1


def test_a_lost_device_is_planned_around_in_place_without_a_restart():
    r = react(Tick(FAILED, failures=(_killed(3),), **PLANNED))
    assert (r.action, r.trigger, r.lost, r.inplace, r.charge) == (
        "recover", Trigger.DEVICE_LOST, {3}, True, False)
    assert r.kill == {3}


def test_a_lost_card_takes_its_whole_unit():
    r = react(Tick(FAILED, failures=(_killed(7),), tp=2, **PLANNED))
    assert r.lost == {3} and r.kill == {6, 7}


def test_a_loss_beside_a_crash_or_after_a_finished_worker_relaunches():
    crash = react(Tick(FAILED, failures=(_killed(3), _crashed(1)), **PLANNED))
    done = react(Tick(FAILED, failures=(_killed(3),), some_succeeded=True, **PLANNED))
    assert crash.action == done.action == "recover" and not crash.inplace and not done.inplace


def test_a_failed_health_check_is_a_lost_device():
    r = react(Tick(UNHEALTHY, bad=frozenset({2}), **PLANNED))
    assert (r.trigger, r.lost) == (Trigger.DEVICE_LOST, {2})


def test_a_hang_without_a_plan_is_a_crash_and_its_worker_is_killed():
    hung = dataclasses.replace(_killed(1), reason="hung: no progress for 3.1 s")
    r = react(Tick(UNHEALTHY, failures=(hung,), hung=frozenset({1}), restarts_left=1))
    assert (r.action, r.trigger, r.charge, r.kill) == ("recover", Trigger.CRASH, True, {1})


def test_a_crash_spends_a_restart_and_recovers_in_place_on_the_runtime():
    r = react(Tick(FAILED, failures=(_crashed(2),), restarts_left=2, **PLANNED))
    assert (r.action, r.trigger, r.charge, r.inplace) == ("recover", Trigger.CRASH, True, True)


def test_with_no_restart_left_the_leases_are_asked_first():
    tick = Tick(FAILED, failures=(_crashed(2),), restarts_left=0, **PLANNED)
    assert react(tick).action == "ask_leases"
    node_died = react(dataclasses.replace(tick, leases_asked=True, lease=Trigger.NODE_LOST))
    assert (node_died.action, node_died.trigger, node_died.charge) == (
        "recover", Trigger.NODE_LOST, False)
    alone = react(dataclasses.replace(tick, leases_asked=True))
    assert (alone.action, alone.reason) == ("fail", "max restarts used up")


@pytest.mark.parametrize("facts, trigger", [
    ({"lease": Trigger.NODE_LOST}, Trigger.NODE_LOST),
    ({"rejoining": frozenset({1})}, Trigger.REJOINED),
    ({"quick_called": True}, Trigger.PEER_RECOVERY),
    ({"store_lost": True}, Trigger.RENDEZVOUS_LOST),
    ({"waiting": 1}, Trigger.MEMBERSHIP),
    ({"trouble": True}, Trigger.PEER_LOST),
    # the first that applies wins, in the table's order
    ({"lease": Trigger.NODE_LOST, "waiting": 1, "trouble": True}, Trigger.NODE_LOST),
    ({"waiting": 1, "trouble": True}, Trigger.MEMBERSHIP),
])
def test_news_on_a_healthy_node_starts_a_round(facts, trigger):
    r = react(Tick(HEALTHY, **PLANNED, **facts))
    assert (r.action, r.trigger, r.inplace) == ("recover", trigger, True)
    relaunch = react(Tick(HEALTHY, **{**PLANNED, "runtime": False}, **facts))
    assert not relaunch.inplace


def test_a_device_back_is_named_in_the_reaction():
    assert react(Tick(HEALTHY, rejoining=frozenset({1}), **PLANNED)).joined == {1}


@pytest.mark.parametrize("tick, quick", [
    (Tick(FAILED, failures=(_killed(1),), **PLANNED), True),          # a worker lost
    (Tick(FAILED, failures=(_crashed(1),), restarts_left=1, **PLANNED), True),
    (Tick(HEALTHY, lease=Trigger.NODE_LOST, **PLANNED), True),       # membership shrinks
    (Tick(HEALTHY, trouble=True, **PLANNED), True),
    (Tick(HEALTHY, quick_called=True, **PLANNED), True),
    (Tick(HEALTHY, waiting=1, **PLANNED), False),                    # a node may join
    (Tick(HEALTHY, store_lost=True, **PLANNED), False),              # failover
    (Tick(FAILED, lease=Trigger.FENCED, **PLANNED), False),          # the others count us gone
])
def test_a_recovery_needs_a_rendezvous_round_only_when_a_node_may_join(tick, quick):
    r = react(tick)
    assert r.action in ("recover", "fence") and r.quick is quick


def test_a_straggler_is_planned_around_in_place_and_never_killed():
    r = react(Tick(HEALTHY, slow=((3, 0.5),), **PLANNED))
    assert (r.action, r.trigger, r.inplace, r.kill, r.lost) == (
        "recover", Trigger.STRAGGLER, True, frozenset(), frozenset())
    assert r.quick   # no node can join: no rendezvous round


def test_a_straggler_without_in_place_recovery_is_left_alone():
    for facts in (dict(PLANNED, runtime=False), dict(PLANNED, inplace_wanted=False)):
        assert react(Tick(HEALTHY, slow=((3, 0.5),), **facts)).action == "monitor"


def test_a_lost_device_comes_before_a_straggler():
    r = react(Tick(FAILED, failures=(_killed(1),), slow=((3, 0.5),), **PLANNED))
    assert (r.trigger, r.lost) == (Trigger.DEVICE_LOST, frozenset({1}))


def test_standbys_retire_when_the_job_ended_elsewhere_and_nothing_else_counts_then():
    """Their workers wait for a place that will never come: stopped without a recovery, so
    the next tick finds no worker left and the node succeeds."""
    r = react(Tick(HEALTHY, retire=frozenset({4, 5}), trouble=True, **PLANNED))
    assert (r.action, r.kill, r.trigger) == ("monitor", {4, 5}, None)
