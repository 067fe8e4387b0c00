"""torchrun's cost, side by side: where the time goes from launch to first step and from the
last step to exit, for chameleon-run and torchrun on the same unmodified script.

    python benchmarks/launch_cost.py [--runs 6] [--nproc 2] [--job FILE | --preset NAME]
                                     [--load N] [--json out.json] [-- SCRIPT ARGS...]

    # the README's plan-aware demo: chameleon-run with its plan, torchrun with none
    python benchmarks/launch_cost.py --nproc 4 --preset tiny-cpu -- examples/train_gpt.py \
        --steps 40

Runs alternate (torchrun, chameleon-run, torchrun, ...) so that the machine's load falls on both
alike. Each run is timed from outside, the same way for both launchers:

- ``start``: launch -> the first worker process exists (the launcher's imports, its
  rendezvous, its worker store; psutil's process creation time, 10 ms resolution);
- ``first_step``: launch -> the script's first ``step 0`` line on stdout (the workers' imports
  and process group come in between);
- ``train``: the first step line -> the last one;
- ``exit``: the last step line -> the launcher's exit (the workers' teardown, the exit
  barrier, the launcher's own);
- ``restart`` (with ``--kill-at N``): rank 1's worker is SIGKILLed once step line N is out;
  from the kill to the restarted workers' first ``step 0`` line (both launchers restart every
  worker: ``--max-restarts 3``), to compare with ``first_step`` of a fresh launch.

The script must print a line starting with ``step <n>`` per step it reports (examples/
ddp_torchrun.py does; pass ``--steps`` for it). Prints a table of medians and the ratio to
torchrun, and JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launched import busy_loops

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(rb"^step\s+(\d+)\b")
PHASES = ("start", "first_step", "train", "exit", "wall", "restart")


def _watch_children(pid: int, seen: dict[int, float], stop: threading.Event) -> None:
    """Record each descendant's creation time until ``stop``: the first worker's is ``start``."""
    while not stop.is_set():
        try:
            for child in psutil.Process(pid).children(recursive=True):
                if child.pid not in seen:
                    try:
                        if "python" in child.name() and "-m" not in child.cmdline()[1:2]:
                            seen[child.pid] = child.create_time()
                    except psutil.Error:
                        pass
        except psutil.Error:
            return
        stop.wait(0.02)


def _kill_rank_1(launcher: int) -> bool:
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == "1" and "python" in child.name():
                child.kill()
                return True
        except psutil.Error:
            continue
    return False


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (its workers may have sessions of their
    own)."""
    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def one_run(tool: str, nproc: int, script: list[str], job: list[str], timeout_s: float,
            baseline: str | None = None, kill_at: int | None = None) -> dict[str, float]:
    """One launch of ``tool`` (``torchrun``, ``chameleon`` or ``baseline``: chameleon-run from
    the checkout ``baseline``); its phases in seconds."""
    module = "torch.distributed.run" if tool == "torchrun" else "chameleon_elastic.launcher.cli"
    flags = ["--standalone", f"--nproc-per-node={nproc}"]
    if kill_at is not None:
        flags.append("--max-restarts=3")
    if tool != "torchrun":
        flags += ["--no-status", *job]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cwd = ROOT
    if tool == "baseline":   # -m puts the working directory first on sys.path: run from there
        cwd = Path(str(baseline)).resolve()
        env["PYTHONPATH"] = str(cwd)
        script = [str(ROOT / script[0]), *script[1:]]
    began_wall, began = time.time(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, *flags, *script], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    # a relaunch can hang (torchrun's stale store: docs/launcher.md, *Measured*); reading its
    # output would wait for good, so the whole session is killed at the deadline
    deadline = threading.Timer(timeout_s, _kill_tree, (proc.pid,))
    deadline.start()
    seen: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_children, args=(proc.pid, seen, stop), daemon=True)
    watcher.start()
    steps: list[float] = []
    killed_at: float | None = None
    restarted = float("nan")
    assert proc.stdout is not None
    for line in proc.stdout:
        found = STEP.match(line)
        if not found:
            continue
        now = time.perf_counter() - began
        steps.append(now)
        step = int(found.group(1))
        if kill_at is not None and step == kill_at and killed_at is None:
            if _kill_rank_1(proc.pid):
                killed_at = time.perf_counter() - began
        elif step == 0 and killed_at is not None and math.isnan(restarted):
            restarted = now - killed_at
    code = proc.wait()
    ended = time.perf_counter() - began
    hung = not deadline.is_alive() and code == -signal.SIGKILL
    deadline.cancel()
    stop.set()
    watcher.join()
    if hung or code != 0 or not steps:
        why = f"hung: killed after {timeout_s:.0f} s" if hung else f"exited with {code}"
        print(f"{tool} {why} after {len(steps)} step lines", file=sys.stderr, flush=True)
        return {**dict.fromkeys(PHASES, float("nan")), "failed": 1.0}
    workers = sorted(seen.values())
    start = (workers[0] - began_wall) if workers else float("nan")
    return {"start": start, "first_step": steps[0], "train": steps[-1] - steps[0],
            "exit": ended - steps[-1], "wall": ended, "restart": restarted, "failed": 0.0}


