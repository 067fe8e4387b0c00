"""How the agents agree on the next plan: report, decide and publish, adopt.

Protocol, once per round: a rendezvous round, or a quick round (below). Keys live in the round's
store under a scope that no other round shares (dynamic rendezvous stores are fresh per round; a
quick round adds its epoch, ``q<epoch>/``), so an agent can never read a decision of an earlier
round. They are not scoped by plan generation because an agent that joins late still holds
generation 0: the round is the one id all agents share.

1. report  - every agent writes one :class:`NodeReport` under ``node/<group rank>``: its node id,
             the local devices it lost, the ones with a live worker, whether all those workers
             run on the runtime (so they can recover in place), and what its workers said about
             the last reported step and the last checkpoint.
2. decide  - the lowest member (group rank 0 of a full round) reads every report (``collect``),
             works out the planner's inputs (``losses``: the devices lost or back; the slow
             ones; whether the workers regroup in place), takes the step
             (:meth:`JobSession.step`), and publishes one :class:`Agreement` under
             ``decision``: the inputs, the session digests before and after, and what is not
             the plan (the world in rank order, in place or relaunch, or an error sentence when
             nothing can run).
3. adopt   - every other agent replays the step from the same digest (the planner is
             deterministic; the plan cache makes it a lookup) and checks the digest it reaches.
             Only when it differs (a late joiner, a node back from a partition, another
             planner build) does it fetch the whole decision, from the deciding agent
             (:class:`PlanDesk`: the generation's worker store, which that agent hosts).

**Agree on inputs, not on the plan.** The plan grows with the devices (0.6 MB of JSON at 8192,
86 kB compressed); sent to every agent through etcd it made a recovery at 1024 nodes cost 89 MB
of etcd's output (613 MB uncompressed), and the agents' CPU went to fetching and parsing it. An
agreement is a few hundred bytes whatever the job's size (lists of devices as runs), so etcd's
traffic per recovery is the nodes times a report's size. What stays in etcd, and why:

- the reports and the agreement, per round (small);
- the **record** (below), the whole last decision, compressed: the one copy of the plan that
  outlives every agent. A replacement decider, a node back from a partition and every full
  round's decider start from it. One agent reads it per round (the decider) and writes it once.

Fencing. The decision also goes to one key that outlives rounds, ``chameleon/plan`` in the
store under the rounds (etcd for ``etcd-v3``, the rendezvous host's store for c10d), written
with a compare-and-set against the value the deciding agent read when the round began
(:func:`commit_record`). The decider reads it first and catches up when it is newer than its
own plan (a late joiner, a node back from a partition), so decisions are always made from the
newest plan; an agent whose view is stale can never publish over a newer one: its
compare-and-set fails and it stops (:class:`Fenced`). The others never read it: they replay
or fetch what the decider published.

Quick rounds. A recovery that adds no node (a worker lost, a node lost) needs no new
rendezvous round: the members are those of the last agreement (``Decision.nodes``) less the
nodes known gone, and the round is the last one's store under a fresh scope (``rounds.py``).
Reports are then keyed by node id, the lowest live one decides, and waiting is checked against
the others' etcd leases (``alive``): the decider polls for the reports (one store read for
all), the others wait on the agreement's key (a watch on etcd, whose event carries it:
:func:`publish`) in slices. A member whose lease vanishes mid-round is dropped; when it is the decider,
the lowest member still holding its lease decides in its place (it reads the record then, so
its decision is made from whatever the lost decider committed, and is fenced against it). The
decision is written only where none is yet, so a frozen decider that wakes after being
replaced cannot overwrite its replacement's. A round that cannot finish raises
:class:`QuickRoundFailed`, after which the agent runs a full rendezvous round instead.

Reads block up to the store timeout, so an agent that dies mid-round makes the others fail with
a store error (the caller's failover), never hang. Everything but the store calls is a pure
function of its arguments, tested on a ``HashStore``.

etcd in trouble. A leader change, a member restarting or an overloaded cluster during a round
is waited out, never an agent's end: on etcd (a store with ``retrying_until``) every request
of the round retries etcd's transient failures until the round's own deadline (``timeout_s``
from its start), not for the client's ``retry_timeout``, and a round that etcd could not serve
by then fails as a round (:class:`QuickRoundFailed`: the agent runs a full rendezvous round),
never as the agent (tests/rendezvous/test_rdzv_leader_change.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from ..session import JobSession, LauncherPlanningError, NoPlanError, PlanChange
from .decide import decide, inplace_possible, losses, quiet_loss, reasons, speeds_of
from .messages import (
    OPENED,
    Agreement,
    Decision,
    Fenced,
    Members,
    NodeReport,
    PlanDesk,
    PlanUnreachable,
    QuickRoundFailed,
)

__all__ = ["QUICK_S", "RECORD", "adopt", "agree", "collect", "commit_record", "publish",
           "read_agreement", "read_record", "report"]

RECORD = "chameleon/plan"
_POLL_S = 0.01   # the decider's polls for reports: one etcd read per group of reports
_CHECK_KEYS = 128   # reports checked per store read: etcd's transaction limit (store.py)
_WAIT_S = 1.0    # the others wait for the decision in slices up to this long (see _slice_s)
#: a live member that has not joined a quick round by then is in a full round (a node joined)
QUICK_S = 15.0


def report(store: Any, scope: str, group_rank: int, mine: NodeReport,
           opens: bool = False) -> None:
    """``opens``: a quick round's report also opens the round for the agents that have not
    seen its cause (``messages.OPENED``), in the same write: a separate put of that key by
    every agent was a fifth of a quick round's etcd requests, and most of its writes
    (benchmarks/coordination_scale.py)."""
    key, value = f"{scope}node/{group_rank}", json.dumps(asdict(mine))
    if opens:
        store.multi_set([key, scope + OPENED], [value, str(mine.node)])
    else:
        store.set(key, value)


def collect(store: Any, scope: str, keys: Sequence[int]) -> list[NodeReport]:
    return [NodeReport.from_dict(json.loads(v)) for v in
            store.multi_get([f"{scope}node/{k}" for k in keys])]


def _still_in(members: Members) -> Collection[int]:
    """The members alive now (as the liveness watch holds them: no copy, it is checked
    between wait slices by every follower); this node's lease lost meanwhile (the others count
    it gone) ends its quick round."""
    assert members.alive is not None
    alive = members.alive()
    if members.me not in alive:
        raise QuickRoundFailed("this node's lease was lost: the others count it gone")
    return alive


def _live_reports(store: Any, scope: str, members: Members, timeout_s: float) -> list[int]:
    """The keys of a quick round's reports, once every member whose node is alive has
    reported (a member that lost its lease without reporting is left out). The reports are
    checked ``_CHECK_KEYS`` at a time, one store read each (an etcd transaction holds at most
    128), and a group whose reports are all in is not read again: polling every report made
    each poll 32 transactions at 4096 nodes, every 10 ms, until the last report came."""
    deadline = time.monotonic() + timeout_s
    keys = members.keys
    pending = [list(keys[i:i + _CHECK_KEYS]) for i in range(0, len(keys), _CHECK_KEYS)]
    dropped: set[int] = set()
    alive_seen: object = None

    def reported(group: Sequence[int]) -> bool:
        return bool(store.check([f"{scope}node/{k}" for k in group]))

    while True:
        if members.alive is not None:
            alive = _still_in(members)
            if alive is not alive_seen:   # a lease went: drop who left without reporting
                alive_seen = alive
                dropped |= {k for group in pending for k in group
                            if k not in alive and not reported([k])}
                pending = [[k for k in group if k not in dropped] for group in pending]
        pending = [group for group in pending if group and not reported(group)]
        if not pending:
            return [k for k in keys if k not in dropped]
        if time.monotonic() > deadline:
            missing = [k for group in pending for k in group if not reported([k])]
            if not missing:   # the last report came in since the check above
                return [k for k in keys if k not in dropped]
            raise QuickRoundFailed(f"nodes {missing} did not report within {timeout_s:.0f} s")
        time.sleep(_POLL_S)


def _quick_decision(store: Any, scope: str, members: Members,
                    timeout_s: float) -> tuple[Agreement | None, Members]:
    """A quick round's decision, waited for (on etcd a watch, woken by the publication) in
    slices of ``_WAIT_S``, between which the decider's lease is checked. Every member but one
    waits here, so it must not poll the store: a thousand agents reading every 10 ms would make
    100k requests a second.

    A decider whose lease is gone is replaced by the next lowest live member: the round's store
    is etcd, which outlives it, so giving up for a full round (4 s on two nodes) is not needed.
    Returns ``(agreement, members)``, or ``(None, members)`` when this agent is the decider now
    (``members`` less the nodes whose lease is gone: they fence themselves)."""
    while True:
        decider = members.decider
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                store.wait([f"{scope}decision"], timedelta(seconds=max(0.01, min(
                    _slice_s(len(members.keys)), deadline - time.monotonic()))))  # see publish
                return read_agreement(store, scope), members
            except dist.DistStoreError:   # this slice's timeout
                pass
            alive = _still_in(members) if members.alive is not None else None
            if alive is not None and decider not in alive:
                break
            if time.monotonic() > deadline:
                raise QuickRoundFailed(
                    f"no decision from node {decider} within {timeout_s:.0f} s")
        members = Members(members.me, tuple(k for k in members.keys if k in alive),
                          members.alive)
        if members.decides:
            return None, members


def _slice_s(members: int) -> float:
    """How long a follower waits between two checks of the decider's lease: what replacing a
    lost decider costs beyond its lease's expiry. A slice makes no etcd request (the store
    keeps its watch), only a wake-up on the follower's machine, so it is short: 0.1 s, growing
    with the round to ``_WAIT_S`` at 1000 nodes, which bounds the round's wake-ups per second
    where followers share machines (benchmarks/coordination_scale.py runs 1024 on two cores)."""
    return min(_WAIT_S, max(0.1, members / 1000))


def publish(store: Any, scope: str, agreement: Agreement) -> None:
    """The agreement, which the others wait on. On etcd the watch event that wakes them
    carries the value, and their read right after the wait takes it from there (``EtcdStore``):
    it crosses the wire once per agent, with no read; a one-byte ``decided`` marker written
    after it, waited on, then the agreement read, cost a put and a read per agent more (4097
    requests per round at 4096 nodes), from when the agreement held the whole plan. The
    agreement is written only where none is: of a frozen decider and the member that replaced
    it, the first to publish stands and the other's round fails (``QuickRoundFailed``)."""
    new = agreement.encode()
    if bytes(store.compare_set(f"{scope}decision", "", new)) != new:
        raise QuickRoundFailed("another node published this round's decision first")


