"""Three charts per experiment: throughput, throughput relative to a baseline, and devices.

What each chart must let a reader see, and the choices that follow from it:

- A pause (a transition, Oobleck's reconfiguration, a checkpoint restart) is the job waiting,
  not the cluster dying. Drawn as a drop to 0 it reads as the latter, and at 9 hours a 6 s pause
  is narrower than a pixel anyway. So a curve has a gap while its policy is paused, and the
  pauses get their own strip below the curve, one row per policy, each pause drawn at least
  ``MIN_PAUSE_FRACTION`` of the axis wide so it can be seen; the legend states the real total.
  Only a job with no layout at all ("stalled") goes to 0, because then nothing runs.
- Policies that coincide (chameleon and hybrid, and oobleck within 1-2%) must not hide each
  other: in the single-trace panels earlier policies are drawn wider underneath later ones,
  and device counts, which are integers, are offset by a fraction of a device.
- A difference the table reports (chameleon / oobleck = 1.014) is invisible on a samples/s axis
  that also holds ReCycle at a third of it. The relative chart plots, per seed and then averaged,
  the baseline's samples trained so far divided by each policy's: the curve ends at exactly the
  table's paired ratio, and a second panel zooms on the policies within a few percent.
- Every panel has its own legend.

The curve functions return plain lists (no matplotlib), so tests can check what is drawn.
Matplotlib runs on the Agg backend (files only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .engine import PolicyRun, Segment
from .experiment import ExperimentResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "MIN_PAUSE_FRACTION",
    "TraceCurves",
    "figures",
    "live_devices",
    "mean_curves",
    "pause_spans",
    "plot_experiment",
    "relative_curves",
    "trace_curves",
]

_STYLE = {
    "chameleon": ("tab:red", "-"),
    "hybrid": ("tab:purple", "--"),
    "oobleck": ("tab:blue", "-"),
    "recycle": ("tab:green", "-"),
    "checkpoint": ("tab:gray", ":"),
}

#: Segments in which no layout exists: the job has really stopped (not a pause).
_STOPPED = frozenset({"stalled", "idle"})

#: The narrowest a pause is drawn in the pause strip, as a share of the time axis (0.5% of 9 h
#: is 162 s): real pauses of 2-20 s would otherwise be invisible.
MIN_PAUSE_FRACTION = 0.005

#: The zoomed relative panel shows ratios within this distance of 1.
_ZOOM = 0.04


def _is_pause(seg: Segment) -> bool:
    return seg.rate == 0.0 and seg.label not in _STOPPED


def pause_spans(run: PolicyRun) -> list[tuple[float, float]]:
    """(start, end) in seconds of every pause of ``run``, back-to-back pause segments merged
    (a failure during a transition restarts it: one pause for the reader)."""
    spans: list[tuple[float, float]] = []
    for seg in run.timeline.segments:
        if not _is_pause(seg):
            continue
        if spans and math.isclose(spans[-1][1], seg.start_s, abs_tol=1e-9):
            spans[-1] = (spans[-1][0], seg.end_s)
        else:
            spans.append((seg.start_s, seg.end_s))
    return spans


def _layout_devices(segments: Sequence[Segment]) -> list[float]:
    """Per segment, the devices of the layout in force: a pause takes the layout it leads to
    (the one being switched to), or the one before it if nothing runs after it."""
    out = [float(s.working_devices) for s in segments]
    following: float | None = None
    orphans: list[int] = []          # pauses with nothing running after them
    for i in range(len(segments) - 1, -1, -1):
        if not _is_pause(segments[i]):
            following = out[i]
        elif following is not None:
            out[i] = following
        else:
            orphans.append(i)
    for i in sorted(orphans):
        if i > 0:
            out[i] = out[i - 1]
    return out


@dataclass(frozen=True)
class TraceCurves:
    """One run as step-line points, hours on x. ``rate`` and ``devices`` are NaN while the
    policy is paused (matplotlib leaves a gap) and 0 only while no layout exists."""

    times_h: list[float]
    rate: list[float]
    devices: list[float]
    pauses_h: list[tuple[float, float]]
    paused_s: float


def trace_curves(result: ExperimentResult, policy: str, index: int = 0) -> TraceCurves:
    """The exact timeline of seed number ``index`` of ``policy``."""
    run = result.runs[policy][index]
    t: list[float] = []
    rate: list[float] = []
    devices: list[float] = []
    for seg in run.timeline.segments:
        paused = _is_pause(seg)
        t += [seg.start_s / 3600.0, seg.end_s / 3600.0]
        rate += [math.nan if paused else seg.rate] * 2
        devices += [math.nan if paused else float(seg.working_devices)] * 2
    spans = pause_spans(run)
    return TraceCurves(t, rate, devices, [(a / 3600.0, b / 3600.0) for a, b in spans],
                       sum(b - a for a, b in spans))


def live_devices(result: ExperimentResult, index: int = 0) -> tuple[list[float], list[float]]:
    """(times in hours, live devices) of trace number ``index`` as step-line points: what
    every policy could use at best."""
    t: list[float] = []
    live: list[float] = []
    for start, end, n in _live_spans(next(iter(result.runs.values()))[index]):
        t += [start / 3600.0, end / 3600.0]
        live += [n, n]
    return t, live


def _live_spans(run: PolicyRun) -> list[tuple[float, float, float]]:
    """(start, end, live devices) between the trace's event groups, up to the horizon."""
    trace = run.trace
    spans: list[tuple[float, float, float]] = []
    start, live = 0.0, float(trace.devices)
    for group in trace.groups():
        spans.append((start, group.time_s, live))
        start, live = group.time_s, live - len(group.failed) + len(group.joined)
    spans.append((start, trace.horizon_s, live))
    return spans