def _median(values) -> float:
    """The median of the figures measured (nan when none was: no kill)."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """Medians per phase, each launcher's ratio and difference to torchrun's."""
    med = {tool: {p: _median(r[p] for r in rs) for p in PHASES} for tool, rs in runs.items()}
    others = [tool for tool in runs if tool != "torchrun"]
    rows = [f"{'phase (median s)':<18}{'torchrun':>10}" + "".join(
        f"{tool:>11}{'ratio':>7}{'diff':>7}" for tool in others)]
    for p in PHASES:
        t = med["torchrun"][p]
        rows.append(f"{p:<18}{t:>10.2f}" + "".join(
            f"{med[tool][p]:>11.2f}{med[tool][p] / t if t else float('nan'):>7.2f}"
            f"{med[tool][p] - t:>+7.2f}" for tool in others))
    rows.append(f"{'failed or hung':<18}{_failed(runs['torchrun']):>10}" + "".join(
        f"{_failed(runs[tool]):>11}{'':>14}" for tool in others))
    return "\n".join(rows)


def _failed(rs: list[dict[str, float]]) -> str:
    return f"{sum(int(r.get('failed', 0)) for r in rs)}/{len(rs)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="runs per launcher (default 6)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--job", default=None, help="chameleon-run --job FILE (default: none)")
    ap.add_argument("--preset", default=None, help="chameleon-run --preset NAME")
    ap.add_argument("--load", type=int, default=0, help="busy loops beside the runs")
    ap.add_argument("--timeout", type=float, default=120,
                    help="seconds a run may take before it counts as hung (default 120)")
    ap.add_argument("--kill-at", type=int, default=None, metavar="STEP",
                    help="SIGKILL rank 1's worker once step line STEP is out; time the restart")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="also run chameleon-run from this checkout (e.g. a git worktree of an "
                         "earlier commit), as 'baseline'")
    ap.add_argument("--json", default=None, help="write every run here")
    ap.add_argument("script", nargs=argparse.REMAINDER,
                    help="the script and its arguments (default: examples/ddp_torchrun.py "
                         "--steps 120)")
    args = ap.parse_args()
    script = [a for a in args.script if a != "--"] or ["examples/ddp_torchrun.py", "--steps",
                                                       "120"]
    job = (["--job", args.job] if args.job else []) + (
        ["--preset", args.preset] if args.preset else [])
    tools = ["torchrun", "chameleon"] + (["baseline"] if args.baseline_tree else [])
    runs: dict[str, list[dict[str, float]]] = {tool: [] for tool in tools}
    with busy_loops(args.load):
        for i in range(args.runs):
            for tool in tools if i % 2 == 0 else tools[::-1]:
                r = one_run(tool, args.nproc, script, job, args.timeout, args.baseline_tree,
                            args.kill_at)
                runs[tool].append(r)
                print(f"run {i + 1}/{args.runs} {tool:<9} " + "  ".join(
                    f"{p} {r[p]:.2f}" for p in PHASES), file=sys.stderr, flush=True)
    print(table(runs))
    result = {"script": script, "nproc": args.nproc, "job": job, "load": args.load,
              "baseline_tree": args.baseline_tree,
              "loadavg": os.getloadavg(), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({tool: {p: round(_median(r[p] for r in rs), 3) for p in PHASES}
                      for tool, rs in runs.items()}))


if __name__ == "__main__":
    main()