def read_agreement(store: Any, scope: str, timeout_s: float | None = None) -> Agreement:
    """The round's agreement, once published (waited for up to ``timeout_s`` when given)."""
    if timeout_s is not None:
        store.wait([f"{scope}decision"], timedelta(seconds=timeout_s))
    return Agreement.decode(store.get(f"{scope}decision"))


def adopt(agreement: Agreement, session: JobSession,
          desk: PlanDesk | None) -> tuple[Decision, PlanChange | None]:
    """This agent's copy of a published decision: the step replayed from the same digest
    (``session`` then holds the decider's plan, and says so by its digest), or else the whole
    decision fetched from the deciding agent and adopted. Returns the decision and the change
    it made in ``session``."""
    before = set(session.excluded)
    change = None
    if session.digest == agreement.base:
        change = session.step(agreement.lost, agreement.joined, dict(agreement.speeds),
                              agreement.renew, agreement.decision.quiet)
    if session.digest != agreement.digest:
        whole = _fetch(agreement, desk)
        session.excluded = before   # so that the change names what this agent saw lost
        change = session.adopt(whole.plan, whole.excluded, dict(whole.speeds))
        if session.digest != agreement.digest:
            raise PlanUnreachable(
                f"the plan the deciding agent served (generation {agreement.generation}) is not "
                "the one it published; this node runs a full rendezvous round instead")
        how = "fetched"
    else:
        how = "replayed"
    return agreement.resolve(session.plan), None if change is None else replace(change,
                                                                                agreed=how)


