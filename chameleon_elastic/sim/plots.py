"""Two charts per experiment, every policy on each: throughput and working devices over time.

Curves are the mean over seeds of each policy's timeline averaged in equal time bins, so a bin
with a restart in half the seeds shows half the throughput: the expected behaviour, not one
lucky trace. Matplotlib runs on the Agg backend (files only, no display needed).
"""

from __future__ import annotations

from pathlib import Path

from .experiment import ExperimentResult

__all__ = ["mean_curves", "plot_experiment"]

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


def plot_experiment(result: ExperimentResult, out_dir: str | Path,
                    bins: int = 108) -> dict[str, str]:
    """Write throughput.png and devices.png into ``out_dir``; returns {name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(result.seeds)
    title = f"{result.spec.name}, mean of {n} trace{'s' if n != 1 else ''}"
    paths: dict[str, str] = {}
    for key, index, ylabel in (("throughput", 1, "throughput (samples/s)"),
                               ("devices", 2, "working devices")):
        fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=100)
        for name in result.policies:
            curves = mean_curves(result, name, bins)
            colour, line = _STYLE.get(name, (None, "-"))
            ax.plot(curves[0], curves[index], label=name, color=colour, linestyle=line,
                    linewidth=1.4, drawstyle="steps-mid")
        ax.set_xlabel("time (hours)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=len(result.policies), loc="lower left")
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths[key] = str(path)
    return paths
