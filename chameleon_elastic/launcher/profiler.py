"""Profiler: measured step time and memory per device, turned into figures the planner uses.

Who writes what:

- workers (optional, one line in the training loop): ``record_step(seconds)`` appends a JSON
  line to ``$CHAMELEON_PROFILE_DIR/device-<d>.jsonl``; a script that never calls it still gets
  memory figures. Without ``CHAMELEON_PROFILE_DIR`` the call does nothing.
- the agent: samples every worker's resident set size (psutil, the process and its children)
  about once a second, and device memory through ``chameleon_elastic.plugins`` for cuda / npu
  when that back-end is importable (looked up lazily; absent back-ends are skipped).
- at the end the agent writes ``--profile-out`` (JSON): per device the peak RSS, the peak device
  memory and the median step time, plus per-layer forward / backward seconds derived from the
  step times and the plan in force (1F1B: t_step = (N_pp + N_m - 1) (T_f + T_b), with the job
  file's forward:backward ratio). ``--profile FILE`` feeds such a file back: its per-layer times
  replace the job file's guesses before the first plan is made, and the measured cost of an
  in-place recovery (median regroup time, transfers excluded) replaces ``cluster.regroup_s``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.spec import JobSpec

__all__ = [
    "PROFILE_DIR_VAR",
    "Profiler",
    "apply_profile",
    "load_profile",
    "per_layer_times",
    "record_step",
]

PROFILE_DIR_VAR = "CHAMELEON_PROFILE_DIR"
_SAMPLE_EVERY_S = 1.0


def record_step(seconds: float) -> None:
    """Called by a worker after each training step; cheap, and a no-op outside chameleon-run."""
    directory = os.environ.get(PROFILE_DIR_VAR)
    if not directory:
        return
    device = os.environ.get("CHAMELEON_DEVICE", os.environ.get("RANK", "0"))
    line = json.dumps({"ts": time.time(), "step_s": float(seconds),
                       "generation": os.environ.get("CHAMELEON_PLAN_GENERATION")})
    with open(Path(directory) / f"device-{device}.jsonl", "a") as fh:
        fh.write(line + "\n")


def per_layer_times(spec: JobSpec, plan: ExecutionPlan,
                    step_s: Mapping[int, float]) -> tuple[float, float] | None:
    """(forward_s, backward_s) per layer that explain the measured step times under ``plan``."""
    per_layer = []
    roles = {r.device: r for r in plan.roles()}
    for device, t in step_s.items():
        role = roles.get(device)
        if role is None or t <= 0:
            continue
        slots = role.num_stages + role.micro_batches - 1
        layers = role.layer_end - role.layer_start
        per_layer.append(t / slots / layers)
    if not per_layer:
        return None
    fb = statistics.median(per_layer)
    f_share = sum(spec.model.forward_s) / (sum(spec.model.forward_s) + sum(spec.model.backward_s))
    return fb * f_share, fb * (1 - f_share)


def load_profile(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"cannot read measured profile {str(path)!r} ({exc}); pass a file written by "
            "chameleon-run --profile-out, or drop --profile to use the job file's figures."
        ) from exc
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"measured profile {str(path)!r} has no 'model' section; "
                         "pass a file written by chameleon-run --profile-out.")
    return data


def apply_profile(spec: JobSpec, profile: Mapping[str, Any]) -> JobSpec:
    """The spec with the profile's measured per-layer figures in place of the guesses."""
    data = spec.to_dict()
    measured = profile.get("model", {})
    for key in ("forward_s", "backward_s", "activation_bytes", "param_bytes"):
        value = measured.get(key)
        if value is not None:
            data["model"][key] = value
    regroup = profile.get("cluster", {}).get("regroup_s")
    if regroup is not None:
        data["cluster"]["regroup_s"] = regroup
    data["name"] = spec.name
    return JobSpec.from_dict(data, name=spec.name)


class Profiler:
    """Agent side: memory sampling, step-time collection, and the profile file."""

    def __init__(self, directory: str | Path, backend: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self._pids: dict[int, int] = {}          # device -> pid
        self._rss_peak: dict[int, int] = {}
        self._device_peak: dict[int, int] = {}
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
        used = self._device_memory()
        for device, value in used.items():
            self._device_peak[device] = max(self._device_peak.get(device, 0), value)

    def _device_memory(self) -> dict[int, int]:
        if self.backend in (None, "cpu", "gloo"):
            return {}
        try:
            from chameleon_elastic.plugins import get_backend  # runtime engineer's module

            stats = get_backend(self.backend).memory_stats()
        except Exception:  # noqa: BLE001 - optional back-end; memory figures are best effort
            return {}
        out = {}
        if isinstance(stats, Mapping):
            for key, value in stats.items():
                try:
                    out[int(key)] = int(value)
                except (TypeError, ValueError):
                    continue
        return out

    def step_times(self) -> dict[int, float]:
        out = {}
        for path in self.directory.glob("device-*.jsonl"):
            try:
                device = int(path.stem.split("-", 1)[1])
                values = [json.loads(line)["step_s"] for line in path.read_text().splitlines()
                          if line.strip()]
            except (ValueError, KeyError, OSError):
                continue
            if values:
                out[device] = statistics.median(values)
        return out

    def write(self, path: str | Path, spec: JobSpec | None,
              plan: ExecutionPlan | None) -> dict[str, Any]:
        self.sample(force=True)
        steps = self.step_times()
        devices = sorted(set(self._rss_peak) | set(steps) | set(self._device_peak))
        profile: dict[str, Any] = {
            "kind": "chameleon-measured-profile",
            "job": None if spec is None else spec.name,
            "devices": {
                str(d): {"rss_peak_bytes": self._rss_peak.get(d),
                         "device_memory_peak_bytes": self._device_peak.get(d),
                         "step_time_s": steps.get(d)}
                for d in devices
            },
            "model": {},
            "cluster": {} if not self._regroups else {
                "regroup_s": statistics.median(self._regroups)},
        }
        if spec is not None and plan is not None:
            times = per_layer_times(spec, plan, steps)
            if times is not None:
                profile["model"] = {"forward_s": times[0], "backward_s": times[1]}
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=target.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(profile, fh, indent=2)
        os.replace(tmp, target)
        return profile
