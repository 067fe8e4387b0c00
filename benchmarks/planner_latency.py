"""Planner decision latency at 8..2048 devices, beside the paper's measured search latency.

For each scale: the cold search (a re-plan for one lost device with every memo cleared: what a
failure costs without the cache), the time to warm the cache for every loss of one device (done
in the background during fault-free training), and the cached lookup (what a failure costs with
it), plus the full cached decision (cached re-plan + fresh reroute + scoring).

Targets: cold <= 1 s at 2048 devices, cached lookup <= 1 ms.
Paper (Chameleon, INFOCOM): <= 1.152 s up to 256 devices, 19.25 s at 1024, 40.48 s at 2048.

    python benchmarks/planner_latency.py [--json] [--scales 8,32,256,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from chameleon_elastic.console import make_console
from chameleon_elastic.planning import PlanCache, estimator, initial_plan, search
from chameleon_elastic.spec import JobSpec, TrainingSpec

PAPER_S = {8: 1.152, 32: 1.152, 256: 1.152, 1024: 19.25, 2048: 40.48}


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
    for module in (search, estimator):
        for value in vars(module).values():
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--scales", default="8,32,256,1024,2048",
                        help="comma-separated device counts (default 8,32,256,1024,2048)")
    args = parser.parse_args(argv)
    from rich.table import Table

    console = make_console(stderr=args.json)
    rows = []
    for n in (int(x) for x in args.scales.split(",")):
        with console.status(f"planning for {n} devices"):
            rows.append(measure(n))
    if args.json:
        json.dump({"benchmark": "planner_latency", "rows": rows}, sys.stdout, indent=2)
        print()
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


if __name__ == "__main__":
    sys.exit(main())
