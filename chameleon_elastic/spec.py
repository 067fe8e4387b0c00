"""Job specification: what the planner needs to know about the model, the cluster and training.

A spec comes from a TOML file (``--job``) or a built-in preset (``--preset``). Every figure is
validated on load so that a typo fails at once with one sentence naming the key, the value and
what was expected, instead of surfacing later as a nonsensical plan: ``spec_checks`` checks one
key at a time, and the table readers at the end of this module compose those checks into each
table's dataclass. Per-layer figures may be a scalar (every layer alike) or a list of length
``model.layers`` (a heavier embedding or head).

Precision: ``model.precision`` says at which precision the per-layer byte figures were measured
or given, ``training.precision`` what the job trains with; the estimator converts activation
bytes between the two (docs/estimator.md). Times are never converted: measure them at the
training precision.

Tensor parallelism: ``training.tp`` cards on one node form a *unit* that holds a stage's layers
sharded over its cards, and the planner plans units, not cards (``planning.units.unit_spec``
builds that view). ``cluster.devices`` keeps counting cards, and the ``[model]`` figures stay
those of the whole, unsharded layer on one card, so one job file describes the same model
whatever ``tp`` is. Card ``c`` belongs to unit ``c // tp`` (``unit_of``, ``cards_of``): a unit's
cards are consecutive, as a node's local ranks are.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, cast

from .spec_checks import (
    SpecError,
    _boolean,
    _choice,
    _fraction,
    _integer,
    _number,
    _optional_per_layer,
    _per_layer,
    _reject_unknown,
    _section,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ELEMENT_BYTES",
    "OPTIONAL_PER_LAYER_KEYS",
    "PER_LAYER_KEYS",
    "PRECISIONS",
    "RECOMPUTE_POLICIES",
    "RECOVERY_MODES",
    "ClusterSpec",
    "JobSpec",
    "ModelProfile",
    "PlannerSpec",
    "Precision",
    "RecomputePolicy",
    "Recovery",
    "RecoverySpec",
    "SpecError",
    "StragglerSpec",
    "TrainingSpec",
    "cards_of",
    "load_job",
    "preset_names",
    "unit_of",
    "units_of",
]


#: The per-layer figures every job file must give.
PER_LAYER_KEYS = ("forward_s", "backward_s", "param_bytes", "optimizer_bytes", "activation_bytes")
#: Per-layer figures a job file may give; each has a documented default when absent.
OPTIONAL_PER_LAYER_KEYS = ("boundary_bytes",)

#: Element types a job can train with: ``fp32``, or torch autocast to ``bf16`` / ``fp16`` with
#: fp32 master weights and optimizer state.
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
#: Bytes of one element at each precision: what activation figures scale by between the
#: precision they were measured at and the one the job trains with.
ELEMENT_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})

#: When the planner recomputes a stage's activations in its backward (activation
#: checkpointing): ``auto`` only for a stage that would not fit in device memory otherwise,
#: ``never``, or ``always`` (every stage).
RecomputePolicy = Literal["auto", "never", "always"]
RECOMPUTE_POLICIES: tuple[str, ...] = ("auto", "never", "always")

#: How the processes move to a re-planned layout: ``inplace`` (the live processes regroup and
#: receive state from peers) or ``relaunch`` (every process restarts).
Recovery = Literal["inplace", "relaunch"]
RECOVERY_MODES: tuple[str, ...] = ("inplace", "relaunch")


def _hash_once(cls: type) -> type:
    """Keep the first hash of each instance of a frozen dataclass.

    The planner memoises on the spec and its model (``functools.lru_cache``), so it hashes
    them thousands of times per decision, and a model's hash walks every per-layer figure:
    15 us each at 32 layers on a loaded core, a third of a cold decision at 16k devices. The
    value is the generated hash, kept out of pickles (another process hashes strings with
    another seed)."""
    generated = cls.__hash__

    def __hash__(self: Any) -> int:
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = generated(self)  # frozen: set behind __setattr__
        return found

    def __getstate__(self: Any) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__ = __hash__  # type: ignore[method-assign]
    cls.__getstate__ = __getstate__  # type: ignore[attr-defined]
    return cls


@_hash_once
@dataclass(frozen=True)
class ModelProfile:
    """Per-layer cost figures (index = layer). Gradients take ``param_bytes`` per layer.

    ``param_bytes`` and ``optimizer_bytes`` are the fp32 master copies a holder keeps whatever
    the training precision. ``activation_bytes`` (what one micro-batch keeps for the backward)
    and ``boundary_bytes`` (the layer's output for one micro-batch: all a recomputed stage
    starting after this layer keeps per micro-batch) are at ``precision``. ``boundary_bytes``
    is None when the job file leaves it out; ``boundary_figures`` then falls back on
    ``activation_bytes``, an upper bound, resolved at use so that replacing the activations
    (a measured profile) never leaves a stale copy behind. Frozen and hashable: the estimator
    memoises on it.
    """

    layers: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    param_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    boundary_bytes: tuple[float, ...] | None = None
    precision: Precision = "fp32"

    @property
    def boundary_figures(self) -> tuple[float, ...]:
        """Output bytes of each layer for one micro-batch, at ``precision``."""
        return self.activation_bytes if self.boundary_bytes is None else self.boundary_bytes

    def state_bytes(self, layer: int) -> float:
        """Parameters + gradients + optimizer state of one layer: what a holder keeps resident."""
        return 2 * self.param_bytes[layer] + self.optimizer_bytes[layer]

    def transfer_bytes(self, layer: int) -> float:
        """What moves when a device must receive a layer: weights and optimizer state."""
        return self.param_bytes[layer] + self.optimizer_bytes[layer]


@dataclass(frozen=True)
class ClusterSpec:
    """The devices, their links, and what a transition costs. ``restart_s`` is a real process
    restart with communicator set-up; ``regroup_s`` is tearing down and rebuilding the process
    groups inside the live processes after a re-plan (measure it with
    ``chameleon-run --profile-out``)."""

    devices: int
    device_memory_bytes: float
    bandwidth_bytes_per_s: float
    restart_s: float
    failure_rate_per_hour: float
    recovery: Recovery = "inplace"
    regroup_s: float = 1.0
    tp_bandwidth_bytes_per_s: float | None = None
    devices_per_node: int | None = None      # cards per node; None: every card on one node
    host_memory_bytes: float | None = None   # per node, for in-memory snapshots; None: no check

    def node_of(self, card: int) -> int:
        """The node card ``card`` sits on: nodes hold ``devices_per_node`` consecutive cards
        (``node * nproc_per_node + local_rank``, as chameleon-run numbers them)."""
        return 0 if self.devices_per_node is None else card // self.devices_per_node

    @property
    def tp_bandwidth(self) -> float:
        """The link inside a tensor-parallel unit (intra-node, e.g. HCCS or NVLink):
        ``tp_bandwidth_bytes_per_s``, or ``bandwidth_bytes_per_s`` when the job file leaves it
        out. Resolved at use, as ``ModelProfile.boundary_figures`` is, so that replacing the
        bandwidth never leaves a stale copy behind."""
        if self.tp_bandwidth_bytes_per_s is None:
            return self.bandwidth_bytes_per_s
        return self.tp_bandwidth_bytes_per_s

    @property
    def switch_s(self) -> float:
        """The fixed part of switching to a re-planned layout, decided here and nowhere else:
        in place the live processes only rebuild their process groups (``regroup_s``);
        relaunched, every process restarts (``restart_s``)."""
        return self.regroup_s if self.recovery == "inplace" else self.restart_s

    def expected_run_s(self, live_devices: int) -> float:
        """Expected time to the next failure: 1 / (live devices x per-device rate)."""
        rate = live_devices * self.failure_rate_per_hour / 3600.0
        return math.inf if rate <= 0 else 1.0 / rate


@dataclass(frozen=True)
class TrainingSpec:
    """The initial layout, the global batch every plan preserves, and the training precision
    (``fp32``, or ``bf16`` / ``fp16`` autocast with fp32 master weights and optimizer state):
    it decides how large the activations are and whether a low-precision weight copy is held.

    ``tp`` cards make one tensor-parallel unit, the planner's device; ``dp`` and ``pp`` count
    units. ``tp_efficiency`` (0 < e <= 1) says how well a layer's compute scales over a unit:
    on ``tp`` cards it runs ``tp * e`` times faster than on one, the unit's own all-reduces
    aside (``planning.units`` prices one per layer per direction; ``e`` absorbs the rest)."""

    dp: int
    pp: int
    global_micro_batches: int
    micro_batch_size: int = 1
    precision: Precision = "fp32"
    tp: int = 1
    tp_efficiency: float = 1.0

    @property
    def size(self) -> int:
        """The devices (units) the job trains on at most: its initial layout's ``dp x pp``.
        The cluster's devices beyond it are standbys: they stay spare until a device of the
        layout is lost and the planner swaps one in (``planning.search.swap_plan``), so a
        re-plan never spreads the job over them."""
        return self.dp * self.pp


@dataclass(frozen=True)
class PlannerSpec:
    """Search ranges (the paper's R_dp and R_pp), whether pipeline-length templates widen
    them (``planning.candidates._candidate_shapes``), the plan-cache depth, and when a stage
    recomputes its activations: recomputation trades a second forward in the backward for
    memory, so by default (``auto``) the planner only pays it where a stage would not fit."""

    dp_radius: int = 2
    pp_radius: int = 2
    templates: bool = True
    cache_failures: int = 2
    recompute: RecomputePolicy = "auto"


@_hash_once
@dataclass(frozen=True)
class StragglerSpec:
    """When a slow device is worth a decision (``chameleon-run --stragglers auto``): its speed
    (measured compute against the plan's expected compute) stays below ``threshold`` for
    ``window`` steps; a device planned as slow counts as recovered once it stays at or above
    ``recover`` as long (hysteresis: between the two nothing changes, so plans do not flap)."""

    threshold: float = 0.7
    recover: float = 0.9
    window: int = 5


@dataclass(frozen=True)
class RecoverySpec:
    """The optional [recovery] table. ``snapshot_every``: every how many committed steps each
    device copies its state into host memory, its own and another node's (0: never; None:
    the default, chosen from the job's figures so that fault-free training slows by at most
    2%: ``planning.snapshots.default_every``, resolved by the CLIs)."""

    snapshot_every: int | None = None


@dataclass(frozen=True)
class JobSpec:
    model: ModelProfile
    cluster: ClusterSpec
    training: TrainingSpec
    planner: PlannerSpec = field(default_factory=PlannerSpec)
    name: str = "job"
    stragglers: StragglerSpec = field(default_factory=StragglerSpec)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str = "job") -> JobSpec:
        return _parse(data, name)

    @classmethod
    def from_toml(cls, path: str | Path) -> JobSpec:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(
                f"cannot read job file {str(path)!r} ({exc.strerror}); pass an existing TOML "
                f"file to --job, or use --preset with one of: {', '.join(preset_names())}."
            ) from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"job file {str(path)!r} is not valid TOML: {exc}.") from exc
        return _parse(data, path.stem)

    @classmethod
    def preset(cls, name: str) -> JobSpec:
        names = preset_names()
        if name not in names:
            raise SpecError(
                f"unknown preset {name!r}; choose one of: {', '.join(names)}, "
                "or describe the job in a TOML file and pass it with --job."
            )
        text = resources.files("chameleon_elastic.presets").joinpath(f"{name}.toml").read_text()
        return _parse(tomllib.loads(text), name)

    def with_recovery(self, recovery: str | None) -> JobSpec:
        """This spec with ``cluster.recovery`` replaced (the CLIs' ``--recovery``); itself when
        ``recovery`` is None."""
        if recovery is None:
            return self
        mode = _choice({"recovery": recovery}, "cluster", "recovery", RECOVERY_MODES,
                       default="inplace")
        return replace(self, cluster=replace(self.cluster, recovery=cast(Recovery, mode)))

    def with_snapshot_every(self, every: int | None) -> JobSpec:
        """This spec with ``recovery.snapshot_every`` replaced (chameleon-run's
        ``--snapshot-every``); itself when ``every`` is None."""
        if every is None:
            return self
        checked = _integer({"snapshot_every": every}, "recovery", "snapshot_every", minimum=0)
        return replace(self, recovery=RecoverySpec(checked))

    def to_dict(self) -> dict[str, Any]:
        """Plain data; per-layer figures stay lists so the result reloads with from_dict. An
        absent ``boundary_bytes``, ``tp_bandwidth_bytes_per_s``, ``devices_per_node``,
        ``host_memory_bytes`` or ``snapshot_every`` stays absent (each has a default)."""
        out = asdict(self)
        out["model"] = {k: (list(v) if isinstance(v, tuple) else v)
                        for k, v in out["model"].items() if v is not None}
        out["cluster"] = {k: v for k, v in out["cluster"].items() if v is not None}
        out["recovery"] = {k: v for k, v in out["recovery"].items() if v is not None}
        return out


def unit_of(card: int, tp: int) -> int:
    """The tensor-parallel unit card ``card`` belongs to: units are ``tp`` consecutive cards."""
    return card // tp


def cards_of(unit: int, tp: int) -> range:
    """The cards of ``unit``, in order: the inverse of ``unit_of``."""
    return range(unit * tp, (unit + 1) * tp)


def units_of(cards: Iterable[int], tp: int) -> tuple[int, ...]:
    """The units some cards belong to, sorted, each once: what losing those cards loses (a
    unit cannot run a sharded layer without every one of its cards)."""
    return tuple(sorted({unit_of(card, tp) for card in cards}))


def preset_names() -> list[str]:
    folder = resources.files("chameleon_elastic.presets")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_job(job: str | Path | None, preset: str | None) -> JobSpec:
    """The one place CLIs turn ``--job`` / ``--preset`` into a spec."""
    if job is not None and preset is not None:
        raise SpecError("--job and --preset are mutually exclusive; pass only one of them.")
    if job is not None:
        return JobSpec.from_toml(job)
    if preset is not None:
        return JobSpec.preset(preset)
    raise SpecError(
        f"no job given; pass --job FILE.toml or --preset NAME (one of: {', '.join(preset_names())})."
    )


# --------------------------------------------------------------------------- parsing


def _parse(data: Mapping[str, Any], name: str) -> JobSpec:
    """A validated spec from plain data. The tables are read in file order (model, cluster,
    training, the checks across them, planner, name) so that the first error reported is the
    same whichever table holds several."""
    _reject_unknown_tables(data)
    model = _parse_model(_section(data, "model"))
    cluster = _parse_cluster(_section(data, "cluster"))
    training = _parse_training(_section(data, "training"))
    _check_layout(model, cluster, training)
    planner = _parse_planner(_section(data, "planner", required=False))
    stragglers = _parse_stragglers(_section(data, "stragglers", required=False))
    recovery = _parse_recovery(_section(data, "recovery", required=False))
    job_name = data.get("name", name)
    if not isinstance(job_name, str):
        raise SpecError(f"name = {job_name!r} is invalid; expected a string.")
    return JobSpec(model=model, cluster=cluster, training=training, planner=planner, name=job_name,
                   stragglers=stragglers, recovery=recovery)


def _reject_unknown_tables(data: Mapping[str, Any]) -> None:
    """Fail on a top-level key that is no table of a job file: most often a misspelt table."""
    for key in data:
        if key not in ("name", "model", "cluster", "training", "planner", "stragglers",
                       "recovery"):
            raise SpecError(
                f"unknown top-level key {key!r}; a job file has the tables [model], [cluster], "
                "[training], optionally [planner], [stragglers] and [recovery], and an optional "
                "name."
            )


def _parse_model(m: Mapping[str, Any]) -> ModelProfile:
    """The [model] table: ``layers`` first, since every per-layer figure is checked against it."""
    _reject_unknown(m, "model", ("layers", "precision") + PER_LAYER_KEYS + OPTIONAL_PER_LAYER_KEYS)
    layers = _integer(m, "model", "layers")
    return ModelProfile(
        layers=layers,
        forward_s=_per_layer(m, "forward_s", layers, strict=True),
        backward_s=_per_layer(m, "backward_s", layers, strict=True),
        param_bytes=_per_layer(m, "param_bytes", layers, strict=False),
        optimizer_bytes=_per_layer(m, "optimizer_bytes", layers, strict=False),
        activation_bytes=_per_layer(m, "activation_bytes", layers, strict=False),
        boundary_bytes=_optional_per_layer(m, "boundary_bytes", layers),
        precision=cast(Precision, _choice(m, "model", "precision", PRECISIONS, default="fp32")),
    )


def _parse_cluster(c: Mapping[str, Any]) -> ClusterSpec:
    """The [cluster] table. An absent ``tp_bandwidth_bytes_per_s`` stays None, so that it
    follows ``bandwidth_bytes_per_s`` (``ClusterSpec.tp_bandwidth``)."""
    keys = ("devices", "device_memory_bytes", "bandwidth_bytes_per_s", "restart_s",
            "failure_rate_per_hour", "recovery", "regroup_s", "tp_bandwidth_bytes_per_s",
            "devices_per_node", "host_memory_bytes")
    _reject_unknown(c, "cluster", keys)
    return ClusterSpec(
        devices=_integer(c, "cluster", "devices"),
        device_memory_bytes=_number(c, "cluster", "device_memory_bytes", strict=True),
        bandwidth_bytes_per_s=_number(c, "cluster", "bandwidth_bytes_per_s", strict=True),
        restart_s=_number(c, "cluster", "restart_s"),
        failure_rate_per_hour=_number(c, "cluster", "failure_rate_per_hour"),
        recovery=cast(Recovery, _choice(c, "cluster", "recovery", RECOVERY_MODES,
                                        default="inplace")),
        regroup_s=_number(c, "cluster", "regroup_s", default=1.0),
        tp_bandwidth_bytes_per_s=(_number(c, "cluster", "tp_bandwidth_bytes_per_s", strict=True)
                                  if "tp_bandwidth_bytes_per_s" in c else None),
        devices_per_node=(_integer(c, "cluster", "devices_per_node")
                          if "devices_per_node" in c else None),
        host_memory_bytes=(_number(c, "cluster", "host_memory_bytes", strict=True)
                           if "host_memory_bytes" in c else None),
    )


def _parse_training(t: Mapping[str, Any]) -> TrainingSpec:
    """The [training] table, each figure on its own; ``_check_layout`` checks it against the
    cluster and the model."""
    _reject_unknown(t, "training", ("dp", "pp", "global_micro_batches", "micro_batch_size",
                                    "precision", "tp", "tp_efficiency"))
    return TrainingSpec(
        dp=_integer(t, "training", "dp"),
        pp=_integer(t, "training", "pp"),
        global_micro_batches=_integer(t, "training", "global_micro_batches"),
        micro_batch_size=_integer(t, "training", "micro_batch_size", default=1),
        precision=cast(Precision, _choice(t, "training", "precision", PRECISIONS,
                                          default="fp32")),
        tp=_integer(t, "training", "tp", default=1),
        tp_efficiency=_fraction(t, "training", "tp_efficiency", default=1.0),
    )


def _check_layout(model: ModelProfile, cluster: ClusterSpec, training: TrainingSpec) -> None:
    """Fail on an initial layout the cluster or the model cannot hold: each table may be
    valid alone and the job still impossible (more stages than layers, more units than cards)."""
    tp = training.tp
    per_node = cluster.devices_per_node
    if per_node is not None and (cluster.devices % per_node or per_node % tp):
        raise SpecError(
            f"cluster.devices_per_node = {per_node} does not divide cluster.devices = "
            f"{cluster.devices} into whole nodes of whole units of training.tp = {tp} cards; "
            "give the cards of one node, a multiple of tp that divides the devices."
        )
    if cluster.devices % tp:
        raise SpecError(
            f"cluster.devices = {cluster.devices} is not a multiple of training.tp = {tp}; "
            f"a unit is {tp} cards of one node, so give a multiple of {tp} cards or change tp."
        )
    if tp > 1 and training.dp * training.pp * tp > cluster.devices:
        raise SpecError(
            f"training.dp x training.pp x training.tp = {training.dp} x {training.pp} x {tp} = "
            f"{training.dp * training.pp * tp} exceeds cluster.devices = {cluster.devices}; "
            "lower dp, pp or tp, or add cards."
        )
    if training.dp * training.pp > cluster.devices:
        raise SpecError(
            f"training.dp x training.pp = {training.dp} x {training.pp} = "
            f"{training.dp * training.pp} exceeds cluster.devices = {cluster.devices}; "
            "lower dp or pp, or add devices."
        )
    if training.pp > model.layers:
        raise SpecError(
            f"training.pp = {training.pp} exceeds model.layers = {model.layers}; "
            "a stage needs at least one layer, so lower pp."
        )
    if training.global_micro_batches < training.dp:
        raise SpecError(
            f"training.global_micro_batches = {training.global_micro_batches} is less than "
            f"training.dp = {training.dp}; every pipeline needs at least one micro-batch."
        )


def _parse_stragglers(p: Mapping[str, Any]) -> StragglerSpec:
    """The optional [stragglers] table; every key has a default."""
    _reject_unknown(p, "stragglers", ("threshold", "recover", "window"))
    threshold = _fraction(p, "stragglers", "threshold", default=0.7)
    recover = _fraction(p, "stragglers", "recover", default=max(0.9, threshold))
    if recover < threshold:
        raise SpecError(
            f"stragglers.recover = {recover:g} is below stragglers.threshold = {threshold:g}; "
            "a device is slow below the threshold and recovered at or above recover, so give "
            "recover >= threshold."
        )
    return StragglerSpec(threshold, recover,
                         _integer(p, "stragglers", "window", minimum=1, default=5))


def _parse_recovery(r: Mapping[str, Any]) -> RecoverySpec:
    """The optional [recovery] table: absent keys take their defaults."""
    _reject_unknown(r, "recovery", ("snapshot_every",))
    every = _integer(r, "recovery", "snapshot_every", minimum=0) if "snapshot_every" in r else None
    return RecoverySpec(every)


def _parse_planner(p: Mapping[str, Any]) -> PlannerSpec:
    """The optional [planner] table; every key has a default, so an absent table is all of them."""
    _reject_unknown(p, "planner", ("dp_radius", "pp_radius", "templates", "cache_failures",
                                   "recompute"))
    return PlannerSpec(
        dp_radius=_integer(p, "planner", "dp_radius", minimum=0, default=2),
        pp_radius=_integer(p, "planner", "pp_radius", minimum=0, default=2),
        templates=_boolean(p, "planner", "templates", default=True),
        cache_failures=_integer(p, "planner", "cache_failures", minimum=0, default=2),
        recompute=cast(RecomputePolicy, _choice(p, "planner", "recompute", RECOMPUTE_POLICIES,
                                                default="auto")),
    )
