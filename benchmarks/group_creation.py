"""How long a plan's process groups take to make: ``new_group`` per rank set (what gloo uses)
against ``split_group`` per round of disjoint sets (what nccl2 uses), on gloo, real processes.

The sets are those of a plan of 2 pipelines x 2 stages x tensor-parallel units of 2 cards
(8 ranks; 4 ranks: 2 x 1 x 2): the units, the data-parallel sets of each stage's cards, and one
overlapping tie. Each rank builds and destroys the table ``--repeats`` times, the two methods
alternating, after one warm-up of each; the figure is the median over repeats of the slowest
rank's time. ``split_group`` cannot split a CPU world before torch 2.15: there only
``new_group`` is measured.

    python benchmarks/group_creation.py [--worlds 4,8] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def plan_sets(world: int) -> list[tuple[int, ...]]:
    """Units of 2 cards, the data-parallel sets of each stage's cards, and a tie over the first
    card of every unit (overlapping the data-parallel sets)."""
    units = [(r, r + 1) for r in range(0, world, 2)]
    pipelines = 2
    per_pipeline = world // pipelines
    data_parallel = [tuple(p * per_pipeline + c for p in range(pipelines))
                     for c in range(per_pipeline)]
    tie = tuple(range(0, world, 2))
    return sorted(set(units + data_parallel + [tie]))


def _timed(rank: int, world: int, repeats: int, methods: list) -> dict[str, list[float]]:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_elastic.runtime.groups import GroupTable

    sets = plan_sets(world)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for i in range(repeats + 1):
        for method in methods:
            dist.barrier()
            began = time.perf_counter()
            table = GroupTable(sets, timeout=timedelta(seconds=60), method=method)
            took = time.perf_counter() - began
            table.destroy()
            if i:   # the first round warms up
                times[method].append(took)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from chameleon_elastic import torch_compat
    from chameleon_elastic.runtime.groups import disjoint_rounds
    from chameleon_elastic.runtime.local_world import run_local_world

    methods = ["new_group"] + (["split_group"] if torch_compat.split_group_on_cpu() else [])
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"  {world} ranks: {', '.join(methods)} x {args.repeats}", file=sys.stderr,
              flush=True)
        per_rank = run_local_world(_timed, world, args.repeats, methods, timeout_s=600)
        sets = plan_sets(world)
        for method in methods:
            slowest = [max(r[method][i] for r in per_rank) for i in range(args.repeats)]
            calls = len(sets) if method == "new_group" else len(disjoint_rounds(sets))
            rows.append({"world": world, "method": method, "sets": len(sets), "calls": calls,
                         "median_ms": statistics.median(slowest) * 1e3})
    if args.json:
        print(json.dumps({"benchmark": "group_creation", "torch": torch.__version__,
                          "rows": rows}, indent=2))
        return 0
    print(f"group_creation: torch {torch.__version__}, gloo, median of {args.repeats} "
          "(slowest rank)")
    print(f"{'ranks':>5}  {'method':<11}  {'sets':>4}  {'calls':>5}  {'ms':>8}")
    for row in rows:
        print(f"{row['world']:>5}  {row['method']:<11}  {row['sets']:>4}  {row['calls']:>5}  "
              f"{row['median_ms']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
