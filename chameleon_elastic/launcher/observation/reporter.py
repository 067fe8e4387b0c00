"""One ``recovered`` event and one plain line per recovery, once its workers have resumed.

A recovery is reported when every local worker it waits for has committed its first step in
the new generation and said how it resumed (``Resumed`` on the node's channel): the figures
(layers moved, the step training resumed at, seconds from the failure) are then facts, not
intentions. The failure is timed from its earliest sign: a survivor noticing it, or a hung
worker's last progress.

The phases (:data:`RECOVERY_PHASES`) follow one another from that sign to the first new step
committed, so they sum to ``total_s``: the agent's three on its own clock (the failure seen,
the decision in hand, the generation published on the node), then the path of the worker that
resumed last (the one its peers waited for), on the same node's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chameleon_elastic import channel
from chameleon_elastic.channel import Resumed

from ..coordination.messages import Decision
from ..failures import FailureEvent, RestartBudget, Trigger, WorkerFailure
from ..observe import Event, StatusLine, name_devices, recovery_line
from ..session import PlanChange
from .shares import follows_plan, share_change

__all__ = ["RECOVERY_PHASES", "Pending", "RecoveryReporter", "describe", "recovered_fields",
           "relaunch_line"]

#: the ``recovered`` event's phases, in their order (each is a ``<phase>_s`` field):
#: detect      the failure's first sign -> the agent sees it
#: decide      -> the next plan in hand: a round, the report, the planner, the etcd fence
#: publish     -> the generation written on the node's channel (a relaunch: workers stopped)
#: notify      -> the last worker to resume learned of it (a started process: it started)
#: regroup     -> it joined the generation's world (a started process: its start-up)
#: agree       -> the resume step agreed (an all-gather; a roll forward)
#: transfer    -> layers and optimizer state moved from peers (or a checkpoint read)
#: rebuild     -> the plan's bucket groups, executor and orders built
#: first_step  -> the first new step committed
RECOVERY_PHASES = ("detect", "decide", "publish", "notify", "regroup", "agree", "transfer",
                   "rebuild", "first_step")


@dataclass(frozen=True)
class Pending:
    """A recovery whose workers have not yet committed their first step."""

    event: FailureEvent
    decision: Decision
    change: PlanChange | None
    kept: tuple[int, ...]
    started: tuple[int, ...]
    waiting: frozenset[int]      # local devices whose Resumed record is awaited
    decided_at: float            # Unix seconds: the decision in hand
    published_at: float          # the generation on the node's channel
    parts: dict[str, float]      # parts of the phases: rendezvous_s, plan_s, stop_s, launch_s
    #: the recovery this one replaced before any worker committed a step in it (a second
    #: failure meanwhile, a generation given up): reported with this one, from its fault
    before: Pending | None = None
    #: the status line's state once reported (``running, device 5 standby``)
    running: str = "running"
    #: the spare devices that stood outside the training world as it began (standbys)
    standbys: frozenset[int] = frozenset()

    def chain(self) -> list[Pending]:
        """Every recovery reported by this one, the first first."""
        links = [self] if self.before is None else [*self.before.chain(), self]
        return links


def describe(p: Pending, tp: int) -> str:
    """``device 3 lost (SIGKILL)``, ``devices 2, 3 lost (node gone)``, ``device 1 back``: how
    each device was lost is what its own node reported (the decisions carry it), over every
    recovery this one reports (a device lost while the survivors recovered from another). A
    device that held no role in the plan is named for what it was: ``standby device 5`` (it
    waited outside the training world), ``spare device 3`` (an idle member of it)."""
    event = p.event
    lost: set[int] = set()
    joined: set[int] = set()
    idle: set[int] = set()
    outside: set[int] = set()
    why: dict[int, str] = {}
    for link in p.chain():
        came = set(link.change.joined) if link.change else set(link.event.joined)
        went = set(link.change.lost) if link.change else set(link.event.lost)
        lost, joined = (lost - came) | went, (joined - went) | came
        idle |= set(link.change.idle_lost) if link.change else set()
        outside |= link.standbys
        why.update(dict(link.decision.why))
    parts = []
    for group, prefix in ((sorted(lost - idle), ""), (sorted(lost & idle - outside), "spare "),
                          (sorted(lost & idle & outside), "standby ")):
        if group:
            said = sorted({why.get(d, "node gone") for d in group})
            parts.append(f"{prefix}{name_devices(group, tp)} lost ({', '.join(said)})")
    if joined:
        parts.append(f"{name_devices(sorted(joined), tp)} back")
    if p.change is not None and p.change.slow is not None:
        slow, was = p.change.slow, p.change.was_slow
        said = dict(event.notes)   # this node's watch found it: its figures
        parts.extend(f"{name_devices([d], tp)} slow ({said.get(d, f'{f:.2f}x')})"
                     for d, f in sorted(slow.items()))
        back = sorted(set(was) - set(slow))
        if back:
            parts.append(f"{name_devices(back, tp)} back to speed")
    if not parts and event.failures:
        card = "device" if tp == 1 else "card"
        parts.append("; ".join(f"{card} {f.device}: {f.reason}" for f in event.failures))
    if not parts and event.trigger is Trigger.NODE_LOST:   # a member with no device left
        parts.append("a node with no device left lost (its lease expired)")
    return " and ".join(parts) or f"{event.reason}: no device changed"


def relaunch_line(failures: tuple[WorkerFailure, ...], budget: RestartBudget) -> str:
    """Without a job, torchrun's restart named as torchrun names it: which rank died, its pid,
    the signal or exit code (a worker the agent stopped itself is not news), and the restart
    it costs: ``rank 1 (local rank 1, pid 5590) was killed by SIGKILL; every worker restarts
    (restart 1 of 3)``."""
    said = "; ".join(f.said for f in failures if not f.stopped_on_request) or "; ".join(
        f.said for f in failures)
    return (f"{said}; every worker restarts (restart {budget.used} of "
            f"{budget.max_restarts})")


def recovered_fields(p: Pending, records: dict[int, Resumed], restarts_used: int) -> dict:
    """The ``recovered`` event's fields (docs/launcher.md lists them)."""
    first = p.chain()[0]
    failed_at = min([first.event.wall, *(r.noticed_at for r in records.values() if r.noticed_at),
                     *(f.since for link in p.chain() for f in link.event.failures if f.since)])
    worst = max(records.values(), key=lambda r: r.regroup_s + r.transfer_s, default=None)
    return dict(
        reason=p.event.reason, mode="inplace" if p.decision.inplace else "relaunch",
        kept_devices=list(p.kept), started_devices=list(p.started),
        resumed_step=worst.resumed_step if worst else None,
        transfer_bytes=sum(r.moved_bytes for r in records.values()),
        moved_layers=worst.moved_layers if worst else 0,
        source=worst.source if worst else None,
        rolled_forward=sorted(d for d, r in records.items() if r.rolled_forward),
        redone_steps=worst.redone_steps if worst else 0, generations=len(p.chain()),
        restarts_used=restarts_used, **({"quiet": True} if p.decision.quiet else {}),
        **p.parts, **phase_times(p, records, failed_at))


