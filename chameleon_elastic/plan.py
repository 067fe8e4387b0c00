"""Execution plan: the layout every worker follows, as plain frozen data with a JSON round-trip.

A plan is the planner's output and the only thing that crosses from the decision centre to the
launcher, the runtime and the simulator. It is deliberately plain data (JSON, never pickle) so
that it can sit in a rendezvous store, be injected into unmodified scripts through a file, and
be diffed by a person.

Device ids are global integers ``0 .. cluster.devices - 1``. Pipelines list their devices in
stage order with the half-open layer range ``[start, end)`` each stage holds. Under the
``reroute`` policy the layout is unchanged, the dead devices stay in their pipelines and are
listed in ``failed_devices``, and each dead device's micro-batches are served by the live
devices that hold exactly the same layers in other pipelines (its data-parallel peers). Under
``swap`` the layout is kept too, but each dead device's place is taken by a standby (a live spare
device), which receives that stage's layers.

Each stage carries a recomputation flag (``Pipeline.recompute``): a recomputing device keeps
only its stage's input per micro-batch in flight and runs the forward again before each
backward (activation checkpointing). The flag belongs to the device: it applies to every
micro-batch the device runs, its own and those it absorbs for a dead peer, so a dead stage's
own flag is never used.

A transfer's source is a live device, or ``CHECKPOINT`` for layers that no live device holds
any more (every replica died): the receiver loads those from the last checkpoint. A transfer
marked ``snapshot`` also moves layers no live device holds, from the in-memory snapshot a live
device keeps of them (``planning.snapshots``): its source is that device.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any, Literal

__all__ = [
    "CHECKPOINT",
    "POLICIES",
    "AllReduceGroup",
    "DeviceRole",
    "Estimate",
    "ExecutionPlan",
    "PeerShare",
    "Pipeline",
    "PlanError",
    "Policy",
    "Reroute",
    "Transfer",
]

Policy = Literal["initial", "reroute", "replan", "swap"]
POLICIES: tuple[str, ...] = ("initial", "reroute", "replan", "swap")
#: The source of a transfer whose layers no live device holds: the last checkpoint.
CHECKPOINT = "checkpoint"


class PlanError(ValueError):
    """A plan that breaks a structural invariant (bad layer cover, duplicate device, ...)."""


@cache
def _none_recomputed(stages: int) -> tuple[bool, ...]:
    """All-False flags, one tuple per length: the pipelines of a layout then share one object,
    which the estimator's per-shape memo keys on."""
    return (False,) * stages