def _fetch(agreement: Agreement, desk: PlanDesk | None) -> Decision:
    """The whole decision, from the agent that made it (never from etcd)."""
    if desk is None or not agreement.source:
        raise PlanUnreachable(
            f"this node's plan differs from the one decided (generation "
            f"{agreement.generation}) and the deciding agent serves none; this node runs a "
            "full rendezvous round instead")
    try:
        return Decision.decode(desk.fetch(agreement.source))
    except (RuntimeError, OSError) as exc:   # torch's store errors are RuntimeErrors
        raise PlanUnreachable(
            f"this node's plan differs from the one decided (generation "
            f"{agreement.generation}) and fetching it from the deciding agent at "
            f"{agreement.source} failed ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
            "this node runs a full rendezvous round instead") from exc


def read_record(fence: Any) -> tuple[str | bytes, Decision | None]:
    """The job's newest published decision and its raw value (for the compare-and-set)."""
    if not fence.check([RECORD]):
        return "", None
    raw = bytes(fence.get(RECORD))
    return raw, Decision.decode(raw)


def commit_record(fence: Any, seen: str | bytes, decision: Decision,
                  encoded: bytes | None = None) -> None:
    """Make ``decision`` the newest, unless the record changed since ``seen`` was read.
    ``encoded``: ``decision.encode()``, when the caller has it already."""
    new = decision.encode() if encoded is None else encoded
    now = bytes(fence.compare_set(RECORD, seen, new))
    if now != new:
        newest = Decision.decode(now)
        raise Fenced(
            f"this agent decided plan generation "
            f"{decision.plan.generation if decision.plan else '?'} from an older view, but "
            f"generation {newest.plan.generation if newest.plan else '?'} was published "
            "meanwhile by another agent; this node was cut off from the others. Restart its "
            "launcher to rejoin the job."
        )


