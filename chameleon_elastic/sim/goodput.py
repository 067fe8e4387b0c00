"""Goodput: the share of the wall time that became training, per policy, and where the rest went.

Goodput (effective training time ratio) of one run = its net samples (lost work subtracted)
over what the fault-free job trains in the same wall time, i.e. ``RunSummary.
relative_throughput``. Production reports quote it at scale (ByteRobust: 97% at 9600 GPUs);
the question at 16,384 devices, with a failure every 1.8 h, is how much of it each recovery
mechanism keeps. What is missing from 1 is split three ways, per run, so that a reader can see
*why* one policy keeps more than another:

* ``paused``: wall time with nothing training (restarts, quorum changes, transitions), as a
  share of the horizon;
* ``redone``: work thrown away and trained again (the step in flight, the work since the last
  checkpoint), in seconds of fault-free training, as a share of the horizon;
* ``slowed``: the rest: training, but slower than fault-free (checkpoint stalls, fewer replica
  groups in the quorum, a rerouted or smaller layout).

The three and the goodput sum to 1 by construction (``slowed`` is the remainder), so a negative
``slowed`` would mean a policy trains faster than the fault-free layout (a better re-plan: a
layout finding, not goodput); the table shows it as it is.

The figure is one horizontal bar per policy, goodput first, then the three losses, with the
mean over seeds and its range written at the bar: a reader sees the ranking and its cause at
once. Matplotlib runs on the Agg backend (files only) and is imported only to draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from .experiment import ExperimentResult, Spread

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LABELS", "GoodputRow", "goodput_figure", "goodput_json", "goodput_rows", "goodput_table",
           "plot_goodput"]

#: How the figure names the baselines: they model the published mechanisms, not the products.
LABELS: dict[str, str] = {"torchft": "torchft-like", "nvrx": "NVRx-like",
                          "checkpoint": "checkpoint-restart", "recycle": "ReCycle-like",
                          "oobleck": "Oobleck-like"}

#: Loss shares in the order the figure stacks them after the goodput, with their colours.
_PARTS: tuple[tuple[str, str], ...] = (("paused", "#d62728"), ("redone", "#ff7f0e"),
                                       ("slowed", "#9467bd"))


@dataclass(frozen=True)
class GoodputRow:
    """One policy's goodput over the seeds and the mean shares of the horizon it lost."""

    policy: str
    goodput: Spread
    paused: float
    redone: float
    slowed: float
    failures: float   # mean failures per trace (the same traces for every policy)

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": self.goodput.to_dict(), "paused": self.paused,
                "redone": self.redone, "slowed": self.slowed, "failures": self.failures}


def goodput_rows(result: ExperimentResult) -> tuple[GoodputRow, ...]:
    """Per policy, in the experiment's order: goodput and its three losses (module docstring),
    each share computed per run and then averaged over the seeds."""
    rows = []
    for name in result.policies:
        summaries = result.summaries[name]
        runs = list(zip(result.runs[name], summaries))
        n = len(summaries)
        paused = sum(s.transition_s / run.horizon_s for run, s in runs) / n
        redone = sum(s.lost_work_s / run.horizon_s for run, s in runs) / n
        good = result.spread(name, "relative_throughput")
        rows.append(GoodputRow(name, good, paused, redone, 1.0 - good.mean - paused - redone,
                               sum(s.failures for s in summaries) / n))
    return tuple(rows)


def goodput_json(result: ExperimentResult) -> dict[str, Any]:
    """{policy: {"goodput": spread, "paused", "redone", "slowed", "failures"}}."""
    return {row.policy: row.to_dict() for row in goodput_rows(result)}


def _share(x: float) -> str:
    """A share as printed: below half the last digit it reads 0.00%, never -0.00% (float
    rounding of a remainder that is zero)."""
    return f"{0.0 if abs(x) < 5e-5 else x:.2%}"


def goodput_table(result: ExperimentResult) -> Table:
    """The goodput table as printed (and as docs/sim.md quotes it)."""
    n = len(result.seeds)
    hours = next(iter(result.runs.values()))[0].horizon_s / 3600.0 if result.runs else 0.0
    table = Table(title=f"goodput, {result.spec.name}: {n} trace{'s' if n != 1 else ''} of "
                        f"{hours:g} h")
    for col in ("policy", "goodput", "range", "paused", "redone", "slowed",
                "failures per trace"):
        table.add_column(col, justify="left" if col == "policy" else "right",
                         no_wrap=col == "policy")
    for row in goodput_rows(result):
        g = row.goodput
        table.add_row(row.policy, f"{g.mean:.2%} ± {g.std:.2%}", f"{g.min:.2%} - {g.max:.2%}",
                      _share(row.paused), _share(row.redone), _share(row.slowed),
                      f"{row.failures:.1f}")
    return table


def goodput_figure(result: ExperimentResult) -> Figure:
    """One stacked horizontal bar per policy (module docstring), best goodput on top."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = sorted(goodput_rows(result), key=lambda r: r.goodput.mean)
    fig = Figure(figsize=(9.0, 1.2 + 0.6 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(rows))
    ax.barh(ys, [r.goodput.mean for r in rows], color="#2ca02c", label="goodput")
    left = [r.goodput.mean for r in rows]
    for part, colour in _PARTS:
        widths = [max(0.0, getattr(r, part)) for r in rows]
        ax.barh(ys, widths, left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, widths)]
    lo = min((r.goodput.min for r in rows), default=0.0)
    ax.set_xlim(max(0.0, lo - 0.1 * (1.0 - lo) - 0.02), 1.0)
    for y, r in zip(ys, rows):
        ax.text(ax.get_xlim()[0], y, f" {r.goodput.mean:.2%} [{r.goodput.min:.2%}, "
                f"{r.goodput.max:.2%}]", va="center", ha="left", color="white",
                fontweight="bold")
    ax.set_yticks(list(ys), [LABELS.get(r.policy, r.policy) for r in rows])
    ax.set_xlabel("share of wall time (goodput: net samples / fault-free samples)")
    n = len(result.seeds)
    ax.set_title(f"{result.spec.name}: goodput and where the rest went, mean of {n} "
                 f"trace{'s' if n != 1 else ''}")
    fig.legend(loc="outside lower center", ncol=4, frameon=False)
    return fig


def plot_goodput(result: ExperimentResult, path: str | Path) -> str:
    """Write :func:`goodput_figure` to ``path``; returns the path."""
    goodput_figure(result).savefig(path)
    return str(path)