@dataclass(frozen=True)
class Pipeline:
    """Devices in stage order, the layers ``[start, end)`` each holds, the micro-batch quota,
    and per stage whether it recomputes its activations in the backward.

    ``recompute`` may be left out (``()``): no stage recomputes, which is what every plan
    meant before the flag existed; it is then stored as one False per stage, so two ways of
    saying the same pipeline compare equal.
    """

    devices: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]
    micro_batches: int
    recompute: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.recompute:
            object.__setattr__(self, "recompute", _none_recomputed(len(self.devices)))
        elif type(self.recompute) is not tuple:  # a list would make the plan unhashable
            object.__setattr__(self, "recompute", tuple(self.recompute))

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def stage_of(self, device: int) -> int:
        return self.devices.index(device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "layers": [list(r) for r in self.layers],
            "micro_batches": self.micro_batches,
            "recompute": list(self.recompute),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pipeline:
        flags = d.get("recompute", ())
        if not isinstance(flags, (list, tuple)) or not all(isinstance(f, bool) for f in flags):
            raise PlanError(f"recompute {flags!r} is invalid; expected a list of true/false, "
                            "one per stage")
        return cls(
            devices=tuple(int(x) for x in d["devices"]),
            layers=tuple((int(a), int(b)) for a, b in d["layers"]),
            micro_batches=int(d["micro_batches"]),
            recompute=tuple(flags),
        )


@dataclass(frozen=True)
class PeerShare:
    device: int
    micro_batches: int


@dataclass(frozen=True)
class Reroute:
    """Where a dead device's micro-batches go.

    The dead device sat at ``stage`` of ``pipeline``; that pipeline's micro-batch with local
    index ``i`` is served at this stage by ``peers[i % len(peers)]``, so the shares differ by at
    most one and the first peers take the extra ones.
    """

    device: int
    pipeline: int
    stage: int
    peers: tuple[PeerShare, ...]

    def peer_for(self, micro_batch: int) -> int:
        return self.peers[micro_batch % len(self.peers)].device

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "pipeline": self.pipeline,
            "stage": self.stage,
            "peers": [{"device": p.device, "micro_batches": p.micro_batches} for p in self.peers],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Reroute:
        return cls(
            device=int(d["device"]),
            pipeline=int(d["pipeline"]),
            stage=int(d["stage"]),
            peers=tuple(PeerShare(int(p["device"]), int(p["micro_batches"])) for p in d["peers"]),
        )


@dataclass(frozen=True)
class Transfer:
    """``dst`` receives ``layers`` (weights + optimizer state, ``bytes`` in all) from ``src``:
    a live device, or ``CHECKPOINT`` when no live device holds them. ``snapshot``: no live
    device holds them either, and ``src`` sends them from its in-memory snapshot."""

    src: int | str
    dst: int
    layers: tuple[int, ...]
    bytes: float
    snapshot: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.src, str) and self.src != CHECKPOINT:
            raise PlanError(
                f"transfer source {self.src!r} is invalid; expected a device id or {CHECKPOINT!r}"
            )

    @property
    def from_checkpoint(self) -> bool:
        return self.src == CHECKPOINT

    @property
    def from_peer(self) -> bool:
        """A live holder sends the layers from its training state (not a checkpoint, not a
        snapshot)."""
        return not self.snapshot and self.src != CHECKPOINT

    def to_dict(self) -> dict[str, Any]:
        out = {"src": self.src, "dst": self.dst, "layers": list(self.layers), "bytes": self.bytes}
        if self.snapshot:
            out["snapshot"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Transfer:
        src = d["src"]
        return cls(src if isinstance(src, str) else int(src), int(d["dst"]),
                   tuple(int(x) for x in d["layers"]), float(d["bytes"]),
                   bool(d.get("snapshot", False)))


@dataclass(frozen=True)
class AllReduceGroup:
    """One gradient all-reduce: ``layers`` are held by exactly ``devices``."""

    layers: tuple[int, ...]
    devices: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "devices": list(self.devices)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AllReduceGroup:
        return cls(tuple(int(x) for x in d["layers"]), tuple(int(x) for x in d["devices"]))


@dataclass(frozen=True)
class Estimate:
    """The estimator's view of a plan; ``throughput`` is samples per second."""

    step_time_s: float
    transition_time_s: float
    peak_memory_bytes: Mapping[int, float]
    throughput: float
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "transition_time_s": self.transition_time_s,
            "peak_memory_bytes": {str(k): v for k, v in sorted(self.peak_memory_bytes.items())},
            "throughput": self.throughput,
            "score": self.score,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Estimate:
        return cls(
            step_time_s=float(d["step_time_s"]),
            transition_time_s=float(d["transition_time_s"]),
            peak_memory_bytes={int(k): float(v) for k, v in d["peak_memory_bytes"].items()},
            throughput=float(d["throughput"]),
            score=float(d["score"]),
        )


@dataclass(frozen=True)
class DeviceRole:
    """What one live device does under a plan: its home stage plus micro-batches it absorbs."""

    device: int
    pipeline: int
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    micro_batches: int  # own pipeline's quota plus what it serves for dead peers
    recompute: bool = False  # recomputes activations for every micro-batch it runs


@dataclass(frozen=True)
class ExecutionPlan:
    policy: Policy
    generation: int
    pipelines: tuple[Pipeline, ...]
    spare_devices: tuple[int, ...] = ()
    failed_devices: tuple[int, ...] = ()
    reroute: tuple[Reroute, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    allreduce_rounds: tuple[tuple[AllReduceGroup, ...], ...] = ()
    estimate: Estimate | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ derived views

    @property
    def num_layers(self) -> int:
        return self.pipelines[0].layers[-1][1]

    @property
    def global_micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    @cached_property  # a plan is frozen; at 16k devices each sort cost a decision 2 ms
    def live_devices(self) -> tuple[int, ...]:
        dead = set(self.failed_devices)
        working = [d for p in self.pipelines for d in p.devices if d not in dead]
        return tuple(sorted(working + list(self.spare_devices)))

    @cached_property
    def working_devices(self) -> tuple[int, ...]:
        dead = set(self.failed_devices)
        return tuple(sorted(d for p in self.pipelines for d in p.devices if d not in dead))

    @property
    def checkpoint_layers(self) -> tuple[int, ...]:
        """Layers the transfers take from the checkpoint (sorted): non-empty exactly when some
        layer lost every replica, so peers alone cannot restore the state."""
        return tuple(sorted({x for t in self.transfers if t.from_checkpoint for x in t.layers}))

    @property
    def snapshot_layers(self) -> tuple[int, ...]:
        """Layers the transfers take from in-memory snapshots (sorted): they lost every replica
        too, but a live device keeps a snapshot of them."""
        return tuple(sorted({x for t in self.transfers if t.snapshot for x in t.layers}))

    def micro_batch_offset(self, pipeline: int) -> int:
        """First global micro-batch index of ``pipeline``: quotas are laid end to end in
        pipeline order, so which samples a pipeline takes is a pure function of the plan."""
        return sum(p.micro_batches for p in self.pipelines[:pipeline])

    def locate(self, device: int) -> tuple[int, int]:
        """(pipeline, stage) of a device named in the layout."""
        for i, p in enumerate(self.pipelines):
            if device in p.devices:
                return i, p.stage_of(device)
        raise KeyError(f"device {device} is not in any pipeline of this plan")

    def server(self, pipeline: int, stage: int, micro_batch: int) -> int:
        """The device that runs ``micro_batch`` (local index) of ``pipeline`` at ``stage``."""
        device = self.pipelines[pipeline].devices[stage]
        for r in self.reroute:
            if r.device == device:
                return r.peer_for(micro_batch)
        return device

    def roles(self) -> Iterator[DeviceRole]:
        """One role per working device, in device order (spares and dead devices have none)."""
        absorbed: dict[int, int] = {}
        for r in self.reroute:
            for share in r.peers:
                absorbed[share.device] = absorbed.get(share.device, 0) + share.micro_batches
        dead = set(self.failed_devices)
        found = []
        for i, p in enumerate(self.pipelines):
            for s, d in enumerate(p.devices):
                if d in dead:
                    continue
                start, end = p.layers[s]
                found.append(DeviceRole(d, i, s, p.num_stages, start, end,
                                        p.micro_batches + absorbed.get(d, 0), p.recompute[s]))
        return iter(sorted(found, key=lambda r: r.device))

    # ------------------------------------------------------------------ validation

    def validate(self) -> ExecutionPlan:
        """Check the structural invariants every consumer relies on; returns self."""
        if self.policy not in POLICIES:
            raise PlanError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")
        if not self.pipelines:
            raise PlanError("a plan needs at least one pipeline")
        layers = self.pipelines[0].layers[-1][1] if self.pipelines[0].layers else 0
        seen: set[int] = set()
        splits_ok: set[int] = set()  # ids of layer splits checked (alive: the plan holds them)
        placed = list(itertools.chain.from_iterable(p.devices for p in self.pipelines))
        repeated = len(set(placed)) != len(placed)
        for i, p in enumerate(self.pipelines):
            if len(p.devices) == 0 or len(p.devices) != len(p.layers):
                raise PlanError(f"pipeline {i} needs one layer range per device")
            if len(p.recompute) != len(p.layers):
                raise PlanError(
                    f"pipeline {i} has {len(p.recompute)} recompute flags for "
                    f"{len(p.devices)} stages; give one per stage"
                )
            if p.micro_batches < 0:
                raise PlanError(f"pipeline {i} has a negative micro-batch quota")
            if id(p.layers) not in splits_ok:  # the pipelines of a layout share their split
                expected = 0
                for start, end in p.layers:
                    if start != expected or end <= start:
                        raise PlanError(
                            f"pipeline {i} layer ranges {p.layers} do not cover [0, {layers}) "
                            "contiguously with a non-empty range per stage"
                        )
                    expected = end
                if expected != layers:
                    raise PlanError(
                        f"pipeline {i} covers [0, {expected}) instead of [0, {layers})")
                splits_ok.add(id(p.layers))
            if repeated:  # some device is named twice: find the first, in this order
                for d in p.devices:
                    if d in seen:
                        raise PlanError(f"device {d} appears twice in the plan")
                    seen.add(d)
        if not repeated:
            seen.update(placed)
        for d in self.spare_devices:
            if d in seen:
                raise PlanError(f"spare device {d} is also in a pipeline")
            seen.add(d)
        # Only the failed devices and the reroutes' peers are looked up: not every device.
        asked = set(self.failed_devices).union(s.device for r in self.reroute for s in r.peers)
        where = {d: (i, t) for i, p in enumerate(self.pipelines) if not asked.isdisjoint(p.devices)
                 for t, d in enumerate(p.devices) if d in asked}
        for d in self.failed_devices:
            if d not in where:
                raise PlanError(f"failed device {d} is not in any pipeline of this plan")
        rerouted = {r.device for r in self.reroute}
        if rerouted != set(self.failed_devices) or len(rerouted) != len(self.reroute):
            raise PlanError("every failed device in the layout needs exactly one reroute entry")
        dead = set(self.failed_devices)
        for r in self.reroute:
            quota = self.pipelines[r.pipeline].micro_batches
            shares = [s.micro_batches for s in r.peers]
            n = len(shares)
            if n == 0 or shares != [(quota - j + n - 1) // n for j in range(n)]:
                raise PlanError(
                    f"reroute of device {r.device} must spread its {quota} micro-batches "
                    "round-robin over at least one live peer"
                )
            own = self.pipelines[r.pipeline].layers[r.stage]
            for share in r.peers:
                pi, si = where.get(share.device, (None, None))
                if pi is None or share.device in dead or self.pipelines[pi].layers[si] != own:
                    raise PlanError(
                        f"peer {share.device} of device {r.device} must be live and hold "
                        f"exactly layers {own}"
                    )
        return self

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "generation": self.generation,
            "num_layers": self.num_layers,
            "global_micro_batches": self.global_micro_batches,
            "pipelines": [p.to_dict() for p in self.pipelines],
            "spare_devices": list(self.spare_devices),
            "failed_devices": list(self.failed_devices),
            "reroute": [r.to_dict() for r in self.reroute],
            "transfers": [t.to_dict() for t in self.transfers],
            "allreduce_rounds": [[g.to_dict() for g in rnd] for rnd in self.allreduce_rounds],
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExecutionPlan:
        try:
            plan = cls(
                policy=d["policy"],
                generation=int(d["generation"]),
                pipelines=tuple(Pipeline.from_dict(p) for p in d["pipelines"]),
                spare_devices=tuple(int(x) for x in d.get("spare_devices", ())),
                failed_devices=tuple(int(x) for x in d.get("failed_devices", ())),
                reroute=tuple(Reroute.from_dict(r) for r in d.get("reroute", ())),
                transfers=tuple(Transfer.from_dict(t) for t in d.get("transfers", ())),
                allreduce_rounds=tuple(
                    tuple(AllReduceGroup.from_dict(g) for g in rnd)
                    for rnd in d.get("allreduce_rounds", ())
                ),
                estimate=None if d.get("estimate") is None else Estimate.from_dict(d["estimate"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan data: {exc!r}") from exc
        return plan.validate()

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ExecutionPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data)