def agree(store: Any, scope: str, members: Members, mine: NodeReport, session: JobSession,
          inplace_wanted: bool, units_per_node: int, timeout_s: float,
          quick: bool = False, desk: PlanDesk | None = None,
          standbys: Collection[int] = ()) -> tuple[Decision, PlanChange | None, bool]:
    """The whole protocol for one round, in its order: report, then catch up with the newest
    published plan, decide and publish (the lowest member), or replay the published step
    (the others). Returns the decision, the plan change it made in ``session`` (None: same
    plan) and whether this agent decided (it hosts the generation's worker store). Raises
    ``LauncherPlanningError`` when no plan can run the job, or this agent is fenced; the
    decider publishes the error first, so that the others end with the same sentence.
    ``quick``: a quick round (see the module docstring); may raise ``QuickRoundFailed``.
    ``desk``: where the decider serves its plan to an agent whose replay differs.
    ``standbys``: spare devices outside the training world whose loss no worker needs to
    hear of, as the decider sees them (empty: any loss makes a new generation).
    ``timeout_s`` also bounds the round's etcd retries (module docstring, *etcd in trouble*):
    a round etcd could not serve by then raises ``QuickRoundFailed``."""
    fence = getattr(store, "underlying_store", store)   # outlives rounds
    bound = getattr(fence, "retrying_until", None)   # EtcdStore's: the round bounds its retries
    try:
        with bound(time.monotonic() + timeout_s) if bound else contextlib.nullcontext():
            return _agree_in_round(store, scope, members, mine, session, inplace_wanted,
                                   units_per_node, timeout_s, quick, desk, standbys)
    except RendezvousConnectionError as exc:   # etcd did not serve the round in time
        raise QuickRoundFailed(
            f"etcd could not serve this round within its {timeout_s:.0f} s "
            f"({str(exc).splitlines()[0][:300]}); this node runs a full rendezvous round "
            "instead") from exc


def _failure(decision: Decision, fallback: str = "") -> LauncherPlanningError:
    """The error that ends the job on ``decision``: with exit 93 when it is for good."""
    error = NoPlanError if decision.no_plan else LauncherPlanningError
    return error(decision.error or fallback)


