"""An experiment: every chosen policy replayed over the same traces, and its summary statistics.

Ratios between policies are paired: for each trace (seed), chameleon's average throughput is
divided by the other policy's on that very trace, and the mean and spread of those per-seed
ratios are reported. Pairing removes the trace-to-trace variance that unpaired means would mix
in (a lucky seed with few failures lifts every policy alike).
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from ..spec import JobSpec
from .constants import BaselineConstants
from .engine import PolicyRun, simulate
from .policies import make_policy
from .policies.common import samples_per_step
from .traces import FailureTrace

__all__ = [
    "ExperimentResult",
    "RunSummary",
    "Spread",
    "fault_free_throughput",
    "run_experiment",
    "summarise",
]


@dataclass(frozen=True)
class Spread:
    mean: float
    std: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [float(v) for v in values]
        if not vals:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return cls(statistics.fmean(vals), std, min(vals), max(vals), len(vals))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max, "n": self.n}


@dataclass(frozen=True)
class RunSummary:
    policy: str
    seed: int
    avg_throughput: float          # net samples / horizon (lost work subtracted)
    relative_throughput: float     # avg_throughput / fault-free throughput
    transition_s: float            # paused time: transitions, restarts, stalls
    lost_samples: float            # work thrown away (in-flight steps, since last checkpoint)
    lost_work_s: float             # lost_samples at the fault-free throughput
    failures: int
    decisions: dict[str, int]
    final_working_devices: int
    decision_latency_mean_s: float
    decision_latency_max_s: float

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def fault_free_throughput(spec: JobSpec) -> float:
    from ..planning.search import initial_plan

    plan = initial_plan(spec)
    assert plan.estimate is not None
    return samples_per_step(spec) / plan.estimate.step_time_s


def summarise(run: PolicyRun, seed: int, fault_free: float) -> RunSummary:
    decisions: dict[str, int] = {}
    for d in run.decisions:
        decisions[d.kind] = decisions.get(d.kind, 0) + 1
    lat = [d.latency_s for d in run.decisions]
    last = run.timeline.segments[-1] if run.timeline.segments else None
    return RunSummary(
        policy=run.policy,
        seed=seed,
        avg_throughput=run.avg_throughput,
        relative_throughput=run.avg_throughput / fault_free if fault_free > 0 else math.nan,
        transition_s=run.timeline.paused_s,
        lost_samples=run.timeline.lost_samples,
        lost_work_s=run.timeline.lost_samples / fault_free if fault_free > 0 else math.nan,
        failures=run.trace.failures,
        decisions=decisions,
        final_working_devices=0 if last is None else last.working_devices,
        decision_latency_mean_s=statistics.fmean(lat) if lat else 0.0,
        decision_latency_max_s=max(lat, default=0.0),
    )


@dataclass
class ExperimentResult:
    spec: JobSpec
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    fault_free_throughput: float
    runs: dict[str, list[PolicyRun]] = field(default_factory=dict)
    summaries: dict[str, list[RunSummary]] = field(default_factory=dict)

    def spread(self, policy: str, metric: str) -> Spread:
        return Spread.of([getattr(s, metric) for s in self.summaries[policy]])

    def ratio(self, num: str, den: str) -> Spread:
        """Per-seed ``avg_throughput`` ratio num/den (paired), seeds where den > 0."""
        pairs = zip(self.summaries[num], self.summaries[den])
        return Spread.of([a.avg_throughput / b.avg_throughput for a, b in pairs
                          if b.avg_throughput > 0])


def _replay(spec: JobSpec, name: str, constants: BaselineConstants,
            trace: FailureTrace) -> PolicyRun:
    return simulate(make_policy(name, spec, constants), trace)


def run_experiment(spec: JobSpec, traces: Sequence[tuple[int, FailureTrace]],
                   policies: Sequence[str], constants: BaselineConstants | None = None,
                   on_run: Callable[[str, int], None] | None = None,
                   jobs: int = 1) -> ExperimentResult:
    """Replay every (seed, trace) against a fresh model of every policy.

    With ``jobs`` > 1 the replays run in that many worker processes: each is independent and
    pure, so the result is the same, in the same order, as with one (only the measured
    decision latencies differ, as they would between two runs).
    """
    constants = constants or BaselineConstants()
    result = ExperimentResult(spec, tuple(policies), tuple(s for s, _ in traces),
                              fault_free_throughput(spec))
    for seed, trace in traces:
        if trace.devices != spec.cluster.devices:
            raise ValueError(
                f"trace for seed {seed} covers {trace.devices} devices but the job has "
                f"cluster.devices = {spec.cluster.devices}; use a trace of the job's size."
            )
    tasks = [(name, seed, trace) for seed, trace in traces for name in policies]
    runs: dict[tuple[str, int], PolicyRun] = {}
    if jobs <= 1 or len(tasks) <= 1:
        for name, seed, trace in tasks:
            runs[(name, seed)] = _replay(spec, name, constants, trace)
            if on_run is not None:
                on_run(name, seed)
    else:
        # spawn: the parent may run threads (a progress bar, a plan cache warming up).
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=context) as pool:
            pending = {pool.submit(_replay, spec, name, constants, trace): (name, seed)
                       for name, seed, trace in tasks}
            for done in as_completed(pending):
                runs[pending[done]] = done.result()
                if on_run is not None:
                    on_run(*pending[done])
    for name in policies:
        result.runs[name] = [runs[(name, seed)] for seed, _ in traces]
        result.summaries[name] = [summarise(runs[(name, seed)], seed,
                                            result.fault_free_throughput)
                                  for seed, _ in traces]
    return result
