"""Gradient sync by colour rounds vs one serial all-reduce per layer, on an asymmetric plan.

    python benchmarks/allreduce_rounds.py [--param-mb 2] [--steps 8] [--json]

After an asymmetric re-plan (the paper's example: 7 devices as pipelines of 2, 2 and 3 stages)
a layer's replicas sit at different stages of different pipelines, so gradients are summed per
holder set. Two ways, both real gloo all-reduces over exactly the holders, in one world:

- ``rounds`` (ours, the paper's): layers with identical holder sets form one bucket (one
  flattened all-reduce); buckets are coloured so no device is in two buckets of a round; the
  buckets of a round run concurrently on disjoint devices (``plan.allreduce_rounds``).
- ``serial``: one blocking all-reduce per layer, in layer order, on every device.

Each layer is an emulated-compute layer (fixed 2 ms forward / 4 ms backward as sleeps, see
estimator_accuracy.py for why) carrying ``--param-mb`` MB of float32 parameters, so the
gradient sync moves a realistic amount of data while compute stays out of the way. Both
trainers live in the same 7 processes and alternate step by step, so load from other jobs on
this shared machine hits both alike. Reported: median over steps of the step time (slowest
rank) and of the sync phase (slowest rank's time from the end of its pipeline work to the end
of its last all-reduce), and the all-reduce calls per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from chameleon_elastic.models.toy import emulated_model
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.execution.layout import plan_rounds
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

MODES = ("serial", "rounds")


def asymmetric_plan(layers: int, global_micro_batches: int) -> ExecutionPlan:
    """Pipelines of 2, 2 and 3 stages on devices 0..6; quotas in proportion to length."""
    half = layers // 2
    third = [layers // 3 + (1 if i < layers % 3 else 0) for i in range(3)]
    b3 = [0, third[0], third[0] + third[1], layers]
    two = ((0, half), (half, layers))
    three = ((b3[0], b3[1]), (b3[1], b3[2]), (b3[2], b3[3]))
    q3 = round(global_micro_batches * 3 / 7)
    q2 = (global_micro_batches - q3) // 2
    quotas = (global_micro_batches - q3 - q2, q2, q3)
    plan = ExecutionPlan("replan", 1, (Pipeline((0, 1), two, quotas[0]),
                                      Pipeline((2, 3), two, quotas[1]),
                                      Pipeline((4, 5, 6), three, quotas[2]))).validate()
    return dataclasses.replace(plan, allreduce_rounds=plan_rounds(plan))


def _run(rank: int, world: int, plan_json: str, args: argparse.Namespace):
    plan = ExecutionPlan.from_json(plan_json)
    device = dense_rank_map(plan).device_of_rank[rank]
    model = emulated_model(args.layers, 0.002, 0.004, params=int(args.param_mb * 2**20 / 4))
    trainers = {m: PipelineTrainer(model, plan, device, sync_mode=m) for m in MODES}
    out: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
    for step in range(1 + args.steps):
        for mode in MODES if step % 2 else reversed(MODES):
            r = trainers[mode].step(step)
            if step:
                out[mode].append((r.step_s, r.sync_s, r.allreduces))
    for t in trainers.values():
        t.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--param-mb", type=float, default=2.0, help="parameters per layer, MB")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.layers < 3 or args.steps < 1 or args.micro_batches < 3 or args.param_mb <= 0:
        ap.error("need --layers >= 3, --steps >= 1, --micro-batches >= 3, --param-mb > 0")
    plan = asymmetric_plan(args.layers, args.micro_batches)
    per_rank = run_local_world(_run, 7, plan.to_json(), args, timeout_s=540,
                               collective_timeout_s=240)
    rows = {}
    for mode in MODES:
        steps = list(zip(*(r[mode] for r in per_rank)))  # per step: one tuple per rank
        rows[mode] = {
            "step_s": statistics.median(max(x[0] for x in s) for s in steps),
            "sync_s": statistics.median(max(x[1] for x in s) for s in steps),
            "allreduces_per_step": sum(x[2] for x in steps[0]),
        }
    base, ours = rows["serial"], rows["rounds"]
    result = {
        "plan": [p.to_dict() for p in plan.pipelines],
        "rounds": [[g.to_dict() for g in rnd] for rnd in plan.allreduce_rounds],
        "param_mb_per_layer": args.param_mb, "steps": args.steps, "modes": rows,
        "step_change_pct": 100.0 * (ours["step_s"] - base["step_s"]) / base["step_s"],
        "sync_change_pct": 100.0 * (ours["sync_s"] - base["sync_s"]) / base["sync_s"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"gradient sync on pipelines 2+2+3 (7 gloo workers, {args.layers} layers x "
          f"{args.param_mb:g} MB, {len(plan.allreduce_rounds)} colour rounds, median of "
          f"{args.steps} steps)")
    print(f"{'mode':<8} {'calls/step (all ranks)':>22} {'sync s':>9} {'step s':>9}")
    for mode in MODES:
        r = rows[mode]
        print(f"{mode:<8} {r['allreduces_per_step']:>22} {r['sync_s']:>9.4f} {r['step_s']:>9.4f}")
    print(f"rounds vs serial: sync {result['sync_change_pct']:+.1f}%, "
          f"step {result['step_change_pct']:+.1f}%  (paper: step -5.5% to -15.4%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
