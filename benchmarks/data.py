"""A slow dataset costs a step nothing once the next step's micro-batches are read ahead.

The tiny byte-level GPT of examples/train_gpt.py (6 blocks, width 64, context 64, bf16, the
example's clipping and schedule) trains on 4 gloo processes under tiny-cpu's plan: pipelines
(0 1) and (2 3), 8 micro-batches of ``--micro-batch-size`` windows per step. Three trainers
live side by side in the same processes, on the same model and plan:

    instant      the example's windows, read in no time
    prefetch     the same windows, each read sleeping ``--sleep-ms`` (20 ms), read one step
                 ahead by ``--data-workers`` background threads (the runtime's default path)
    no prefetch  the slow windows read when the step needs them, in the training thread
                 (the runtime before read-ahead: the baseline)

They take turns in blocks of ``--block`` steps (the first step of each block is not counted:
its data may have been read while another trainer ran), ``--rounds`` rounds, the order of the
three rotating from round to round. A step's time is the slowest rank's ``StepResult.step_s``;
``data wait`` is the slowest rank's ``StepResult.data_s``, the time the training thread waited
for micro-batches. ``step ms``: the median over counted steps, with their spread (min - max).
``vs instant``: paired, the median over rounds of (the block's median step / the instant
block's median step of the same round) - 1, so that a load that changes during the run (a
shared machine) weighs on both sides of each ratio.

    python benchmarks/data.py
    python benchmarks/data.py --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
VARIANTS = ("instant", "prefetch", "no prefetch")


class Sleepy:
    """A dataset whose every item takes ``seconds`` to read (a slow disk or network)."""

    def __init__(self, dataset, seconds: float) -> None:
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        time.sleep(self.seconds)
        return self.dataset[index]


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _plan():
    from chameleon_elastic.plan import ExecutionPlan, Pipeline

    split = ((0, 4), (4, 8))
    return ExecutionPlan("initial", 0, (Pipeline((0, 1), split, 4),
                                        Pipeline((2, 3), split, 4))).validate()


def _worker(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from chameleon_elastic.runtime import PipelineTrainer
    from chameleon_elastic.runtime.topology import dense_rank_map

    example = _example()
    corpus = example.stdlib_corpus(400_000)
    windows = example.Windows(corpus, 64)
    plan = _plan()
    device = dense_rank_map(plan).device_of_rank[rank]
    data = {"instant": windows, "prefetch": Sleepy(windows, args["sleep_ms"] / 1e3),
            "no prefetch": Sleepy(windows, args["sleep_ms"] / 1e3)}
    trainers = {}
    for name in VARIANTS:
        model = example.gpt_model(6, 64, 64, 4, 3e-3, corpus, seed=0, warmup=5,
                                  total_steps=10_000, dataset=data[name])
        trainers[name] = PipelineTrainer(
            model, plan, device, micro_batch_size=args["micro_batch_size"], precision="bf16",
            max_grad_norm=1.0, prefetch=name != "no prefetch",
            data_workers=args["data_workers"])
    out: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in VARIANTS}
    for r in range(args["rounds"]):
        for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            trainer, block = trainers[name], []
            for i in range(args["block"]):
                result = trainer.step(trainer.committed)
                if i:
                    block.append((result.step_s, result.data_s))
            out[name].append(block)
    for trainer in trainers.values():
        trainer.close()
    dist.barrier()
    return out


def measure(args: argparse.Namespace) -> dict:
    from chameleon_elastic.runtime.world.local_world import run_local_world

    options = {"sleep_ms": args.sleep_ms, "micro_batch_size": args.micro_batch_size,
               "data_workers": args.data_workers, "rounds": args.rounds, "block": args.block}
    per_rank = run_local_world(_worker, 4, options, timeout_s=args.timeout)
    def slowest(name: str, k: int) -> list[list[float]]:
        """Per round, per counted step: the slowest rank's figure ``k``."""
        return [[max(rank[name][r][i][k] for rank in per_rank)
                 for i in range(len(per_rank[0][name][r]))]
                for r in range(len(per_rank[0][name]))]

    rows = {}
    instant = [statistics.median(block) for block in slowest("instant", 0)]
    for name in VARIANTS:
        blocks = slowest(name, 0)
        steps = [x for block in blocks for x in block]
        waits = [x for block in slowest(name, 1) for x in block]
        ratios = [statistics.median(block) / base for block, base in zip(blocks, instant)]
        rows[name] = {"step_s": statistics.median(steps), "step_min_s": min(steps),
                      "step_max_s": max(steps), "data_wait_s": statistics.median(waits),
                      "steps": len(steps), "vs_instant": statistics.median(ratios) - 1,
                      "round_ratios": ratios}
    return {"config": options, "rows": rows,
            "prefetch_within_10pct": rows["prefetch"]["vs_instant"] <= 0.10}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="read time per sample")
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="windows per micro-batch (tiny-cpu's is 1)")
    ap.add_argument("--data-workers", type=int, default=1,
                    help="background reader threads of the prefetch trainer")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=6, help="steps per turn (the first not counted)")
    ap.add_argument("--timeout", type=float, default=500.0, help="seconds for the whole run")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    for name in ("micro_batch_size", "data_workers", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.block < 2 or args.sleep_ms < 0:
        ap.error("--block must be >= 2 and --sleep-ms >= 0")
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tiny GPT, 4 gloo processes, pipelines (0 1) (2 3), 8 micro-batches of "
          f"{args.micro_batch_size}; slow dataset: {args.sleep_ms:.0f} ms per sample; "
          f"{result['rows']['instant']['steps']} counted steps each")
    print(f"{'dataset':<12} {'step ms':>8} {'min-max ms':>14} {'data wait ms':>13} "
          f"{'vs instant':>11}")
    for name, row in result["rows"].items():
        spread = f"{row['step_min_s'] * 1e3:.0f}-{row['step_max_s'] * 1e3:.0f}"
        print(f"{name:<12} {row['step_s'] * 1e3:8.1f} {spread:>14} "
              f"{row['data_wait_s'] * 1e3:13.1f} {row['vs_instant']:+10.1%}")
    print("prefetch within 10% of instant:", "yes" if result["prefetch_within_10pct"] else "no")
    return 0


if __name__ == "__main__":
    sys.exit(main())
