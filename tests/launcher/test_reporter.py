"""The recovery line and event of a recovery that took more than one plan generation."""

from __future__ import annotations

from dataclasses import replace

from chameleon_elastic.channel import Resumed
from chameleon_elastic.launcher.coordination.messages import Decision
from chameleon_elastic.launcher.failures import FailureEvent, Trigger
from chameleon_elastic.launcher.observation.reporter import (
    Pending,
    _held_nothing,
    describe,
    recovered_fields,
)


def _pending(trigger: Trigger, lost: set[int], why: dict[int, str], wall: float,
             before: Pending | None = None) -> Pending:
    return Pending(FailureEvent(trigger, 0, lost=frozenset(lost), wall=wall),
                   Decision(None, (), (), True, why=tuple(why.items())), None, kept=(1, 2),
                   started=(), waiting=frozenset({1, 2}), decided_at=wall + 0.1,
                   published_at=wall + 0.2, parts={}, before=before)


def test_a_recovery_that_took_three_generations_names_every_device_lost_from_the_first_fault():
    """Device 3 killed; device 0 froze while the survivors entered the plan, their generation
    was given up (no device changed), then device 0 was convicted: one line, both devices,
    timed from the kill."""
    first = _pending(Trigger.DEVICE_LOST, {3}, {3: "SIGKILL"}, wall=100.0)
    given_up = _pending(Trigger.PEER_LOST, set(), {}, wall=120.0, before=first)
    last = _pending(Trigger.DEVICE_LOST, {0}, {0: "hung: no progress for 5.0 s"}, wall=125.0,
                    before=given_up)
    assert describe(last, tp=1) == ("devices 0, 3 lost (SIGKILL, hung: no progress for "
                                    "5.0 s)")
    resumed = Resumed(device=1, pid=11, generation=3, resumed_step=8, source="peers",
                      regroup_s=0.02, transfer_s=0.1, first_step_s=0.4, moved_layers=4,
                      moved_bytes=1e6, rolled_forward=False, redone_steps=0, noticed_at=None,
                      woke_at=125.3, agree_s=0.01, rebuild_s=0.02, committed_at=126.0)
    fields = recovered_fields(last, {1: resumed}, restarts_used=0)
    assert fields["generations"] == 3
    assert fields["total_s"] == 126.0 - 100.0   # from the first fault, not the last event


def test_a_device_back_in_a_later_generation_is_not_called_lost():
    first = _pending(Trigger.DEVICE_LOST, {2}, {2: "health check"}, wall=10.0)
    back = Pending(FailureEvent(Trigger.REJOINED, 1, joined=frozenset({2}), wall=12.0),
                   Decision(None, (), (), True), None, kept=(0, 1), started=(2,),
                   waiting=frozenset(), decided_at=12.1, published_at=12.2, parts={},
                   before=first)
    assert describe(back, tp=1) == "device 2 back"


def test_a_straggler_decision_says_the_figures_it_was_taken_on():
    """The node whose watch found the slowdown says why it was worth a switch; another node,
    which only adopted the decision, says the factor."""
    from chameleon_elastic.launcher.session import PlanChange
    from chameleon_elastic.planning import initial_plan
    from chameleon_elastic.spec import JobSpec

    plan = initial_plan(JobSpec.preset("tiny-cpu"))
    change = PlanChange(plan, (), (), False, 0.0, slow={3: 0.5})
    why = "0.50x for 7 steps, 0.7 s lost; a switch ~0.3 s"
    here = Pending(FailureEvent(Trigger.STRAGGLER, 0, wall=1.0, notes=((3, why),)),
                   Decision(None, (), (), True), change, kept=(0, 1, 2, 3), started=(),
                   waiting=frozenset(), decided_at=1.1, published_at=1.2, parts={})
    assert describe(here, tp=1) == f"device 3 slow ({why})"
    elsewhere = Pending(FailureEvent(Trigger.STRAGGLER, 0, wall=1.0), here.decision, change,
                        kept=(), started=(), waiting=frozenset(), decided_at=1.1,
                        published_at=1.2, parts={})
    assert describe(elsewhere, tp=1) == "device 3 slow (0.50x)"


