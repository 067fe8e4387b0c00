"""What the agents say to each other in one round, and the decision they agree on.

Value types only, each with the encoding it crosses the store in (:mod:`.agreement` runs the
protocol): a node's :class:`NodeReport`, the :class:`Decision` (with its plan: what the record
and the decider's desk hold) and the :class:`Agreement` every agent reads (the decision without
its plan, the planner's inputs and digests: a few hundred bytes whatever the job's size), the
round's :class:`Members`, and the errors that end a round.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from itertools import chain
from typing import Any, Protocol

from chameleon_elastic import channel
from chameleon_elastic.plan import ExecutionPlan

from ..session import LauncherPlanningError

__all__ = ["OPENED", "Agreement", "Decision", "Fenced", "Members", "NodeReport", "PlanDesk",
           "PlanUnreachable", "QuickRoundFailed", "world_of"]

#: the key (under a quick round's scope) that opens the round for an agent that has not seen
#: its cause yet; written with each report (``agreement.report``), read by ``Rounds.quick_called``
OPENED = "open"


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

    @cached_property
    def decider(self) -> int:
        """The lowest key, found once: an agent asks several times a round, and at 16384
        nodes each ``min`` is a pass over 16384 keys (nodes^2 where agents share cores)."""
        return min(self.keys)

    @property
    def decides(self) -> bool:
        return self.me == self.decider


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
    #: the error ends the job for good (exit 93, exit_status.py): no layout fits, or state
    #: was lost that only starting over from step 0 would make again
    no_plan: bool = False
    starting: tuple[int, ...] = ()          # working devices without a live worker: restarts
    #: TORCHELASTIC_RESTART_COUNT of the workers it starts: decisions so far that started
    #: processes, job-wide (0: the first launch), so that every rank of a world scopes torch's
    #: env:// store keys alike
    launches: int = 0
    #: only standbys were lost (spares outside the world): the plan in force is kept with
    #: fewer spares, and no worker is told (session.JobSession.drop_standbys)
    quiet: bool = False

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
                   starting=tuple(int(x) for x in d.get("starting", ())),
                   launches=int(d.get("launches", 0)), quiet=bool(d.get("quiet", False)))

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
            "starting": _runs(d.starting), "launches": d.launches, "quiet": d.quiet}).encode()

    @classmethod
    def decode(cls, raw: str | bytes) -> Agreement:
        d = json.loads(raw)
        decision = Decision(None, _unruns(d["excluded"]), (), bool(d["inplace"]), d["reported"],
                            d["error"], tuple((int(k), str(v)) for k, v in d["why"]),
                            _unruns(d["nodes"]),
                            tuple((int(k), float(v)) for k, v in d["decision_speeds"]),
                            bool(d["no_plan"]), _unruns(d.get("starting", [])),
                            int(d.get("launches", 0)), bool(d.get("quiet", False)))
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
    """The integers of ``_runs``, expanded by C loops (``range``, ``chain``): every follower
    decodes the round's nodes, 4096 of them at 4096 nodes, where a generator took a Python step
    per value (0.9 of the 5 s of Python the 1024 simulated agents of
    benchmarks/coordination_scale.py spent per round)."""
    return tuple(chain.from_iterable(range(first, first + count) for first, count in runs))


def world_of(plan: ExecutionPlan, live: Collection[int], inplace: bool) -> tuple[int, ...]:
    """Working devices (sorted), then spares that keep a live worker when recovering in place
    (a relaunch starts workers for working devices only)."""
    spares = sorted(set(plan.spare_devices) & set(live)) if inplace else []
    return tuple(plan.working_devices) + tuple(spares)