def _binned(spans: Sequence[tuple[float, float, float]], bins: int,
            horizon_s: float) -> list[float]:
    """Time-weighted mean of piecewise-constant (start, end, value) spans over equal bins."""
    width = horizon_s / bins
    out = [0.0] * bins
    for start, end, value in spans:
        first = int(start // width)
        last = min(bins - 1, int(end // width))
        for b in range(first, last + 1):
            lo, hi = max(start, b * width), min(end, (b + 1) * width)
            if hi > lo:
                out[b] += value * (hi - lo) / width
    return out


def mean_curves(result: ExperimentResult, policy: str, bins: int
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(bin centres in hours, mean samples/s, mean devices in the layout, mean live devices)
    over the seeds. Throughput counts pauses as 0 (what the job trains on average); the device
    count does not (a pause keeps the layout it leads to), so a pause never reads as devices
    lost."""
    runs = result.runs[policy]
    horizon = runs[0].horizon_s
    rate = [0.0] * bins
    layout = [0.0] * bins
    live = [0.0] * bins
    for run in runs:
        segs = run.timeline.segments
        r = _binned([(s.start_s, s.end_s, s.rate) for s in segs], bins, horizon)
        d = _binned([(s.start_s, s.end_s, n) for s, n in zip(segs, _layout_devices(segs))],
                    bins, horizon)
        lv = _binned(_live_spans(run), bins, horizon)
        rate = [a + b / len(runs) for a, b in zip(rate, r)]
        layout = [a + b / len(runs) for a, b in zip(layout, d)]
        live = [a + b / len(runs) for a, b in zip(live, lv)]
    centres = [(i + 0.5) * horizon / bins / 3600.0 for i in range(bins)]
    return centres, rate, layout, live


def relative_curves(result: ExperimentResult, baseline: str, points: int
                    ) -> tuple[list[float], dict[str, list[float]]]:
    """(times in hours, {policy: mean over seeds of baseline / policy net samples trained by
    then}). Paired per seed, as the report's ratios; at the horizon each value is exactly
    ``result.ratio(baseline, policy).mean``. A seed where the policy has trained nothing yet
    is left out of that instant's mean (NaN when no seed is left)."""
    horizon = result.runs[baseline][0].horizon_s
    times = [horizon * (k + 1) / points for k in range(points)]
    curves: dict[str, list[float]] = {}
    for name in result.policies:
        if name == baseline:
            continue
        values: list[float] = []
        for t in times:
            ratios = []
            for base, other in zip(result.runs[baseline], result.runs[name]):
                done = other.timeline.net_between(0.0, t)
                if done > 0:
                    ratios.append(base.timeline.net_between(0.0, t) / done)
            values.append(sum(ratios) / len(ratios) if ratios else math.nan)
        curves[name] = values
    return [t / 3600.0 for t in times], curves


def _style(name: str) -> tuple[str | None, str]:
    return _STYLE.get(name, (None, "-"))


def _pause_strip(ax: Axes, result: ExperimentResult, horizon_h: float) -> None:
    """One row per policy; each pause of seed 0 a bar at least MIN_PAUSE_FRACTION wide. The
    row labels are the legend: policy, number of pauses, real time paused."""
    names = list(result.policies)
    labels = []
    for row, name in enumerate(names):
        colour, _ = _style(name)
        curves = trace_curves(result, name)
        bars = [(a, max(b - a, MIN_PAUSE_FRACTION * horizon_h)) for a, b in curves.pauses_h]
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colour or "black",
                       edgecolors=colour or "black", linewidth=0.6)
        labels.append(f"{name}: {len(bars)}, {curves.paused_s:.0f} s")
    ax.set_yticks(range(len(names)), labels, fontsize=7.5)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("pauses on that trace (bars widened to be visible; labels: number of pauses, "
                 "time paused)", fontsize=9)


def _legend(ax: Axes, ncol: int, loc: str = "lower left") -> None:
    ax.legend(fontsize=7.5, ncol=ncol, loc=loc, framealpha=0.85)


def _width(index: int) -> float:
    """Earlier policies are drawn wider, so a later one on top of it leaves it visible."""
    return max(1.0, 3.2 - 0.55 * index)


def plot_experiment(result: ExperimentResult, out_dir: str | Path,
                    bins: int = 108, tp: int = 1) -> dict[str, str]:
    """Write throughput.png, relative.png and devices.png into ``out_dir``; returns
    {name: path}. With ``tp > 1`` the simulated devices are units of ``tp`` cards, and
    devices.png says so."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {}
    for key, fig in figures(result, bins, tp).items():
        path = out / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths[key] = str(path)
    return paths


def figures(result: ExperimentResult, bins: int = 108, tp: int = 1) -> dict[str, Figure]:
    """The three charts as matplotlib figures ({"throughput", "relative", "devices"}), laid
    out and not yet saved: what plot_experiment writes, open to inspection in tests."""
    import matplotlib

    matplotlib.use("Agg")
    frame = _Frame.of(result, tp)
    return {
        "throughput": _throughput_figure(result, frame, bins),
        "relative": _relative_figure(result, frame, bins),
        "devices": _devices_figure(result, frame, bins),
    }


@dataclass(frozen=True)
class _Frame:
    """What the three charts share (policies, seeds, time axis, legend width, the device
    word), worked out once so that their titles and axes agree."""

    names: list[str]
    seed0: int
    horizon_h: float
    over: str
    ncol: int
    unit: str

    @classmethod
    def of(cls, result: ExperimentResult, tp: int) -> _Frame:
        names = list(result.policies)
        n = len(result.seeds)
        return cls(
            names=names,
            seed0=result.seeds[0],
            horizon_h=result.runs[names[0]][0].horizon_s / 3600.0,
            over=f"mean over {n} trace{'s' if n != 1 else ''}",
            ncol=min(len(names) + 1, 3),
            unit="devices" if tp == 1 else f"units ({tp} cards each)",
        )


def _throughput_figure(result: ExperimentResult, frame: _Frame, bins: int) -> Figure:
    """throughput.png: one trace exactly, its pauses, and the mean over traces. The exact
    trace shows the gaps a pause leaves; the mean shows what a policy trains on average."""
    import matplotlib.pyplot as plt

    names = frame.names
    fig, (top, strip, bottom) = plt.subplots(
        3, 1, figsize=(8.0, 8.4), dpi=100, sharex=True,
        gridspec_kw={"height_ratios": [3.0, 0.35 + 0.3 * len(names), 3.0]})
    for i, name in enumerate(names):
        colour, line = _style(name)
        one = trace_curves(result, name)
        top.plot(one.times_h, one.rate, label=name, color=colour, linestyle=line,
                 linewidth=_width(i))
        centres, rate, _, _ = mean_curves(result, name, bins)
        bottom.plot(centres, rate, label=name, color=colour, linestyle=line,
                    linewidth=_width(i), drawstyle="steps-mid")
    top.set_title(f"{result.spec.name}, trace of seed {frame.seed0}: throughput while training "
                  "(gaps: paused)", fontsize=10)
    _pause_strip(strip, result, frame.horizon_h)
    bottom.set_title(f"{result.spec.name}, {frame.over} (pauses count as 0)", fontsize=10)
    bottom.set_xlabel("time (hours)")
    for ax in (top, bottom):
        ax.set_ylabel("throughput (samples/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        _legend(ax, frame.ncol)
    bottom.set_xlim(0, frame.horizon_h)
    fig.tight_layout()
    return fig


def _relative_figure(result: ExperimentResult, frame: _Frame, bins: int) -> Figure:
    """relative.png: the baseline's samples trained so far over each policy's, paired per
    seed, in full and zoomed, so that a difference of a percent the table reports shows."""
    import matplotlib.pyplot as plt

    names = frame.names
    baseline = "chameleon" if "chameleon" in names else names[0]
    times, ratios = relative_curves(result, baseline, bins)
    fig, (full, zoom) = plt.subplots(2, 1, figsize=(8.0, 6.4), dpi=100, sharex=True)
    for ax in (full, zoom):
        ax.axhline(1.0, color="black", linewidth=0.8, label=f"{baseline} = 1")
        for i, (name, values) in enumerate(ratios.items()):
            colour, line = _style(name)
            ax.plot(times, values, color=colour, linestyle=line, linewidth=_width(i + 1),
                    label=f"{baseline} / {name}: {values[-1]:.3f} at the end")
        ax.set_ylabel(f"{baseline} / policy")
        ax.grid(True, alpha=0.3)
        _legend(ax, 2, "upper left" if ax is full else "lower left")
    full.set_title(f"samples trained so far, {baseline} over each policy ({frame.over}, "
                   f"paired per seed)", fontsize=10)
    if not ratios:
        full.text(0.5, 0.5, "one policy: nothing to compare", transform=full.transAxes,
                  ha="center", va="center")
    zoom.set_ylim(1.0 - _ZOOM, 1.0 + _ZOOM)
    zoom.set_title(f"the same, zoomed to 1 ± {_ZOOM:.2f} (curves outside leave the panel)",
                   fontsize=10)
    zoom.set_xlabel("time (hours)")
    zoom.set_xlim(0, frame.horizon_h)
    fig.tight_layout()
    return fig


def _devices_figure(result: ExperimentResult, frame: _Frame, bins: int) -> Figure:
    """devices.png: the layout's devices on one trace, the mean, and the devices left idle:
    whether a policy uses what is alive, which throughput alone does not tell."""
    import matplotlib.pyplot as plt

    names, unit, over = frame.names, frame.unit, frame.over
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8.0, 8.4), dpi=100, sharex=True)
    lt, lv = live_devices(result)
    top.plot(lt, lv, color="black", linewidth=4.0, alpha=0.18, label=f"live {unit}")
    offsets = [0.12 * (i - (len(names) - 1) / 2) for i in range(len(names))]
    centres: list[float] = []
    live_mean: list[float] = []
    for i, name in enumerate(names):
        colour, line = _style(name)
        one = trace_curves(result, name)
        top.plot(one.times_h, [d + offsets[i] for d in one.devices], label=name, color=colour,
                 linestyle=line, linewidth=1.2)
        centres, _, layout, live_mean = mean_curves(result, name, bins)
        middle.plot(centres, layout, label=name, color=colour, linestyle=line,
                    linewidth=_width(i), drawstyle="steps-mid")
        bottom.plot(centres, [a - b for a, b in zip(live_mean, layout)], label=name,
                    color=colour, linestyle=line, linewidth=_width(i), drawstyle="steps-mid")
    middle.plot(centres, live_mean, color="black", linewidth=4.0, alpha=0.18,
                label=f"live {unit}", drawstyle="steps-mid")
    top.set_title(f"{result.spec.name}, trace of seed {frame.seed0}: {unit} training "
                  f"(offset up to ±{max(offsets):.2f} to stay apart)", fontsize=10)
    middle.set_title(f"{over}: {unit} in each policy's layout", fontsize=10)
    bottom.set_title(f"{over}: live {unit} each policy leaves idle", fontsize=10)
    bottom.set_xlabel("time (hours)")
    top.set_ylabel(unit)
    middle.set_ylabel(unit)
    bottom.set_ylabel(f"idle {unit}")
    for ax in (top, middle, bottom):
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, frame.horizon_h)
        ax.grid(True, alpha=0.3)
        _legend(ax, frame.ncol, "best" if ax is bottom else "lower left")
    bottom.set_ylim(bottom=-0.05)
    fig.tight_layout()
    return fig
