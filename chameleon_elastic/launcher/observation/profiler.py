"""Agent-side profiler: a whole script's step times and memory, written as a measured profile.

Who writes what:

- workers: ``record_step(seconds)`` (:mod:`chameleon_elastic.runtime.recording`, re-exported
  here) appends a JSON line to ``$CHAMELEON_PROFILE_DIR/device-<d>.jsonl``, with the device's
  peak memory when the script passes it. ``PipelineTrainer.run`` calls it on every working
  device after each step; a script with its own loop calls it itself. A script that never
  calls it still gets resident-memory figures.
- the agent: samples every worker's resident set size (psutil, the process and its children)
  about once a second, and notes the fixed cost of each in-place recovery.
- at the end the agent writes ``--profile-out`` as a :class:`~chameleon_elastic.profile.
  MeasuredProfile` with ``how = "steps"``: per device the peak RSS, the peak device memory
  reported and the median step time; per layer forward / backward seconds derived from the step
  times under the plan in force (:func:`per_layer_times`); the median regroup time as
  ``cluster.regroup_s``. The format is the one ``runtime.profiler.profile_layers`` writes, and
  ``chameleon-run --profile`` takes either (``MeasuredProfile.load(path).apply(spec)``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.profile import (
    ClusterFigures,
    DeviceFigures,
    Figure,
    MeasuredProfile,
    ModelFigures,
)
from chameleon_elastic.runtime.recording import PROFILE_DIR_VAR, record_step
from chameleon_elastic.spec import JobSpec

__all__ = [
    "PROFILE_DIR_VAR",
    "Profiler",
    "per_layer_times",
    "record_step",
]

_SAMPLE_EVERY_S = 1.0


def per_layer_times(spec: JobSpec, plan: ExecutionPlan, step_s: Mapping[int, float]
                    ) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Per-layer (forward_s, backward_s) that explain the measured step times under ``plan``.

    Step times give a scale, not a shape: the job file's own figures say which layers are
    heavier and how forward and backward split, and the measurement says by how much they were
    off. Under 1F1B a device's step takes ``N_pp + N_m - 1`` slots of its pipeline's slowest
    stage (``N_m`` counting the micro-batches it serves for dead peers; a recomputing stage's
    slot includes its second forward, as the estimator prices it), so each device gives
    ``k = (step / slots) / guessed slowest stage``; the median ``k`` over devices multiplies
    every layer's guess. None when no working device reported a step.
    """
    from chameleon_elastic.planning.estimator import stage_times

    model = spec.model
    slowest = [max(sum(stage_times(spec, a, b, recompute))
                   for (a, b), recompute in zip(pipe.layers, pipe.recompute))
               for pipe in plan.pipelines]
    ratios = []
    for role in plan.roles():
        t = step_s.get(role.device)
        if t is None or t <= 0:
            continue
        slots = role.num_stages + role.micro_batches - 1
        ratios.append(t / slots / slowest[role.pipeline])
    if not ratios:
        return None
    k = statistics.median(ratios)
    return (tuple(k * f for f in model.forward_s), tuple(k * b for b in model.backward_s))


def _per_layer(values: Sequence[float]) -> Figure:
    """One number when every layer is alike (readable files), else one per layer."""
    return values[0] if len(set(values)) == 1 else tuple(values)


class Profiler:
    """Agent side: memory sampling, step-time collection, and the profile file."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pids: dict[int, int] = {}          # device -> pid
        self._rss_peak: dict[int, int] = {}
        self._regroups: list[float] = []
        self._last_sample = 0.0

    def worker_env(self) -> dict[str, str]:
        return {PROFILE_DIR_VAR: str(self.directory)}

    def track(self, pids_by_device: Mapping[int, int]) -> None:
        self._pids = dict(pids_by_device)

    def note_regroup(self, seconds: float) -> None:
        """One in-place recovery's fixed cost (regroup, agree, rebuild; transfers excluded)."""
        self._regroups.append(seconds)

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_sample < _SAMPLE_EVERY_S:
            return
        self._last_sample = now
        import psutil

        for device, pid in self._pids.items():
            try:
                proc = psutil.Process(pid)
                rss = proc.memory_info().rss
                for child in proc.children(recursive=True):
                    rss += child.memory_info().rss
            except (psutil.Error, OSError):
                continue
            self._rss_peak[device] = max(self._rss_peak.get(device, 0), rss)

    def _records(self) -> dict[int, list[dict[str, object]]]:
        """What each device's worker reported through :func:`record_step`."""
        out: dict[int, list[dict[str, object]]] = {}
        for path in self.directory.glob("device-*.jsonl"):
            try:
                device = int(path.stem.split("-", 1)[1])
                lines = path.read_text().splitlines()
            except (ValueError, OSError):
                continue
            records = []
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:   # a line cut short by a killed worker
                    continue
                if isinstance(record, dict) and isinstance(record.get("step_s"), (int, float)):
                    records.append(record)
            if records:
                out[device] = records
        return out

    def step_times(self) -> dict[int, float]:
        """Median reported step time per device."""
        return {d: statistics.median(_step_s(r) for r in records)
                for d, records in self._records().items()}

    def measured(self, spec: JobSpec | None, plan: ExecutionPlan | None) -> MeasuredProfile:
        """Everything seen so far as a profile; per-layer times need the job and its plan."""
        self.sample(force=True)
        records = self._records()
        steps = self.step_times()
        device_peak: dict[int, int] = {}
        for d, rs in records.items():
            peaks = [int(v) for v in (r.get("device_memory_peak_bytes") for r in rs)
                     if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if peaks:
                device_peak[d] = max(peaks)
        devices = {d: DeviceFigures(rss_peak_bytes=self._rss_peak.get(d),
                                    device_memory_peak_bytes=device_peak.get(d),
                                    step_time_s=steps.get(d))
                   for d in sorted(set(self._rss_peak) | set(steps) | set(device_peak))}
        model = ModelFigures()
        if spec is not None and plan is not None:
            from chameleon_elastic.planning.units import unit_spec, whole_layer_times

            # the plan's devices are units of training.tp cards: explain the step times with
            # the unit view, then state them as the job file does (a whole layer, one card)
            times = per_layer_times(unit_spec(spec), plan, steps)
            if times is not None:
                forward, backward = (whole_layer_times(spec, t) for t in times)
                model = ModelFigures(layers=spec.model.layers, forward_s=_per_layer(forward),
                                     backward_s=_per_layer(backward))
        regroup = statistics.median(self._regroups) if self._regroups else None
        return MeasuredProfile(
            how="steps",
            precision="fp32" if spec is None else spec.training.precision,
            micro_batch_size=None if spec is None else spec.training.micro_batch_size,
            model=model,
            cluster=ClusterFigures(regroup_s=regroup),
            devices=devices,
            job=None if spec is None else spec.name,
        )

    def write(self, path: str | Path, spec: JobSpec | None,
              plan: ExecutionPlan | None) -> MeasuredProfile:
        """Write the profile to ``path`` (the file ``--profile`` takes back) and return it."""
        profile = self.measured(spec, plan)
        profile.write(path)
        return profile


def _step_s(record: Mapping[str, object]) -> float:
    value = record["step_s"]
    assert isinstance(value, (int, float))   # checked when the line was read
    return float(value)
