"""Two charts per experiment, every policy on each: throughput and working devices over time.

Each chart has two panels. The top one replays the first trace exactly (step lines: every
pause, restart and drop is visible, which is where Oobleck-like reconfiguration shows its
fluctuations). The bottom one is the mean over all seeds of each policy's timeline averaged in
equal time bins, so a bin with a restart in half the seeds shows half the throughput: the
expected behaviour, not one lucky trace. Matplotlib runs on the Agg backend (files only).
"""

from __future__ import annotations

from pathlib import Path

from .experiment import ExperimentResult

__all__ = ["mean_curves", "plot_experiment", "trace_curves"]

_STYLE = {
    "chameleon": ("tab:red", "-"),
    "hybrid": ("tab:purple", "--"),
    "oobleck": ("tab:blue", "-"),
    "recycle": ("tab:green", "-"),
    "checkpoint": ("tab:gray", ":"),
}


def mean_curves(result: ExperimentResult, policy: str,
                bins: int) -> tuple[list[float], list[float], list[float]]:
    """(bin centres in hours, mean samples/s, mean working devices) over the seeds."""
    runs = result.runs[policy]
    horizon = runs[0].horizon_s
    rate = [0.0] * bins
    devices = [0.0] * bins
    centres: list[float] = []
    for run in runs:
        centres, r, d = run.timeline.binned(bins, horizon)
        rate = [a + b / len(runs) for a, b in zip(rate, r)]
        devices = [a + b / len(runs) for a, b in zip(devices, d)]
    return [c / 3600.0 for c in centres], rate, devices


def trace_curves(result: ExperimentResult, policy: str,
                 index: int = 0) -> tuple[list[float], list[float], list[float]]:
    """(times in hours, samples/s, working devices) of one run, as step-line points."""
    run = result.runs[policy][index]
    t: list[float] = []
    rate: list[float] = []
    devices: list[float] = []
    for seg in run.timeline.segments:
        t += [seg.start_s / 3600.0, seg.end_s / 3600.0]
        rate += [seg.rate, seg.rate]
        devices += [seg.working_devices, seg.working_devices]
    return t, rate, devices


def plot_experiment(result: ExperimentResult, out_dir: str | Path,
                    bins: int = 108, tp: int = 1) -> dict[str, str]:
    """Write throughput.png and devices.png into ``out_dir``; returns {name: path}. With
    ``tp > 1`` the simulated devices are units of ``tp`` cards, and devices.png says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(result.seeds)
    title = f"{result.spec.name}, mean of {n} trace{'s' if n != 1 else ''}"
    paths: dict[str, str] = {}
    for key, index, ylabel in (("throughput", 1, "throughput (samples/s)"),
                               ("devices", 2, "working devices" if tp == 1
                                else f"working units ({tp} cards each)")):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 5.6), dpi=100, sharex=True)
        for name in result.policies:
            colour, line = _STYLE.get(name, (None, "-"))
            one = trace_curves(result, name)
            top.plot(one[0], one[index], label=name, color=colour, linestyle=line,
                     linewidth=1.1)
            curves = mean_curves(result, name, bins)
            bottom.plot(curves[0], curves[index], label=name, color=colour, linestyle=line,
                        linewidth=1.4, drawstyle="steps-mid")
        top.set_title(f"{result.spec.name}, trace of seed {result.seeds[0]}", fontsize=10)
        bottom.set_title(title, fontsize=10)
        bottom.set_xlabel("time (hours)")
        for ax in (top, bottom):
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        bottom.legend(fontsize=8, ncol=len(result.policies), loc="lower left")
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths[key] = str(path)
    return paths
