"""What an experiment tells a person: a summary table, a JSON document, per-run CSV.

The JSON has one entry per policy under ``"policies"`` with the mean of every metric over the
seeds (``avg_throughput``, ...) and its spread under ``"spread"``; ``"ratios"`` holds the paired
per-seed throughput ratios of chameleon to every other policy, next to the paper's figures
where the paper gives one.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from rich.table import Table

from .experiment import ExperimentResult
from .goodput import goodput_json

__all__ = ["METRICS", "PAPER_RATIOS", "runs_csv", "summary_table", "to_json_dict"]

#: The paper's simulation (32 devices, 10%/device-hour, 9 h): chameleon's average throughput
#: over Oobleck's and over ReCycle's.
PAPER_RATIOS: dict[str, float] = {"chameleon/oobleck": 1.229, "chameleon/recycle": 1.355}

METRICS: tuple[str, ...] = (
    "avg_throughput",
    "relative_throughput",
    "transition_s",
    "lost_samples",
    "lost_work_s",
    "final_working_devices",
    "decision_latency_mean_s",
    "decision_latency_max_s",
)


def _ratio_keys(result: ExperimentResult) -> list[tuple[str, str]]:
    ref = "chameleon" if "chameleon" in result.policies else result.policies[0]
    return [(ref, p) for p in result.policies if p != ref]


def to_json_dict(result: ExperimentResult, setting: dict[str, Any],
                 files: dict[str, str] | None = None) -> dict[str, Any]:
    policies: dict[str, Any] = {}
    for name in result.policies:
        entry: dict[str, Any] = {m: result.spread(name, m).mean for m in METRICS}
        entry["spread"] = {m: result.spread(name, m).to_dict() for m in METRICS}
        kinds: dict[str, int] = {}
        for s in result.summaries[name]:
            for k, v in s.decisions.items():
                kinds[k] = kinds.get(k, 0) + v
        entry["decisions_total"] = dict(sorted(kinds.items()))
        policies[name] = entry
    ratios = {}
    for num, den in _ratio_keys(result):
        key = f"{num}/{den}"
        ratios[key] = result.ratio(num, den).to_dict()
        if key in PAPER_RATIOS:
            ratios[key]["paper"] = PAPER_RATIOS[key]
    return {
        "job": result.spec.name,
        "setting": setting,
        "seeds": list(result.seeds),
        "fault_free_throughput": result.fault_free_throughput,
        "policies": policies,
        "ratios": ratios,
        "goodput": goodput_json(result),
        "files": files or {},
    }


def summary_table(result: ExperimentResult, tp: int = 1) -> Table:
    """One row per policy (means over the seeds), the paired ratios as the caption. Print it
    with :func:`chameleon_elastic.console.make_console`, which keeps it whole in a pipe.

    ``tp > 1``: the simulated devices were units of ``tp`` cards (``planning.units``); the
    title says how many cards and units, and the working count is in units."""
    n = len(result.seeds)
    title = (f"{result.spec.name}: {n} seed{'s' if n != 1 else ''}, fault-free "
             f"{result.fault_free_throughput:.2f} samples/s")
    if tp > 1:
        units = result.spec.cluster.devices
        title += (f", {units * tp} cards as {units} units of {tp} (a unit fails with any of "
                  "its cards)")
    table = Table(title=title)
    for col in ("policy", "throughput (samples/s)", "vs fault-free", "paused (s)",
                "lost work (s)", "working at end" if tp == 1 else "units working at end",
                "decide (ms, mean)"):
        # A policy's name is never cut ("chamele…" on a narrow terminal); numbers may wrap.
        table.add_column(col, justify="left" if col == "policy" else "right",
                         no_wrap=col == "policy")
    for name in result.policies:
        thr = result.spread(name, "avg_throughput")
        table.add_row(
            name,
            f"{thr.mean:.3f} ± {thr.std:.3f}",
            f"{result.spread(name, 'relative_throughput').mean:.1%}",
            f"{result.spread(name, 'transition_s').mean:.1f}",
            f"{result.spread(name, 'lost_work_s').mean:.1f}",
            f"{result.spread(name, 'final_working_devices').mean:.1f}",
            f"{result.spread(name, 'decision_latency_mean_s').mean * 1e3:.2f}",
        )
    keys = _ratio_keys(result)
    if keys:
        # One ratio per line: folded to the table's width, "1.714 ±" and "0.385" could land on
        # different lines, in a pipe as on a terminal.
        table.caption = "\n".join(
            f"{num}/{den} = {r.mean:.3f} ± {r.std:.3f}"
            + (f" (paper {PAPER_RATIOS[f'{num}/{den}']:.3f})" if f"{num}/{den}" in PAPER_RATIOS
               else "")
            for num, den in keys for r in [result.ratio(num, den)]
        )
    return table


def runs_csv(result: ExperimentResult) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "seed", *METRICS, "failures", "decisions"])
    for name in result.policies:
        for s in result.summaries[name]:
            kinds = ";".join(f"{k}={v}" for k, v in sorted(s.decisions.items()))
            w.writerow([name, s.seed, *(repr(getattr(s, m)) for m in METRICS), s.failures, kinds])
    return buf.getvalue()