def phase_times(p: Pending, records: dict[int, Resumed],
                failed_at: float) -> dict[str, float | None]:
    """``<phase>_s`` for each of :data:`RECOVERY_PHASES`, and ``total_s``; the workers' are
    None when none of them committed a step."""
    out: dict[str, float | None] = dict.fromkeys(
        [f"{name}_s" for name in RECOVERY_PHASES] + ["total_s"])
    out.update(detect_s=max(0.0, p.event.wall - failed_at),
               decide_s=p.decided_at - p.event.wall, publish_s=p.published_at - p.decided_at)
    last = max((r for r in records.values() if r.committed_at), default=None,
               key=lambda r: r.committed_at - r.first_step_s)
    if last is None:
        return out
    # a process started for the generation may start before the generation is published on
    # the channel (a rejoining device's worker is launched first): the start-up that overlaps
    # the publication is counted once, in publish, so the phases still follow one another
    early = 0.0 if last.woke_at is None else max(0.0, p.published_at - last.woke_at)
    out.update(notify_s=None if last.woke_at is None else max(0.0, last.woke_at - p.published_at),
               regroup_s=max(0.0, last.regroup_s - early), agree_s=last.agree_s,
               transfer_s=last.transfer_s,
               rebuild_s=last.rebuild_s, first_step_s=last.first_step_s,
               total_s=last.committed_at - failed_at)
    return out