def _agree_in_round(store: Any, scope: str, members: Members, mine: NodeReport,
                    session: JobSession, inplace_wanted: bool, units_per_node: int,
                    timeout_s: float, quick: bool,
                    desk: PlanDesk | None,
                    standbys: Collection[int]) -> tuple[Decision, PlanChange | None, bool]:
    """``agree`` inside the round's deadline (see there)."""
    fence = getattr(store, "underlying_store", store)   # outlives rounds
    seen: str | bytes = ""
    launched = -1
    if members.decides:   # only the decider reads the record: it holds the whole plan
        seen, launched = _catch_up(fence, session)
    if quick and members.alive is not None:
        _still_in(members)
    report(store, scope, members.me, mine, opens=quick)
    published = False
    try:
        agreement = None
        if quick and not members.decides:
            agreement, members = _quick_decision(store, scope, members, min(timeout_s, QUICK_S))
            if agreement is None:   # the decider's lease is gone: this node decides instead
                seen, launched = _catch_up(fence, session)
        elif not members.decides:
            agreement = read_agreement(store, scope, timeout_s)
        if members.decides:
            keys = (_live_reports(store, scope, members, min(timeout_s, QUICK_S)) if quick
                    else members.keys)
            decision, change = _decide(store, scope, collect(store, scope, keys), session,
                                       inplace_wanted, units_per_node,
                                       (fence, seen, desk, launched), standbys)
            published = True
        else:
            assert agreement is not None
            if agreement.decision.error or agreement.generation is None:
                raise _failure(agreement.decision, "no plan was published")
            if quick and members.me not in agreement.decision.nodes:   # our lease lapsed
                raise QuickRoundFailed("the other nodes decided without this one")
            decision, change = adopt(agreement, session, desk)
        if decision.error:
            raise _failure(decision)
    except Fenced as exc:
        if quick:   # two deciders (one replaced while frozen): the full round settles it
            raise QuickRoundFailed(str(exc)) from exc
        raise LauncherPlanningError(str(exc)) from exc
    except LauncherPlanningError as exc:
        if members.decides and not published:
            publish(store, scope, Agreement.of(Decision(
                None, (), (), False, None, str(exc), no_plan=isinstance(exc, NoPlanError))))
        raise
    return decision, change, members.decides


def _decide(store: Any, scope: str, reports: Sequence[NodeReport], session: JobSession,
            inplace_wanted: bool, units_per_node: int,
            fencing: tuple[Any, str | bytes, PlanDesk | None, int],
            standbys: Collection[int] = ()) -> tuple[Decision, PlanChange | None]:
    """The decider's part: the planner's inputs from the reports, the step, the record
    (fenced against ``seen``), the whole decision offered on the desk, the agreement
    published. ``fencing``: (the store under the rounds, the record as read, the desk, the
    record's ``launches``: -1 without one)."""
    fence, seen, desk, launched = fencing
    lost, joined = losses(reports, session.excluded, session.devices, units_per_node)
    speeds = speeds_of(reports, ())
    renew = inplace_possible(reports, inplace_wanted)
    quiet = quiet_loss(lost, joined, session.excluded, standbys)
    base = session.digest
    change = session.step(lost, joined, speeds, renew, quiet)
    decision = decide(session.plan, session.excluded, reports, inplace_wanted,
                      reasons(reports, lost, units_per_node), tuple(sorted(session.speeds.items())),
                      launched, quiet=quiet and change is not None and change.quiet)
    source = ""
    if decision.error is None:
        whole = decision.encode()
        commit_record(fence, seen, decision, whole)
        source = desk.offer(whole) if desk is not None else ""
    publish(store, scope, Agreement.of(
        decision, base=base, digest=session.digest, lost=tuple(sorted(lost)),
        joined=tuple(sorted(joined)), speeds=tuple(sorted(speeds.items())), renew=renew,
        source=source))
    return decision, change


def _catch_up(fence: Any, session: JobSession) -> tuple[str | bytes, int]:
    """Adopt the newest published plan when it is newer than the session's (a later
    generation, or the same one with fewer standbys: a quiet decision keeps the generation);
    returns the record as read, for the compare-and-set of this agent's decision, and its
    ``launches`` (-1: no record, the job's first launch)."""
    seen, newest = read_record(fence)
    if newest is not None and newest.plan is not None and (
            newest.plan.generation > session.plan.generation or (
                newest.plan.generation == session.plan.generation
                and newest.plan != session.plan)):
        # with its speeds: the state the others hold, so that they can replay this decision
        session.adopt(newest.plan, newest.excluded, dict(newest.speeds))
    return seen, -1 if newest is None else newest.launches
