"""Planner decision latency at 8..16384 devices, beside the paper's measured search latency.

For each scale: the cold search (a re-plan for one lost device with every memo cleared: what a
failure costs without the cache), the time to warm the cache for every loss of one device (done
in the background during fault-free training), and the cached lookup (what a failure costs with
it), plus the full cached decision (cached re-plan + fresh reroute + scoring).

Then, each in a fresh process (``--trials`` per scale, medians): the decision a failure costs
without a plan cache (``search.decide``, reroute and re-plan priced, every planning memo cleared
after the initial plan: "cold"; the same call again: "warm"), and the re-plan placed
(``search.replan``: search, assignment, weight sources), wall clock and CPU time of the
process (the CPU time is what an idle core would take; wall time on a shared machine waits
for the others). ``--baseline-tree DIR`` runs the same fresh processes on another checkout
(e.g. ``git worktree add /tmp/base main``), alternating with this one, trial by trial.

Targets: cold decision <= 0.1 s at 16384 devices (issue 27); cold search <= 1 s at 2048
devices, cached lookup <= 1 ms.
Paper (Chameleon, INFOCOM): <= 1.152 s up to 256 devices, 19.25 s at 1024, 40.48 s at 2048.

    python benchmarks/planner_latency.py [--json] [--scales 8,32,256,1024,2048,4096,16384]
        [--trials 5] [--baseline-tree DIR] [--no-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from chameleon_elastic.console import make_console
from chameleon_elastic.planning import PlanCache, initial_plan, search
from chameleon_elastic.spec import JobSpec, TrainingSpec

PAPER_S = {8: 1.152, 32: 1.152, 256: 1.152, 1024: 19.25, 2048: 40.48}
TARGET_DEVICES, TARGET_COLD_DECISION_S = 16384, 0.1
FRESH = ("cold_decide", "warm_decide", "cold_replan", "warm_replan")


def spec_for(devices: int) -> JobSpec:
    """The paper's Llama-2-7B figures on ``devices`` NPUs: pp = 4, dp = devices / 4, two
    micro-batches per pipeline."""
    base = JobSpec.preset("llama2-7b-910b")
    dp = devices // 4
    return replace(
        base,
        name=f"llama2-7b-910b-x{devices}",
        cluster=replace(base.cluster, devices=devices),
        training=TrainingSpec(dp=dp, pp=4, global_micro_batches=2 * dp),
    )


def clear_memos() -> None:
    """Every memo of the planner's modules (whichever this checkout has)."""
    for name, module in list(sys.modules.items()):
        if name.startswith(("chameleon_elastic.planning", "chameleon_elastic.spec")):
            for value in list(vars(module).values()):
                if hasattr(value, "cache_clear"):
                    value.cache_clear()


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(devices: int) -> dict:
    spec = spec_for(devices)
    plan = initial_plan(spec)
    victim = plan.pipelines[len(plan.pipelines) // 2].devices[1]
    clear_memos()
    cold_s, fresh = timed(lambda: search.replan(spec, plan, [victim]))
    cache = PlanCache(spec, plan, depth=1)
    clear_memos()
    warm_s, classes = timed(cache.warm)
    lookup_s, cached = timed(lambda: cache.lookup([victim]), repeat=50)
    decide_s, decision = timed(lambda: cache.decide([victim]), repeat=5)
    return {
        "devices": devices,
        "cold_search_s": cold_s,
        "cache_warm_s": warm_s,
        "cache_classes": classes,
        "cached_lookup_s": lookup_s,
        "cached_decide_s": decide_s,
        "paper_search_s": PAPER_S.get(devices),
        "chosen": decision.chosen.policy,
        "layout": sorted({p.num_stages for p in fresh.pipelines}),
        "same_as_cold": cached.estimate.step_time_s == fresh.estimate.step_time_s,
    }


def fresh_trial(devices: int) -> dict[str, tuple[float, float]]:
    """One trial in this (fresh) process: (wall s, CPU s) of each of ``FRESH``."""
    spec = spec_for(devices)
    plan = initial_plan(spec)
    victim = plan.pipelines[len(plan.pipelines) // 2].devices[1]
    out = {}
    for name, fn in (("decide", lambda: search.decide(spec, plan, [victim])),
                     ("replan", lambda: search.replan(spec, plan, [victim]))):
        clear_memos()
        for temperature in ("cold", "warm"):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            out[f"{temperature}_{name}"] = (time.perf_counter() - wall, time.process_time() - cpu)
    return out


def fresh_trials(devices: int, trials: int, baseline: str | None) -> dict[str, dict]:
    """``trials`` fresh processes on this checkout (and on ``baseline``), alternating."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {"after": here, **({"before": baseline} if baseline else {})}
    got: dict[str, list[dict]] = {tree: [] for tree in trees}
    for _ in range(trials):
        for tree, root in trees.items():
            env = {**os.environ, "PYTHONPATH": root}
            run = subprocess.run([sys.executable, __file__, "--fresh-trial", str(devices)],
                                 env=env, capture_output=True, text=True, timeout=600, cwd=root,
                                 check=False)
            if run.returncode:
                raise SystemExit(f"the {tree} trial at {devices} devices failed:\n{run.stderr}")
            got[tree].append(json.loads(run.stdout))
    summary: dict[str, dict] = {}
    for tree, runs in got.items():
        summary[tree] = {}
        for key in FRESH:
            for i, clock in enumerate(("wall", "cpu")):
                values = [r[key][i] for r in runs]
                summary[tree][f"{key}_{clock}_s"] = statistics.median(values)
                summary[tree][f"{key}_{clock}_range_s"] = (min(values), max(values))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--scales", default="8,32,256,1024,2048,4096,16384",
                        help="comma-separated device counts (default 8,32,256,1024,2048,4096,"
                             "16384)")
    parser.add_argument("--trials", type=int, default=5,
                        help="fresh processes per scale (and per tree) for the decision timings")
    parser.add_argument("--baseline-tree", metavar="DIR",
                        help="another checkout to time the same way, alternating (before/after)")
    parser.add_argument("--no-cache", action="store_true",
                        help="skip the plan cache columns (warming it takes seconds at 16k)")
    parser.add_argument("--fresh-trial", type=int, metavar="DEVICES", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fresh_trial:
        json.dump(fresh_trial(args.fresh_trial), sys.stdout)
        return 0
    if args.baseline_tree and not (Path(args.baseline_tree) / "chameleon_elastic").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree} holds no chameleon_elastic package; "
                     "give the root of another checkout (git worktree add DIR main).")
    from rich.table import Table

    console = make_console(stderr=args.json)
    rows = []
    for n in (int(x) for x in args.scales.split(",")):
        with console.status(f"planning for {n} devices"):
            row = {"devices": n} if args.no_cache else measure(n)
            row["fresh"] = fresh_trials(n, args.trials, args.baseline_tree)
            rows.append(row)
    target = next((r for r in rows if r["devices"] == TARGET_DEVICES), None)
    verdict = None if target is None else {
        "devices": TARGET_DEVICES, "target_s": TARGET_COLD_DECISION_S,
        "cold_decide_wall_s": target["fresh"]["after"]["cold_decide_wall_s"],
        "cold_decide_cpu_s": target["fresh"]["after"]["cold_decide_cpu_s"],
        "met_wall": target["fresh"]["after"]["cold_decide_wall_s"] <= TARGET_COLD_DECISION_S,
        "met_cpu": target["fresh"]["after"]["cold_decide_cpu_s"] <= TARGET_COLD_DECISION_S}
    if args.json:
        json.dump({"benchmark": "planner_latency", "trials": args.trials,
                   "baseline_tree": args.baseline_tree, "target": verdict, "rows": rows},
                  sys.stdout, indent=2)
        print()
        return 0
    print_fresh(console, rows, args.trials, verdict)
    if args.no_cache:
        return 0
    table = Table(title="planner decision latency (one lost device)")
    for col in ("devices", "cold search", "paper search", "cache warm", "classes",
                "cached lookup", "cached decide", "chosen"):
        table.add_column(col, justify="right")
    for r in rows:
        paper = "-" if r["paper_search_s"] is None else f"{r['paper_search_s']:.3f} s"
        table.add_row(str(r["devices"]), f"{r['cold_search_s']:.3f} s", paper,
                      f"{r['cache_warm_s']:.3f} s", str(r["cache_classes"]),
                      f"{r['cached_lookup_s'] * 1e3:.3f} ms", f"{r['cached_decide_s'] * 1e3:.1f} ms",
                      r["chosen"])
    console.print(table)
    return 0


def print_fresh(console, rows: list[dict], trials: int, verdict: dict | None) -> None:
    from rich.table import Table

    table = Table(title=f"decision without a plan cache, fresh processes (median of {trials}; "
                        "wall / CPU)")
    table.add_column("devices", justify="right")
    table.add_column("tree")
    for key in FRESH:
        table.add_column(key.replace("_", " "), justify="right")
    for r in rows:
        for tree, got in r["fresh"].items():
            table.add_row(str(r["devices"]), tree, *(
                f"{got[f'{k}_wall_s'] * 1e3:.0f} / {got[f'{k}_cpu_s'] * 1e3:.0f} ms" for k in FRESH))
    console.print(table)
    if verdict is not None:
        console.print(
            f"target: cold decision at {verdict['devices']} devices <= "
            f"{verdict['target_s']} s: wall {verdict['cold_decide_wall_s']:.3f} s "
            f"({'met' if verdict['met_wall'] else 'NOT met'}), CPU "
            f"{verdict['cold_decide_cpu_s']:.3f} s ({'met' if verdict['met_cpu'] else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
