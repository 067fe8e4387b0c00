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

- the reports, the agreement and the one-byte ``decided`` marker, per round (small);
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
all), the others wait on the one-byte ``decided`` key written after the decision (a watch on
etcd) in slices. A member whose lease vanishes mid-round is dropped; when it is the decider,
the lowest member still holding its lease decides in its place (it reads the record then, so
its decision is made from whatever the lost decider committed, and is fenced against it). The
decision is written only where none is yet, so a frozen decider that wakes after being
replaced cannot overwrite its replacement's. A round that cannot finish raises
:class:`QuickRoundFailed`, after which the agent runs a full rendezvous round instead.

Reads block up to the store timeout, so an agent that dies mid-round makes the others fail with
a store error (the caller's failover), never hang. Everything but the store calls is a pure
function of its arguments, tested on a ``HashStore``.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.plan import ExecutionPlan

from .plan_env import device_id
from .session import JobSession, LauncherPlanningError, NoPlanError, PlanChange

__all__ = ["RECORD", "Agreement", "Decision", "Fenced", "Members", "NodeReport", "PlanDesk",
           "PlanUnreachable", "QuickRoundFailed", "adopt", "agree", "collect", "commit_record",
           "decide", "inplace_possible", "losses", "publish", "read_record", "reasons",
           "report", "speeds_of", "world_of"]

RECORD = "chameleon/plan"
_POLL_S = 0.01   # the decider's polls for reports: one etcd read per group of reports
_CHECK_KEYS = 128   # reports checked per store read: etcd's transaction limit (store.py)
_WAIT_S = 1.0    # the others wait for the decision in slices up to this long (see _slice_s)
#: a live member that has not joined a quick round by then is in a full round (a node joined)
QUICK_S = 15.0


class Fenced(RuntimeError):
    """Another agent published a newer plan than the one this agent decided from."""


class QuickRoundFailed(RuntimeError):
    """A quick round could not finish (a member stopped answering): run a full round."""


class PlanUnreachable(QuickRoundFailed):
    """This agent's replay did not reach the published digest and the deciding agent could not
    serve its plan (it died since): run a full round, whose decider starts from the record."""


class PlanDesk(Protocol):
    """Where the deciding agent serves its whole decision to the agents whose replay differs:
    :meth:`offer` (the decider) returns the place, :meth:`fetch` (the others) reads it there.
    Never etcd: the launcher's desk is the generation's worker store (``rounds.py``)."""

    def offer(self, blob: bytes) -> str: ...

    def fetch(self, source: str) -> bytes: ...


@dataclass(frozen=True)
class Members:
    """Who takes part in one agreement: ``keys`` name the reports (group ranks of a rendezvous
    round, node ids of a quick round), ``me`` is this agent's; the lowest key decides.
    ``alive`` (quick rounds with etcd leases): the keys whose node still holds its lease."""

    me: int
    keys: tuple[int, ...]
    alive: Callable[[], Collection[int]] | None = None

    @property
    def decides(self) -> bool:
        return self.me == min(self.keys)


@dataclass(frozen=True)
class NodeReport:
    node: int
    lost: tuple[int, ...]
    live: tuple[int, ...]
    ready: bool
    reported: int | None = None
    checkpoint: int | None = None
    checkpoints: bool = False   # the job writes checkpoints, though maybe none yet
    why: tuple[tuple[int, str], ...] = ()   # (lost device, how it was lost: "SIGKILL", ...)
    speeds: tuple[tuple[int, float], ...] = ()   # (slow device here, its speed factor)

    @classmethod
    def gather(cls, node: int, lost: Collection[int], live: Collection[int], ready: bool,
               why: dict[int, str], store: Any, cards: Collection[int] = (),
               speeds: Mapping[int, float] | None = None) -> NodeReport:
        """This node's report; what its workers (``cards``) said of steps and checkpoints is
        read from its channel (``store``); ``speeds``: its devices' factors to plan for
        (stragglers)."""
        return cls(node, tuple(sorted(lost)), tuple(sorted(live)), ready,
                   channel.known_reported(store, cards),
                   channel.read_int(store, channel.CHECKPOINT),
                   channel.read(store, channel.CHECKPOINTS) is not None,
                   tuple(sorted(why.items())), tuple(sorted((speeds or {}).items())))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeReport:
        return cls(int(d["node"]), tuple(d["lost"]), tuple(d["live"]), bool(d["ready"]),
                   d.get("reported"), d.get("checkpoint"), bool(d.get("checkpoints")),
                   tuple((int(k), str(v)) for k, v in d.get("why", ())),
                   tuple((int(k), float(v)) for k, v in d.get("speeds", ())))


@dataclass(frozen=True)
class Decision:
    """What every agent does next. ``world``: devices in rank order (working devices sorted,
    then, in place, spares that keep a live worker)."""

    plan: ExecutionPlan | None
    excluded: tuple[int, ...]
    world: tuple[int, ...]
    inplace: bool
    reported: int | None = None
    error: str | None = None
    why: tuple[tuple[int, str], ...] = ()   # each device lost in this decision, and how
    nodes: tuple[int, ...] = ()             # the nodes that reported: the next quick round's
    speeds: tuple[tuple[int, float], ...] = ()   # the slow devices the plan was made for
    no_plan: bool = False                   # the error is the planner's: no layout fits
    starting: tuple[int, ...] = ()          # working devices without a live worker: restarts

    def to_json(self) -> str:
        # shallow: asdict would first copy the whole plan, field by field, only to have it
        # replaced by plan.to_dict() (215 of 274 ms at 8192 devices, twice per publication)
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["plan"] = None if self.plan is None else self.plan.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        d = json.loads(text)
        plan = None if d["plan"] is None else ExecutionPlan.from_dict(d["plan"])
        return cls(plan, tuple(d["excluded"]), tuple(d["world"]), bool(d["inplace"]),
                   d.get("reported"), d.get("error"),
                   tuple((int(k), str(v)) for k, v in d.get("why", ())),
                   tuple(int(n) for n in d.get("nodes", ())),
                   tuple((int(k), float(v)) for k, v in d.get("speeds", ())),
                   no_plan=bool(d.get("no_plan", False)),
                   starting=tuple(int(x) for x in d.get("starting", ())))

    def encode(self) -> bytes:
        """What goes into the record and onto the decider's desk: the JSON, compressed (7x at
        8192 devices: 0.6 MB of plan became 86 kB; 339 kB at 32768 devices, below etcd's
        1.5 MB request limit). Level 1: 10 ms on the decider's critical path, where level 6
        took 23 ms for 6% less."""
        return zlib.compress(self.to_json().encode(), 1)

    @classmethod
    def decode(cls, raw: str | bytes) -> Decision:
        """A stored decision: compressed (``encode``; zlib's checksum rejects a damaged
        value), or plain JSON as agents before compression wrote it (a record outlives them)."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            return cls.from_json(data if data[:1] == b"{" else zlib.decompress(data))
        except zlib.error as exc:
            raise LauncherPlanningError(
                f"the plan decision in the rendezvous store is damaged ({exc}); the agents "
                "cannot agree on a plan. Restart the job (and check the store's health)."
            ) from exc


@dataclass(frozen=True)
class Agreement:
    """What a round publishes: the decision without its plan, the planner's inputs
    (:meth:`JobSession.step`'s arguments) and the session digests the decider started from
    (``base``) and reached (``digest``); ``source``: where the decider serves the whole
    decision (:class:`PlanDesk`). The world is not sent either: it is the plan's working
    devices, then (in place) its spares but the ``idle`` ones (no live worker). A few hundred
    bytes whatever the job's size."""

    decision: Decision                       # without its plan and its world
    base: str = ""
    digest: str = ""
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    speeds: tuple[tuple[int, float], ...] = ()   # every node's slow devices, as reported
    renew: bool = False
    source: str = ""
    generation: int | None = None            # the plan's, for messages
    idle: tuple[int, ...] = ()               # the plan's spares left out of the world

    @classmethod
    def of(cls, decision: Decision, **inputs: Any) -> Agreement:
        """The agreement on ``decision`` (made with a plan, or an error), given the inputs."""
        plan = decision.plan
        idle = () if plan is None or not decision.inplace else tuple(
            sorted(set(plan.spare_devices) - set(decision.world)))
        return cls(replace(decision, plan=None, world=()), idle=idle,
                   generation=None if plan is None else plan.generation, **inputs)

    def resolve(self, plan: ExecutionPlan) -> Decision:
        """The decision, with this agent's copy of its plan (the world follows from it)."""
        return replace(self.decision, plan=plan,
                       world=world_of(plan, set(plan.spare_devices) - set(self.idle),
                                      self.decision.inplace))

    def encode(self) -> bytes:
        d = self.decision
        return json.dumps({
            "base": self.base, "digest": self.digest, "lost": _runs(self.lost),
            "joined": _runs(self.joined), "speeds": self.speeds, "renew": self.renew,
            "source": self.source, "generation": self.generation, "idle": _runs(self.idle),
            "excluded": _runs(d.excluded), "inplace": d.inplace, "reported": d.reported,
            "error": d.error, "why": d.why, "nodes": _runs(d.nodes),
            "decision_speeds": d.speeds, "no_plan": d.no_plan,
            "starting": _runs(d.starting)}).encode()

    @classmethod
    def decode(cls, raw: str | bytes) -> Agreement:
        d = json.loads(raw)
        decision = Decision(None, _unruns(d["excluded"]), (), bool(d["inplace"]), d["reported"],
                            d["error"], tuple((int(k), str(v)) for k, v in d["why"]),
                            _unruns(d["nodes"]),
                            tuple((int(k), float(v)) for k, v in d["decision_speeds"]),
                            bool(d["no_plan"]), _unruns(d.get("starting", [])))
        return cls(decision, d["base"], d["digest"], _unruns(d["lost"]), _unruns(d["joined"]),
                   tuple((int(k), float(v)) for k, v in d["speeds"]), bool(d["renew"]),
                   d["source"], d["generation"], _unruns(d["idle"]))


def _runs(values: Sequence[int]) -> list[list[int]]:
    """Integers as runs of consecutive values, ``[first, count]``: a world of 8192 devices
    less one node is two runs, not 8184 numbers (40 kB of JSON to every agent)."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def _unruns(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(v for first, count in runs for v in range(first, first + count))


def report(store: Any, scope: str, group_rank: int, mine: NodeReport) -> None:
    store.set(f"{scope}node/{group_rank}", json.dumps(asdict(mine)))


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
        decider = min(members.keys)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                store.wait([f"{scope}decided"], timedelta(seconds=max(0.01, min(
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


def losses(reports: Sequence[NodeReport], excluded: Collection[int], devices: int,
           nproc: int) -> tuple[set[int], set[int]]:
    """(lost, joined): devices reported lost or on a node that did not report, and excluded
    devices on a reporting node that no longer reports them lost."""
    present = {r.node for r in reports}
    reported = {d for r in reports for d in r.lost}
    on_present = {device_id(node, lr, nproc) for node in present for lr in range(nproc)}
    everything = set(range(devices))
    lost = (reported | (everything - on_present)) & everything
    joined = (set(excluded) & on_present) - reported
    return lost, joined


def reasons(reports: Sequence[NodeReport], lost: Collection[int],
            nproc: int) -> tuple[tuple[int, str], ...]:
    """How each lost device was lost, for every agent's recovery line: what its own node
    reported (a signal, a hang, the health check), or ``node gone`` when its node did not
    report at all (a node that merely lost a worker is alive and says so)."""
    said = {d: why for r in reports for d, why in r.why}
    present = {r.node for r in reports}
    return tuple((d, said.get(d) or ("lost" if d // nproc in present else "node gone"))
                 for d in sorted(lost))


def speeds_of(reports: Sequence[NodeReport], excluded: Collection[int]) -> dict[int, float]:
    """Every node's slow devices and their factors (excluded devices left out)."""
    return {d: f for r in reports for d, f in r.speeds if d not in set(excluded)}


def world_of(plan: ExecutionPlan, live: Collection[int], inplace: bool) -> tuple[int, ...]:
    """Working devices (sorted), then spares that keep a live worker when recovering in place
    (a relaunch starts workers for working devices only)."""
    spares = sorted(set(plan.spare_devices) & set(live)) if inplace else []
    return tuple(plan.working_devices) + tuple(spares)


def inplace_possible(reports: Sequence[NodeReport], inplace_wanted: bool) -> bool:
    """In place when wanted and every node's live workers run on the runtime."""
    return inplace_wanted and all(r.ready for r in reports)


def decide(plan: ExecutionPlan, excluded: Collection[int], reports: Sequence[NodeReport],
           inplace_wanted: bool, why: tuple[tuple[int, str], ...] = (),
           speeds: tuple[tuple[int, float], ...] = ()) -> Decision:
    """The decision for the plan the session has chosen (a new generation when in place).
    In place, a plan that sources layers from a checkpoint when no worker has one cannot go
    on in place: a job that checkpoints (but lost them before its first checkpoint) is
    relaunched, so every worker starts again from step 0 and says so; a job that never
    checkpoints ends with a sentence, since starting over would redo everything."""
    live = {d for r in reports for d in r.live}
    inplace = inplace_possible(reports, inplace_wanted) and bool(live)   # someone to keep
    reported = max((r.reported for r in reports if r.reported is not None), default=None)
    runtime = bool(live) and all(r.ready for r in reports)
    lost_layers = plan.checkpoint_layers
    checkpoints = [r.checkpoint for r in reports if r.checkpoint is not None]
    error = None
    if lost_layers and inplace and runtime and not checkpoints and any(
            r.checkpoints for r in reports):
        inplace = False
    elif lost_layers and inplace and runtime and not checkpoints:
        lo, hi = lost_layers[0], lost_layers[-1]
        span = f"layer {lo} was" if lo == hi else f"layers {lo}-{hi} were"
        error = (f"{span} lost with every device that held them (devices "
                 f"{sorted(excluded)} are gone) and the job has no checkpoint to restore them "
                 "from; training cannot go on. Give the script a checkpoint directory (for "
                 "examples/train_gpt.py: --checkpoint-dir) to survive such a loss.")
    starting = tuple(d for d in plan.working_devices if d not in live) if inplace else ()
    return Decision(plan, tuple(sorted(excluded)), world_of(plan, live, inplace), inplace,
                    reported, error, why, tuple(sorted(r.node for r in reports)), speeds,
                    starting=starting)


def publish(store: Any, scope: str, agreement: Agreement) -> None:
    """The agreement, then ``decided``, which the others wait on: on etcd a watch event carries
    the value written, so waiting on the agreement itself would send it twice; the marker is
    one byte. The agreement is written only where none is: of a frozen decider and the member
    that replaced it, the first to publish stands and the other's round fails
    (``QuickRoundFailed``)."""
    new = agreement.encode()
    if bytes(store.compare_set(f"{scope}decision", "", new)) != new:
        raise QuickRoundFailed("another node published this round's decision first")
    store.set(f"{scope}decided", "1")


def read_agreement(store: Any, scope: str, timeout_s: float | None = None) -> Agreement:
    """The round's agreement, once published (waited for up to ``timeout_s`` when given)."""
    if timeout_s is not None:
        store.wait([f"{scope}decided"], timedelta(seconds=timeout_s))
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
                              agreement.renew)
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
          quick: bool = False,
          desk: PlanDesk | None = None) -> tuple[Decision, PlanChange | None, bool]:
    """The whole protocol for one round, in its order: report, then catch up with the newest
    published plan, decide and publish (the lowest member), or replay the published step
    (the others). Returns the decision, the plan change it made in ``session`` (None: same
    plan) and whether this agent decided (it hosts the generation's worker store). Raises
    ``LauncherPlanningError`` when no plan can run the job, or this agent is fenced; the
    decider publishes the error first, so that the others end with the same sentence.
    ``quick``: a quick round (see the module docstring); may raise ``QuickRoundFailed``.
    ``desk``: where the decider serves its plan to an agent whose replay differs."""
    fence = getattr(store, "underlying_store", store)   # outlives rounds
    seen: str | bytes = ""
    if members.decides:   # only the decider reads the record: it holds the whole plan
        seen = _catch_up(fence, session)
    if quick and members.alive is not None:
        _still_in(members)
    report(store, scope, members.me, mine)
    published = False
    try:
        agreement = None
        if quick and not members.decides:
            agreement, members = _quick_decision(store, scope, members, min(timeout_s, QUICK_S))
            if agreement is None:   # the decider's lease is gone: this node decides instead
                seen = _catch_up(fence, session)
        elif not members.decides:
            agreement = read_agreement(store, scope, timeout_s)
        if members.decides:
            keys = (_live_reports(store, scope, members, min(timeout_s, QUICK_S)) if quick
                    else members.keys)
            decision, change = _decide(store, scope, collect(store, scope, keys), session,
                                       inplace_wanted, units_per_node, (fence, seen, desk))
            published = True
        else:
            assert agreement is not None
            if agreement.decision.error or agreement.generation is None:
                error = NoPlanError if agreement.decision.no_plan else LauncherPlanningError
                raise error(agreement.decision.error or "no plan was published")
            if quick and members.me not in agreement.decision.nodes:   # our lease lapsed
                raise QuickRoundFailed("the other nodes decided without this one")
            decision, change = adopt(agreement, session, desk)
        if decision.error:
            raise LauncherPlanningError(decision.error)
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
            fencing: tuple[Any, str | bytes, PlanDesk | None]
            ) -> tuple[Decision, PlanChange | None]:
    """The decider's part: the planner's inputs from the reports, the step, the record
    (fenced against ``seen``), the whole decision offered on the desk, the agreement
    published. ``fencing``: (the store under the rounds, the record as read, the desk)."""
    fence, seen, desk = fencing
    lost, joined = losses(reports, session.excluded, session.devices, units_per_node)
    speeds = speeds_of(reports, ())
    renew = inplace_possible(reports, inplace_wanted)
    base = session.digest
    change = session.step(lost, joined, speeds, renew)
    decision = decide(session.plan, session.excluded, reports, inplace_wanted,
                      reasons(reports, lost, units_per_node), tuple(sorted(session.speeds.items())))
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


def _catch_up(fence: Any, session: JobSession) -> str | bytes:
    """Adopt the newest published plan when it is newer than the session's; returns the
    record as read, for the compare-and-set of this agent's decision."""
    seen, newest = read_record(fence)
    if newest is not None and newest.plan is not None and (
            newest.plan.generation > session.plan.generation):
        # with its speeds: the state the others hold, so that they can replay this decision
        session.adopt(newest.plan, newest.excluded, dict(newest.speeds))
    return seen