def test_a_spare_or_standby_lost_is_named_and_no_line_lists_no_device():
    """Devices that held no role in the plan: a spare inside the training world (it votes in
    every step, so the world is formed again) and a standby outside it (no worker is told).
    Neither line may say ``rerouted to data-parallel peers: device ;`` (the planner calls a
    plan that reroutes nothing a reroute)."""
    from chameleon_elastic.launcher.observe import recovery_line
    from chameleon_elastic.launcher.session import PlanChange
    from chameleon_elastic.plan import ExecutionPlan, Pipeline

    plan = ExecutionPlan("reroute", 2, (Pipeline((0, 1), ((0, 4), (4, 8)), 4),
                                        Pipeline((2, 4), ((0, 4), (4, 8)), 4))).validate()
    spare = PlanChange(plan, lost=(3,), joined=(), cached=True, decide_s=0.0, idle_lost=(3,),
                       kept_layout=True)
    p = Pending(FailureEvent(Trigger.DEVICE_LOST, 1, lost=frozenset({3}), wall=1.0),
                Decision(plan, (3,), (0, 1, 2, 4), True, why=((3, "SIGKILL"),)), spare,
                kept=(2,), started=(), waiting=frozenset(), decided_at=1.1, published_at=1.2,
                parts={})
    assert describe(p, tp=1) == "spare device 3 lost (SIGKILL)"
    assert _held_nothing(p)   # the line's "layout kept", not the planner's "reroute"
    assert not _held_nothing(replace(p, change=replace(spare, kept_layout=False)))
    line = recovery_line(describe(p, 1), plan, inplace=True, started=0, moved_layers=0,
                         moved_bytes=0, source="none", resumed_step=20, redone=0, seconds=0.4,
                         idle=True)
    assert line == ("spare device 3 lost (SIGKILL) at step 20; spares hold no layers: the "
                    "layout kept (2 pipelines: devices 0, 1 | devices 2, 4), the training world "
                    "formed again without them (a spare votes in every step); resumed at step "
                    "20 in 0.40 s")
    standby = replace(spare, lost=(5,), idle_lost=(5,), quiet=True)
    q = Pending(FailureEvent(Trigger.PEER_RECOVERY, 1, wall=1.0),
                Decision(plan, (5,), (0, 1, 2, 4), True, reported=11, why=((5, "SIGKILL"),),
                         quiet=True), standby, kept=(0, 1), started=(), waiting=frozenset(),
                decided_at=1.1, published_at=1.2, parts={}, standbys=frozenset({5}))
    assert describe(q, tp=1) == "standby device 5 lost (SIGKILL)"
    assert recovery_line(describe(q, 1), plan, inplace=True, started=0, moved_layers=0,
                         moved_bytes=0, source="", resumed_step=None, redone=0, seconds=None,
                         quiet=True, reported=11) == (
        "standby device 5 lost (SIGKILL) after step 11; standbys hold no layers and no worker "
        "waits on them: training goes on undisturbed (2 pipelines: devices 0, 1 | devices 2, 4)")
    assert recovered_fields(q, {}, 0)["quiet"] is True


def test_the_loss_benchmark_reads_where_each_new_plan_took_over_from_the_recovery_line():
    """benchmarks/loss_equality.py says how many bf16 losses a re-plan moved and where each new
    plan took over (the figure depends on it: docs/runtime.md, Limits); it reads that from the
    launcher's line, so the two must agree."""
    import importlib.util
    import sys
    from pathlib import Path

    from chameleon_elastic.launcher.observe import recovery_line
    from chameleon_elastic.plan import ExecutionPlan, Pipeline

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))   # its own helpers (launched.py)
    try:
        spec = importlib.util.spec_from_file_location("loss_equality", bench / "loss_equality.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    plan = ExecutionPlan("replan", 1, (Pipeline((2, 1), ((0, 4), (4, 8)), 4),
                                       Pipeline((0,), ((0, 8),), 4))).validate()
    line = "chameleon-run: " + recovery_line(
        "device 3 lost (SIGKILL)", plan, inplace=True, started=0, moved_layers=4,
        moved_bytes=2e6, source="peers", resumed_step=11, redone=0, seconds=0.3)
    found = module.RESUMED.search(line)
    assert found and found.group(2) == "11" and found.group(1) == "lost"
    slow = line.replace("device 3 lost (SIGKILL)", "device 1 slow (0.29x)")
    assert module.RESUMED.search(slow).group(1) == "slow"
