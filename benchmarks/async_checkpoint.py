"""Training steps while a checkpoint is written in the background, against a synchronous save.

    python benchmarks/async_checkpoint.py [--param-mb 16] [--trials 4] [--json]

One world of 4 gloo workers (pipelines [2, 2]) trains 8 emulated-compute layers (10 ms
forward, 20 ms backward as sleeps, see estimator_accuracy.py for why: on an accelerator the
host's cores are free during a step, as they are here) each carrying ``--param-mb`` MB of
float32 parameters, and saves DCP checkpoints into a temporary directory. Per trial, in the
same processes:

- ``none``: steps without any save (the baseline);
- ``async``: the step after which ``trainer.run`` would save, plus the copy of the state that
  starts a background save (``BackgroundSave.start``: what the training thread pays), then
  steps until every rank's save has ended (the steps that overlap the disk writes);
- ``sync``: the same step followed by ``save_checkpoint``, which returns once the checkpoint is
  committed (what the training thread paid before saves went to the background).

Step times are wall times around ``trainer.step`` on rank 0 (the vote makes every rank end a
step together); medians over trials, each trial's order alternating so load from other jobs on
this shared machine hits every mode alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from chameleon_elastic.models.toy import emulated_model
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.runtime import PipelineTrainer, save_checkpoint
from chameleon_elastic.runtime.state.background_save import BackgroundSave
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world


def plan() -> ExecutionPlan:
    return ExecutionPlan("initial", 0, (
        Pipeline((0, 1), ((0, 4), (4, 8)), 4), Pipeline((2, 3), ((0, 4), (4, 8)), 4))).validate()


def _timed_step(trainer: PipelineTrainer) -> float:
    began = time.perf_counter()
    trainer.step(trainer.committed)
    return time.perf_counter() - began


def _everyone_done(saving: BackgroundSave) -> bool:
    flag = torch.tensor([1 if saving.done() else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _trial(trainer: PipelineTrainer, directory: str, baseline_steps: int,
           order: tuple[str, ...]) -> dict:
    out: dict = {"none": [], "during": [], "async_start": None, "sync": None, "overlapped": 0}
    for mode in order:
        if mode == "none":
            out["none"] += [_timed_step(trainer) for _ in range(baseline_steps)]
        elif mode == "async":
            began = time.perf_counter()
            trainer.step(trainer.committed)
            trainer.saving = BackgroundSave.start(trainer, directory, trainer.committed)
            out["async_start"] = time.perf_counter() - began
            while not _everyone_done(trainer.saving):
                out["during"].append(_timed_step(trainer))
            out["overlapped"] = len(out["during"])
            trainer.saving.settle()
        else:
            began = time.perf_counter()
            trainer.step(trainer.committed)
            save_checkpoint(trainer, directory, trainer.committed)
            out["sync"] = time.perf_counter() - began
    return out


def _run(rank: int, world: int, args: argparse.Namespace, directory: str) -> list[dict]:
    p = plan()
    model = emulated_model(8, 0.010, 0.020, params=int(args.param_mb * 2**20 / 4))
    trainer = PipelineTrainer(model, p, dense_rank_map(p).device_of_rank[rank],
                              micro_batch_size=1)
    _timed_step(trainer)   # warm-up
    trials = []
    modes = ("none", "async", "sync")
    for i in range(args.trials):
        trials.append(_trial(trainer, directory, args.baseline_steps,
                             modes if i % 2 == 0 else tuple(reversed(modes))))
    trainer.close()
    return trials


def summarize(trials: list[dict]) -> dict:
    none = statistics.median(s for t in trials for s in t["none"])
    during = [s for t in trials for s in t["during"]]
    starts = [t["async_start"] for t in trials]
    syncs = [t["sync"] for t in trials]
    med = statistics.median
    return {
        "step_s": none,
        "step_during_async_s": med(during) if during else None,
        "async_ratio": med(during) / none if during else None,
        "async_ratio_spread": [min(during) / none, max(during) / none] if during else None,
        "steps_overlapping_save": [t["overlapped"] for t in trials],
        "async_start_step_s": med(starts),
        "async_start_ratio": med(starts) / none,
        "sync_step_s": med(syncs),
        "sync_ratio": med(syncs) / none,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--param-mb", type=float, default=16.0, help="parameters per layer, MB")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--baseline-steps", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chameleon-ckpt-bench-") as directory:
        trials = run_local_world(_run, 4, args, directory, timeout_s=600)[0]
    result = {"param_mb_per_layer": args.param_mb, "layers": 8, "trials": args.trials,
              **summarize(trials)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    r = result
    print(f"8 layers x {args.param_mb:g} MB, 4 workers (pipelines [2, 2]), {args.trials} "
          "trials, medians")
    print(f"{'':34s}{'step s':>10s}{'x no save':>11s}")
    print(f"{'no save':34s}{r['step_s']:10.4f}{1.0:11.2f}")
    if r["step_during_async_s"] is not None:
        lo, hi = r["async_ratio_spread"]
        print(f"{'step during a background save':34s}{r['step_during_async_s']:10.4f}"
              f"{r['async_ratio']:11.2f}   (range {lo:.2f}-{hi:.2f}, "
              f"{sum(r['steps_overlapping_save'])} steps)")
    print(f"{'step that starts it (state copy)':34s}{r['async_start_step_s']:10.4f}"
          f"{r['async_start_ratio']:11.2f}")
    print(f"{'step + synchronous save':34s}{r['sync_step_s']:10.4f}{r['sync_ratio']:11.2f}")
    ok = r["async_ratio"] is not None and r["async_ratio"] <= 1.1
    print(f"step during a background save <= 1.1x a step without one: {'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