def _held_nothing(p: Pending) -> bool:
    """Every device this recovery lost held no role in the plan (spares, standbys), none came
    back or changed speed, and the layout is the one before: nothing was rerouted or
    re-planned, whatever the planner's policy is called."""
    changes = [link.change for link in p.chain()]
    return all(c is not None and c.lost and set(c.lost) <= set(c.idle_lost) and not c.joined
               and c.slow is None and c.kept_layout for c in changes)


class RecoveryReporter:
    def __init__(self, emit: Callable[..., None], status: StatusLine, profiler: Any,
                 logs_dir: str | None, tp: int, store: Any = None, session: Any = None) -> None:
        self.pending: Pending | None = None
        self._emit = emit
        self._status = status
        self._profiler = profiler
        self._logs_dir = logs_dir
        self._tp = tp
        self._store = store          # the node's channel: who follows the plan (shares.py)
        #: the plan the scripts started under, until a change of share has been said once
        self._first = None if session is None else session.plan
        self._micro_batch_size = 1 if session is None else session.spec.training.micro_batch_size

    def poll(self, store: Any, plan: Any, pids: dict[int, int], restarts_used: int) -> str | None:
        """Report the pending recovery if every awaited worker has resumed; returns the status
        line's new state then, else None."""
        p = self.pending
        if p is None:
            return None
        records = {}
        for device in p.waiting:
            if device not in pids:
                continue  # died meanwhile: the next recovery reports
            value = channel.read(store, channel.resumed_key(plan.generation, device))
            if value is None or Resumed.from_dict(value).pid != pids[device]:
                return None
            records[device] = Resumed.from_dict(value)
        return self.finish(records, plan, restarts_used)

    def restate(self, running: str) -> None:
        """The node's workers now run as ``running`` says: the recovery awaited says so."""
        if self.pending is not None:
            self.pending = replace(self.pending, running=running)

    def finish(self, records: dict[int, Resumed], plan: Any, restarts_used: int,
               pending: Pending | None = None) -> str:
        """Report ``pending`` (default: the recovery awaited, which it ends) from what its
        workers said (``records``); returns the status line's new state."""
        p = pending or self.pending
        assert p is not None
        if pending is None:
            self.pending = None
        fields = recovered_fields(p, records, restarts_used)
        self._emit(Event.RECOVERED, **fields)
        if self._profiler is not None and p.decision.inplace and fields["regroup_s"] is not None:
            # the fixed cost of an in-place transition, besides its transfers (the planner's)
            self._profiler.note_regroup(fields["regroup_s"] + fields["agree_s"]
                                        + fields["rebuild_s"])
        line = recovery_line(describe(p, self._tp), plan, inplace=p.decision.inplace,
                             started=len(p.started), moved_layers=fields["moved_layers"],
                             moved_bytes=fields["transfer_bytes"], source=fields["source"] or "",
                             resumed_step=fields["resumed_step"], redone=fields["redone_steps"],
                             seconds=fields["total_s"], logs=self._logs_dir, tp=self._tp,
                             same_layout=p.change is None or p.change.same_layout,
                             idle=_held_nothing(p), quiet=p.decision.quiet,
                             reported=p.decision.reported)
        self._status.say(f"chameleon-run: {line}")
        notice = self._share_notice(p, plan)
        if notice is not None:
            self._status.say(f"chameleon-run: {notice}")
            self._emit(Event.SHARE_CHANGED, message=notice)
        total = fields["total_s"]
        return (p.running if total is None
                else f"{p.running} (recovered {fields['mode']} in {total:.2f} s)")

    def _share_notice(self, p: Pending, plan: Any) -> str | None:
        """The one line (once per run) for relaunched scripts that do not follow the plan,
        when this plan changes their share of the batch (shares.py)."""
        if self._first is None or p.decision.inplace or self._store is None:
            return None
        notice = share_change(self._first, plan, self._micro_batch_size)
        cards = set(p.started) | {f.device for f in p.event.failures}
        if notice is None or follows_plan(self._store, cards):
            return None
        self._first = None
        return notice
