"""Measured profiles: one file format for the figures a job spec can only guess.

A job spec's ``[model]`` figures (seconds and bytes per layer) and ``cluster.regroup_s`` are
estimates until someone measures them. Two producers measure, in different ways, and both write
a :class:`MeasuredProfile`:

- ``how = "layers"``: ``chameleon_elastic.runtime.profiler.profile_layers`` builds each layer of
  a ``PipelineModel`` alone, in process, and times and weighs it (seconds, parameter, optimizer,
  activation and boundary bytes per layer, at a given precision).
- ``how = "steps"``: ``chameleon-run --profile-out`` watches a whole script: step times the
  workers report, resident memory, and the cost of each in-place regroup; per-layer seconds are
  derived from the step times under the plan in force.

There is one consumer: :meth:`MeasuredProfile.apply` puts the measured figures in place of the
spec's guesses and re-validates the result through ``JobSpec.from_dict``, so a bad measured value
gets the spec's own one-sentence error. ``chameleon-run --profile FILE`` is the command-line
route to it.

This module is plain data like ``spec.py`` and ``plan.py``: no torch, a versioned JSON round-trip
(``kind`` + ``version``), and every malformed file rejected in one sentence that names the file
and the fix. JSON layout (every figure optional; a per-layer figure is a number, meaning every
layer alike, or a list with one number per layer)::

    {"kind": "chameleon-measured-profile", "version": 1,
     "how": "layers" | "steps", "precision": "fp32" | "bf16" | "fp16",
     "micro_batch_size": 4 | null, "job": "name" | null, "measured_on": "cuda:0" | null,
     "model": {"layers": 8, "forward_s": [...], "backward_s": [...], "param_bytes": [...],
               "optimizer_bytes": [...], "activation_bytes": [...], "boundary_bytes": [...]},
     "cluster": {"regroup_s": 0.18},
     "devices": {"0": {"rss_peak_bytes": ..., "device_memory_peak_bytes": ...,
                       "step_time_s": ...}}}
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast

from .spec import ELEMENT_BYTES, PRECISIONS, JobSpec, Precision, SpecError

__all__ = [
    "HOWS",
    "PROFILE_KIND",
    "PROFILE_VERSION",
    "ClusterFigures",
    "DeviceFigures",
    "Figure",
    "How",
    "MeasuredProfile",
    "ModelFigures",
    "ProfileError",
]

PROFILE_KIND = "chameleon-measured-profile"
PROFILE_VERSION = 1

#: How the figures were measured: each layer alone in process, or whole-script step times.
How = Literal["layers", "steps"]
HOWS: tuple[str, ...] = ("layers", "steps")
#: A per-layer figure: one number for every layer alike, or one number per layer.
Figure = float | tuple[float, ...]

_FIX = ("measure it again with chameleon-run --profile-out or "
        "python -m chameleon_elastic.runtime.profiler")


class ProfileError(ValueError):
    """A measured profile that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class ModelFigures:
    """Measured ``[model]`` figures, named exactly as the job spec's keys (every one is a
    ``ModelProfile`` field; a test guards it); None: not measured.

    ``boundary_bytes`` is what one micro-batch sends from a layer to the next (its output),
    against ``activation_bytes``, everything the layer keeps for its backward pass.
    """

    layers: int | None = None
    forward_s: Figure | None = None
    backward_s: Figure | None = None
    param_bytes: Figure | None = None
    optimizer_bytes: Figure | None = None
    activation_bytes: Figure | None = None
    boundary_bytes: Figure | None = None

    def table(self) -> dict[str, Any]:
        """The measured figures as a ``[model]`` table fragment (lists, not tuples)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class ClusterFigures:
    """Measured ``[cluster]`` figures: ``regroup_s``, the fixed cost of one in-place recovery
    (regroup, agree, rebuild; weight transfers excluded, the planner prices those itself)."""

    regroup_s: float | None = None

    def table(self) -> dict[str, Any]:
        return {} if self.regroup_s is None else {"regroup_s": self.regroup_s}


@dataclass(frozen=True)
class DeviceFigures:
    """What one device was seen to use: for the reader, not the planner (which plans with the
    per-layer bytes), so a surprising peak can be compared with the estimate."""

    rss_peak_bytes: int | None = None
    device_memory_peak_bytes: int | None = None
    step_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MeasuredProfile:
    """Figures measured on real hardware, in one format whoever measured them."""

    how: How
    precision: Precision = "fp32"
    micro_batch_size: int | None = None
    model: ModelFigures = field(default_factory=ModelFigures)
    cluster: ClusterFigures = field(default_factory=ClusterFigures)
    devices: Mapping[int, DeviceFigures] = field(default_factory=dict)
    job: str | None = None
    measured_on: str | None = None

    # ------------------------------------------------------------------ use

    def apply(self, spec: JobSpec) -> JobSpec:
        """``spec`` with the measured figures in place of its guesses.

        Refused, each in one sentence: a profile of another number of layers or another
        micro-batch size (it describes another job, and scaling it would be a guess again), and
        measured times at another precision than the job trains with (the spec never converts
        times). Byte figures may come at any precision: the
        measured activation and boundary bytes set ``model.precision``, and a spec guess of
        the one the profile lacks is converted to it (by element size, the estimator's rule).
        The result goes through ``JobSpec.from_dict``: a measured value the spec cannot take
        is reported with the spec's own sentence.
        """
        if self.model.layers is not None and self.model.layers != spec.model.layers:
            raise SpecError(
                f"the measured profile covers {self.model.layers} layers but job {spec.name!r} "
                f"has model.layers = {spec.model.layers}; profile the job's own model, or set "
                f"model.layers = {self.model.layers}."
            )
        mbs = spec.training.micro_batch_size
        if self.micro_batch_size is not None and self.micro_batch_size != mbs:
            raise SpecError(
                f"the measured profile was taken with micro-batches of {self.micro_batch_size} "
                f"samples but job {spec.name!r} has training.micro_batch_size = {mbs}; measure "
                f"again with micro_batch_size={mbs}, or set training.micro_batch_size = "
                f"{self.micro_batch_size}."
            )
        timed = self.model.forward_s is not None or self.model.backward_s is not None
        trains_at = spec.training.precision
        if timed and self.precision != trains_at:
            raise SpecError(
                f"the measured profile timed the layers at {self.precision} but job "
                f"{spec.name!r} trains at training.precision = {trains_at}; measure again at "
                f"{trains_at}, or set training.precision = {self.precision}."
            )
        data = spec.to_dict()
        model = data["model"]
        measured = self.model.table()
        at_precision = ("activation_bytes", "boundary_bytes")
        if any(key in measured for key in at_precision):
            scale = ELEMENT_BYTES[self.precision] / ELEMENT_BYTES[spec.model.precision]
            for key in at_precision:
                if key not in measured and isinstance(model.get(key), list):
                    model[key] = [v * scale for v in model[key]]
            model["precision"] = self.precision
        for key, value in measured.items():
            if key != "layers":
                model[key] = value
        data["cluster"].update(self.cluster.table())
        return JobSpec.from_dict(data, name=spec.name)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            "how": self.how,
            "precision": self.precision,
            "micro_batch_size": self.micro_batch_size,
            "job": self.job,
            "measured_on": self.measured_on,
            "model": self.model.table(),
            "cluster": self.cluster.table(),
            "devices": {str(d): self.devices[d].to_dict() for d in sorted(self.devices)},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def write(self, path: str | Path) -> Path:
        """Write the profile to ``path`` atomically (a reader never sees half a file); the
        file is what ``chameleon-run --profile`` takes."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(self.to_json() + "\n")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> MeasuredProfile:
        """Parse plain data; ``source`` (a file name) is named in every error."""
        where = f"measured profile {source!r}"
        if not isinstance(data, Mapping) or data.get("kind") != PROFILE_KIND:
            raise ProfileError(
                f"{where} is not a measured profile (no \"kind\": \"{PROFILE_KIND}\"); pass a "
                f"file written by chameleon-run --profile-out or MeasuredProfile.write."
            )
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ProfileError(
                f"{where} has format version {version!r} but this chameleon-elastic reads "
                f"version {PROFILE_VERSION}; {_FIX}."
            )
        known = ("kind", "version", "how", "precision", "micro_batch_size", "job", "measured_on",
                 "model", "cluster", "devices")
        _only(data, known, where, "")
        how = data.get("how")
        if how not in HOWS:
            raise ProfileError(f"{where}: how = {how!r} is invalid; expected one of: "
                               f"{', '.join(HOWS)}; {_FIX}.")
        precision = data.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise ProfileError(f"{where}: precision = {precision!r} is invalid; expected one of: "
                               f"{', '.join(PRECISIONS)}; {_FIX}.")
        mbs = data.get("micro_batch_size")
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            raise ProfileError(f"{where}: micro_batch_size = {mbs!r} is invalid; expected an "
                               f"integer >= 1 or null; {_FIX}.")
        for key in ("job", "measured_on"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ProfileError(f"{where}: {key} = {data[key]!r} is invalid; expected a "
                                   f"string or null; {_FIX}.")
        return cls(
            how=cast(How, how),
            precision=cast(Precision, precision),
            micro_batch_size=mbs,
            model=_model(_table(data, "model", where), where),
            cluster=_cluster(_table(data, "cluster", where), where),
            devices=_devices(_table(data, "devices", where), where),
            job=data.get("job"),
            measured_on=data.get("measured_on"),
        )

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> MeasuredProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"measured profile {source!r} is not valid JSON ({exc}); {_FIX}."
                               ) from exc
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | Path) -> MeasuredProfile:
        """The profile in file ``path``; any problem is one :class:`ProfileError` sentence."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ProfileError(
                f"cannot read measured profile {str(path)!r} ({reason}); pass a file written by "
                "chameleon-run --profile-out or MeasuredProfile.write, or drop --profile to plan "
                "with the job file's figures."
            ) from exc
        return cls.from_json(text, str(path))


# --------------------------------------------------------------------------- parsing


def _only(section: Mapping[str, Any], known: tuple[str, ...], where: str, prefix: str) -> None:
    for key in section:
        if key not in known:
            raise ProfileError(f"{where}: unknown key {prefix}{key}; the keys are: "
                               f"{', '.join(known)}; {_FIX}.")


def _table(data: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: {name} is not an object; {_FIX}.")
    return value


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _optional(section: Mapping[str, Any], key: str, where: str, prefix: str) -> Any:
    value = section.get(key)
    if value is not None and not _is_number(value):
        raise ProfileError(f"{where}: {prefix}{key} = {value!r} is invalid; expected a finite "
                           f"number or null; {_FIX}.")
    return value


def _model(section: Mapping[str, Any], where: str) -> ModelFigures:
    names = tuple(f.name for f in fields(ModelFigures))
    _only(section, names, where, "model.")
    layers = section.get("layers")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                               or layers < 1):
        raise ProfileError(f"{where}: model.layers = {layers!r} is invalid; expected an integer "
                           f">= 1; {_FIX}.")
    figures: dict[str, Any] = {"layers": layers}
    for key in names[1:]:
        value = section.get(key)
        if isinstance(value, list) and value and all(_is_number(v) for v in value):
            figures[key] = tuple(float(v) for v in value)
        elif value is None or _is_number(value):
            figures[key] = None if value is None else float(value)
        else:
            raise ProfileError(f"{where}: model.{key} = {value!r} is invalid; expected a "
                               f"finite number or a list of them, one per layer; {_FIX}.")
    return ModelFigures(**figures)


def _cluster(section: Mapping[str, Any], where: str) -> ClusterFigures:
    _only(section, ("regroup_s",), where, "cluster.")
    value = _optional(section, "regroup_s", where, "cluster.")
    return ClusterFigures(regroup_s=None if value is None else float(value))


def _devices(section: Mapping[str, Any], where: str) -> dict[int, DeviceFigures]:
    out: dict[int, DeviceFigures] = {}
    names = tuple(f.name for f in fields(DeviceFigures))
    for key, figures in section.items():
        if not str(key).isdigit() or not isinstance(figures, Mapping):
            raise ProfileError(f"{where}: devices[{key!r}] is invalid; expected a device id "
                               f"mapped to an object of figures; {_FIX}.")
        prefix = f"devices.{key}."
        _only(figures, names, where, prefix)
        values = {name: _optional(figures, name, where, prefix) for name in names}
        out[int(key)] = DeviceFigures(
            rss_peak_bytes=_as_int(values["rss_peak_bytes"]),
            device_memory_peak_bytes=_as_int(values["device_memory_peak_bytes"]),
            step_time_s=None if values["step_time_s"] is None else float(values["step_time_s"]),
        )
    return out


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)
