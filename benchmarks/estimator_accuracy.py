"""Measured step time of the runtime vs the planner's estimate, for the plans of a failure.

    python benchmarks/estimator_accuracy.py [--layers 8] [--forward-ms 10] [--steps 6] [--json]
                                            [--compute emulated|cpu]

What is measured. One job (dp=4 x pp=2 on 8 devices, 8 micro-batches of 1 sample) and the
plans the planner itself makes for it: the initial symmetric plan, a re-plan and a reroute after
device 7 fails, a re-plan after devices 3 and 7 fail, plus the paper's asymmetric example
(7 devices as pipelines of 2, 2 and 3 stages, batch and layers split by the planner's rules).
Then the same job with activation recomputation (``planner.recompute = "always"``: every stage
reruns its forward before its backward), once in fp32 and once trained in bf16 (autocast;
profiled at bf16, ``training.precision = "bf16"``), and the rerouted plan recomputing. For each
plan a real gloo world (one process per working device) trains with ``PipelineTrainer``; the
step time of a step is the slowest rank's, and the table shows the median over ``--steps`` steps
after one warm-up step.

What is estimated. The layers are profiled first with the runtime's profiler
(``runtime.profiler.profile_layers``: median forward/backward time of one micro-batch per
layer, bytes), the all-reduce bandwidth is measured with a gloo all-reduce in a 2-rank world,
and both go into a JobSpec; ``planning.estimator.step_time(spec, plan)`` is the estimate.

Emulated devices (the default). This machine has 2 CPU cores shared with other jobs, while the
plans run 6 to 8 devices at once; compute-bound CPU layers would time-share the cores and no
pipeline parallelism would be measurable. So each layer is an ``EmulatedLayer``: its forward
and backward occupy the "device" for a fixed wall time (a sleep, like a kernel on an
accelerator) around a tiny Linear+tanh. Everything else is real: processes, gloo p2p transfers
and all-reduces, autograd, the optimizer, the runtime's scheduling overhead. ``--compute cpu``
uses real matmul layers instead, to show how far off a core-starved machine is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from chameleon_elastic.models.toy import emulated_model, mlp_model
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.planning import decide, initial_plan
from chameleon_elastic.planning.candidates import distribute_batches
from chameleon_elastic.planning.estimator import allreduce_time, compute_time, step_time
from chameleon_elastic.planning.layer_splits import split_layers
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.execution.layout import plan_rounds
from chameleon_elastic.runtime.profiler import profile_layers
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world
from chameleon_elastic.spec import JobSpec


def make_model(args: argparse.Namespace):
    if args.compute == "cpu":
        return mlp_model(layers=args.layers, width=args.width, dtype=torch.float32)
    return emulated_model(args.layers, args.forward_ms / 1e3, 2 * args.forward_ms / 1e3)


def _bandwidth(rank: int, world: int, nbytes: int, repeats: int) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    dist.all_reduce(buf)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return 2 * (world - 1) / world * nbytes / statistics.median(times)


def _train(rank: int, world: int, plan_json: str, args: argparse.Namespace,
           precision: str) -> list[float]:
    plan = ExecutionPlan.from_json(plan_json)
    device = dense_rank_map(plan).device_of_rank[rank]
    trainer = PipelineTrainer(make_model(args), plan, device, precision=precision)
    times = [trainer.step(t).step_s for t in range(1 + args.steps)]
    trainer.close()
    return times[1:]


def job_spec(args: argparse.Namespace, bandwidth: float, precision: str = "fp32",
             recompute: str = "auto") -> JobSpec:
    # profile as the workers train: one thread each (run_local_world sets OMP_NUM_THREADS=1);
    # with a thread pool, bf16 kernels after an emulated layer's sleep pay ~1 ms to wake it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile = profile_layers(make_model(args), repeats=5, precision=precision)
    finally:
        torch.set_num_threads(threads)
    model = profile.model.table()   # measured [model] figures, named as the spec's keys
    model["precision"] = precision
    return JobSpec.from_dict({
        "name": "estimator-accuracy",
        "model": model,
        "cluster": {"devices": 8, "device_memory_bytes": 64e9, "bandwidth_bytes_per_s": bandwidth,
                    "restart_s": 1.0, "failure_rate_per_hour": 0.1},
        "training": {"dp": 4, "pp": 2, "global_micro_batches": 8, "micro_batch_size": 1,
                     "precision": precision},
        "planner": {"recompute": recompute},
    })


def plans(spec: JobSpec) -> list[tuple[str, ExecutionPlan]]:
    first = initial_plan(spec)
    out = [("initial 4x2", first)]
    for name, failed, policy in (("replan, 7 lost", [7], "replan"),
                                 ("reroute, 7 lost", [7], "reroute"),
                                 ("replan, 3+7 lost", [3, 7], "replan")):
        out.append((name, decide(spec, first, failed=failed, policy=policy).chosen))
    # the paper's example layout: 7 devices as pipelines of 2, 2 and 3 stages, with the
    # planner's batch distribution and layer split (the search may prefer another layout)
    lengths = (2, 2, 3)
    quotas = distribute_batches(lengths, spec.training.global_micro_batches)
    pipes, devices = [], iter(range(7))
    for n, quota in zip(lengths, quotas):
        layers = split_layers(spec, n, quota)
        pipes.append(Pipeline(tuple(next(devices) for _ in range(n)), layers, quota))
    out.append(("replan 2+2+3", ExecutionPlan("replan", 1, tuple(pipes)).validate()))
    # hand-built plans carry no rounds; the planner's always do
    return [(n, p if p.allreduce_rounds else dataclasses.replace(p, allreduce_rounds=plan_rounds(p)))
            for n, p in out]


def describe(plan: ExecutionPlan) -> str:
    shape = "+".join(str(p.num_stages) for p in plan.pipelines)
    quotas = "/".join(str(p.micro_batches) for p in plan.pipelines)
    recompute = sum(f for p in plan.pipelines for f in p.recompute)
    return f"{shape} stages, mb {quotas}" + (f", {recompute} recompute" if recompute else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--forward-ms", type=float, default=10.0,
                    help="emulated forward time per layer (backward is twice that)")
    ap.add_argument("--width", type=int, default=256, help="layer width for --compute cpu")
    ap.add_argument("--compute", choices=("emulated", "cpu"), default="emulated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.layers < 3 or args.steps < 1:
        ap.error("--layers must be >= 3 (a 3-stage pipeline needs 3 layers) and --steps >= 1")

    bandwidth = run_local_world(_bandwidth, 2, 4 << 20, 5, timeout_s=120)[0]
    base = job_spec(args, bandwidth)
    cases = [(name, base, plan) for name, plan in plans(base)]
    for precision in ("fp32", "bf16"):
        again = job_spec(args, bandwidth, precision, recompute="always")
        first = initial_plan(again)
        assert all(all(p.recompute) for p in first.pipelines)
        cases.append((f"recompute {precision}", again, first))
    again = job_spec(args, bandwidth, recompute="always")
    cases.append(("recompute reroute", again,
                  decide(again, initial_plan(again), failed=[7], policy="reroute").chosen))
    rows = []
    for name, spec, plan in cases:
        precision = spec.training.precision
        per_rank = run_local_world(_train, len(plan.working_devices), plan.to_json(), args,
                                   precision, timeout_s=300, collective_timeout_s=120)
        measured = statistics.median(max(step) for step in zip(*per_rank))
        estimate = step_time(spec, plan)
        rows.append({
            "plan": name, "layout": describe(plan), "workers": len(plan.working_devices),
            "estimate_s": estimate, "estimate_compute_s": compute_time(spec, plan),
            "estimate_allreduce_s": allreduce_time(spec, plan), "measured_s": measured,
            "error_pct": 100.0 * (estimate - measured) / measured,
        })
    result = {"compute": args.compute, "layers": args.layers, "forward_ms": args.forward_ms,
              "steps": args.steps, "bandwidth_bytes_per_s": bandwidth,
              "profile_forward_s": list(base.model.forward_s),
              "profile_backward_s": list(base.model.backward_s), "rows": rows,
              "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"estimator accuracy ({args.compute} compute, {args.layers} layers, "
          f"median of {args.steps} steps; gloo all-reduce bandwidth {bandwidth / 1e6:.0f} MB/s)")
    head = f"{'plan':<18} {'layout':<38} {'workers':>7} {'estimate s':>11} {'measured s':>11} "
    print(head + f"{'error':>8}")
    for r in rows:
        print(f"{r['plan']:<18} {r['layout']:<38} {r['workers']:>7} {r['estimate_s']:>11.4f} "
              f"{r['measured_s']:>11.4f} {r['error_pct']:>+7.1f}%")
    print(f"max |error| = {result['max_abs_error_pct']:.1f}%  (target <= 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
