"""The recovery line and event of a recovery that took more than one plan generation."""

from __future__ import annotations

from chameleon_elastic.channel import Resumed
from chameleon_elastic.launcher.coordination.messages import Decision
from chameleon_elastic.launcher.failures import FailureEvent, Trigger
from chameleon_elastic.launcher.observation.reporter import Pending, describe, recovered_fields


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
