"""Fault-free step time of the runtime against torch's own tools, on the same model, in one run.

    python benchmarks/faultfree.py [--steps 12] [--cases issue27 comm-heavy tiny-gpt]
                                   [--plans dp2 pp2 pp2xdp2] [--launcher-rounds 2] [--json]

For each case (a model) and plan, one local gloo world (``run_local_world``) builds both the
runtime's ``PipelineTrainer`` and torch's tool on the same layers (same seeds: the same
weights) and trains them step by step, alternating which goes first; every step starts and
ends at a barrier. Its ratio is the runtime's step over the adjacent native step (paired:
load from other jobs on this shared machine hits both alike); the verdict is the median of the
ratios. Both see the same samples (the runtime's ``Feed``), fp32, AdamW, the whole
model's gradient norm clipped to 1 (the runtime's ``max_grad_norm``; torch's
``clip_grad_norm_`` under DDP, and across stages for the pipelines: each stage's squared norm
summed over the pipeline's group); the step-0 losses must agree (rtol 1e-5: only the order of
fp32 sums differs) or the run fails.

Plans and their torch baseline:

- ``dp2``: 2 single-stage pipelines against ``DistributedDataParallel`` (micro-batches under
  ``no_sync`` but the last);
- ``pp2``: one pipeline of 2 stages against ``torch.distributed.pipelining.Schedule1F1B``;
- ``pp2xdp2``: 2 pipelines of 2 stages against Schedule1F1B over DDP-wrapped stages.

Cases: ``issue27`` (the GPT example's model, 8 blocks of width 256, the model issue 27 measured),
``comm-heavy`` (2 blocks of width 1024 and short context: the gradient sum is a large part of
the backward; the table prints the measured share), ``tiny-gpt`` (the example's defaults).

The launcher row (``--launcher-rounds`` > 0): ``examples/train_hf.py`` (a tiny random Llama,
data parallel over 2 workers, fp32) under ``chameleon-run --job`` against the same script under
plain ``torchrun``, alternating runs; per run the median step interval, the verdict the median
of the per-round ratios. Every worker runs one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import itertools

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.03
MAX_GRAD_NORM = 1.0
CASES = {
    "issue27": {"blocks": 8, "width": 256, "heads": 4, "context": 16, "mbs": 2, "G": 4},
    "comm-heavy": {"blocks": 2, "width": 1024, "heads": 8, "context": 2, "mbs": 1, "G": 4},
    "tiny-gpt": {"blocks": 6, "width": 64, "heads": 4, "context": 64, "mbs": 4, "G": 8},
}
NATIVE = {"dp2": "DDP", "pp2": "Schedule1F1B", "pp2xdp2": "Schedule1F1B + DDP"}
WORLD = {"dp2": 2, "pp2": 2, "pp2xdp2": 4}


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt_example",
                                                  ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(case: str):
    c = CASES[case]
    ex = _example()
    return ex.gpt_model(c["blocks"], c["context"], c["width"], c["heads"], lr=1e-3,
                        corpus=ex.stdlib_corpus(200_000), seed=0, tie=False)


def _plan(name: str, layers: int, g: int):
    from chameleon_elastic.plan import ExecutionPlan, Pipeline
    from chameleon_elastic.runtime.execution.layout import data_parallel_plan

    half = layers // 2
    cut = ((0, half), (half, layers))
    if name == "dp2":
        return data_parallel_plan(2, layers, g)
    if name == "pp2":
        return ExecutionPlan("initial", 0, (Pipeline((0, 1), cut, g),)).validate()
    return ExecutionPlan("initial", 0, (Pipeline((0, 1), cut, g // 2),
                                        Pipeline((2, 3), cut, g // 2))).validate()


def _first_ddp_iteration(net, model, start: int, case: dict) -> None:
    """One plain forward and backward through a DDP-wrapped stage, gradients then zeroed.
    DDP records its parameters' order in its first iteration; under pipelining that
    iteration runs several micro-batches' backwards and DDP's reducer fails an internal
    assertion (torch 2.13), so the order is recorded here first."""
    from chameleon_elastic.runtime.model import collate

    x, _ = collate(model, range(case["mbs"]))
    if start > 0:  # a hidden state enters the stage
        x = torch.randn(case["mbs"], case["context"], case["width"])
    net(x).float().sum().backward()
    for p in net.parameters():
        p.grad = None


class _Native:
    """torch's tool for ``plan`` on this rank: DDP, Schedule1F1B, or both."""

    def __init__(self, model, plan, rank: int, case: dict) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.nn.parallel import DistributedDataParallel as DDP

        from chameleon_elastic.runtime.execution.feed import Feed
        from chameleon_elastic.runtime.model import build_layers

        self.model, self.plan, self.mbs = model, plan, case["mbs"]
        self.feed = Feed(model, self.mbs, torch.device("cpu"), prefetch=False)
        pipes = plan.pipelines
        stages = pipes[0].num_stages
        self.pipeline, self.stage = rank // stages, rank % stages
        start, end = pipes[self.pipeline].layers[self.stage]
        self.module = nn.Sequential(*build_layers(model, start, end))
        # every rank creates every group, in one order
        pp_groups = [dist.new_group([p * stages + s for s in range(stages)])
                     for p in range(len(pipes))]
        dp_groups = [dist.new_group([p * stages + s for p in range(len(pipes))])
                     for s in range(stages)]
        net = self.module if len(pipes) == 1 else DDP(self.module,
                                                      process_group=dp_groups[self.stage])
        if stages > 1 and len(pipes) > 1:
            _first_ddp_iteration(net, model, start, case)
        self.net = net
        self.optimizer = model.make_optimizer(self.module.parameters())
        self.quota = pipes[self.pipeline].micro_batches
        self.schedule = None
        if stages > 1:
            stage = PipelineStage(net, self.stage, stages, torch.device("cpu"),
                                  group=pp_groups[self.pipeline])
            self.schedule = Schedule1F1B(stage, n_microbatches=self.quota, loss_fn=model.loss)
        self.pp_group = pp_groups[self.pipeline]

    def _batches(self, step: int):
        """The runtime's own reader, synchronous: the same samples in the same order."""
        return [self.feed.batch(self.plan, step, self.pipeline, m) for m in range(self.quota)]

    def _clip(self) -> None:
        params = list(self.module.parameters())
        if self.schedule is None:
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            return
        square = torch.nn.utils.get_total_norm([p.grad for p in params]).square()
        dist.all_reduce(square, group=self.pp_group)   # every stage of this pipeline
        torch.nn.utils.clip_grads_with_norm_(params, MAX_GRAD_NORM, square.sqrt())

    def step(self, step: int) -> float:
        """Train ``step``; this rank's share of the global-batch mean loss."""
        g = self.plan.global_micro_batches
        batches = self._batches(step)
        self.optimizer.zero_grad(set_to_none=False)
        total = 0.0
        if self.schedule is None:  # DDP
            for m, (x, y) in enumerate(batches):
                sync = self.net.no_sync() if m < self.quota - 1 else contextlib.nullcontext()
                with sync:
                    loss = self.model.loss(self.net(x), y)
                    (loss / g).backward()
                total += float(loss.detach()) / g
        else:
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            if self.stage == 0:
                self.schedule.step(x)
            else:
                losses: list[torch.Tensor] = []
                self.schedule.step(target=y, losses=losses)
                total = sum(float(v.detach()) for v in losses) / g
        self._clip()
        self.optimizer.step()
        return total


def _timed(fn) -> tuple[float, object]:
    dist.barrier()
    began = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - began, out


def _comm_share(native: _Native, steps: int = 3) -> tuple[float, float]:
    """(backward s, gradient all-reduce s) of this rank's step under plain data parallelism,
    each the median of ``steps``: the backward under ``no_sync``, then one flat all-reduce
    of every gradient (what an overlap has to hide)."""
    backward, allreduce = [], []
    for step in range(steps):
        native.optimizer.zero_grad(set_to_none=False)
        spent = 0.0
        for x, y in native._batches(step):
            with native.net.no_sync():
                loss = native.model.loss(native.net(x), y)
                began = time.perf_counter()
                loss.backward()
                spent += time.perf_counter() - began
        backward.append(spent)
        flat = torch.cat([p.grad.reshape(-1) for p in native.module.parameters()])
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(flat)
        allreduce.append(time.perf_counter() - began)
    return statistics.median(backward), statistics.median(allreduce)


def _world(rank: int, world: int, case: str, plan_name: str, steps: int) -> dict:
    from chameleon_elastic.runtime import PipelineTrainer

    torch.set_num_threads(1)
    c = CASES[case]
    model = _model(case)
    plan = _plan(plan_name, model.num_layers, c["G"])
    native = _Native(model, plan, rank, c)
    share = _comm_share(native) if plan_name == "dp2" else None
    if share is not None:  # fresh optimizer state and weights for the timed run
        native = _Native(model, plan, rank, c)
    trainer = PipelineTrainer(model, plan, rank, micro_batch_size=c["mbs"], precision="fp32",
                              max_grad_norm=MAX_GRAD_NORM)
    ours, theirs, losses = [], [], []
    for step in range(steps):
        pair = [("ours", lambda s=step: trainer.step(s).loss),
                ("theirs", lambda s=step: native.step(s))]
        got = {}
        for name, fn in (pair if step % 2 == 0 else reversed(pair)):
            got[name] = _timed(fn)
        ours.append(got["ours"][0])
        theirs.append(got["theirs"][0])
        native_loss = torch.tensor([got["theirs"][1]], dtype=torch.float64)
        dist.all_reduce(native_loss)
        losses.append((got["ours"][1], float(native_loss)))
    trainer.close()
    return {"ours": ours, "theirs": theirs, "losses": losses, "share": share}


def run_case(case: str, plan_name: str, steps: int, skip: int) -> dict:
    from chameleon_elastic.runtime.world.local_world import run_local_world

    out = run_local_world(_world, WORLD[plan_name], case, plan_name, steps,
                          timeout_s=120 + 20 * steps)[0]
    ours_loss, native_loss = out["losses"][0]
    if abs(ours_loss - native_loss) > 1e-5 * abs(native_loss):
        raise SystemExit(f"{case} {plan_name}: step-0 losses differ (runtime {ours_loss!r}, "
                         f"{NATIVE[plan_name]} {native_loss!r}): the two do not do the same work")
    ratios = [a / b for a, b in zip(out["ours"][skip:], out["theirs"][skip:])]
    row = {"case": case, "plan": plan_name, "native": NATIVE[plan_name],
           "ours_s": statistics.median(out["ours"][skip:]),
           "native_s": statistics.median(out["theirs"][skip:]),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios),
           "ratio_max": max(ratios), "loss0": [ours_loss, native_loss]}
    if out["share"] is not None:
        backward, allreduce = out["share"]
        row["backward_s"], row["allreduce_s"] = backward, allreduce
    return row


# --------------------------------------------------------------------------- the launcher row


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(cmd: list[str], timeout: float = 600) -> None:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                         env=_env())
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({out.returncode}):\n"
                         f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def _interval(losses: Path, skip: int) -> tuple[float, float]:
    rows = [json.loads(x) for x in losses.read_text().splitlines()]
    ends = [r["time"] for r in rows]
    gaps = [b - a for a, b in itertools.pairwise(ends)][skip:]
    return statistics.median(gaps), rows[0]["loss"]


def launcher_row(rounds: int, steps: int, skip: int) -> dict:
    """train_hf.py under chameleon-run --job (dp 2) against the same under torchrun."""
    example = str(ROOT / "examples" / "train_hf.py")
    common = ["--steps", str(steps), "--context", "64", "--precision", "fp32",
              "--micro-batch-size", "2", "--global-micro-batches", "4",
              "--log-every", str(steps)]
    out: dict[str, list[float]] = {"chameleon-run": [], "torchrun": []}
    first = {}
    with tempfile.TemporaryDirectory(prefix="faultfree-") as tmp:
        work = Path(tmp)
        model = work / "model"
        _run([sys.executable, example, "--config", "llama-tiny", "--steps", "1", "--export",
              str(model), "--log-every", "1"])
        _run(["chameleon-job", "hf", str(model), "--devices", "2", "--dp", "2", "--pp", "1",
              "--context", "64", "--micro-batch-size", "2", "--global-micro-batches", "4",
              "--precision", "fp32", "-o", str(work / "job.toml")])
        for k in range(rounds):
            order = ["chameleon-run", "torchrun"]
            for name in (order if k % 2 == 0 else reversed(order)):
                losses = work / f"{name}-{k}.jsonl"
                head = (["chameleon-run", "--standalone", "--nproc-per-node", "2", "--job",
                         str(work / "job.toml"), "--no-status", "--state-dir",
                         str(work / f"state-{k}")] if name == "chameleon-run" else
                        [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2"])
                _run([*head, example, "--model", str(model), *common, "--losses", str(losses)])
                step_s, loss0 = _interval(losses, skip)
                out[name].append(step_s)
                first[name] = loss0
    ratios = [a / b for a, b in zip(out["chameleon-run"], out["torchrun"])]
    return {"chameleon_run_s": out["chameleon-run"], "torchrun_s": out["torchrun"],
            "ratio": statistics.median(ratios), "ratios": ratios, "loss0": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="paired steps per world")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--plans", nargs="+", choices=list(NATIVE), default=list(NATIVE))
    ap.add_argument("--launcher-rounds", type=int, default=2,
                    help="alternating runs of chameleon-run and torchrun (0: skip that row)")
    ap.add_argument("--launcher-steps", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.steps < args.skip + 3 or args.launcher_steps < 8:
        ap.error("need --steps >= --skip + 3 and --launcher-steps >= 8")
    load = [os.getloadavg()[0]]   # the shared machine's load: what the spreads mean
    rows = [run_case(case, plan, args.steps, args.skip)
            for case in args.cases for plan in args.plans]
    launcher = (launcher_row(args.launcher_rounds, args.launcher_steps, 4)
                if args.launcher_rounds > 0 else None)
    load.append(os.getloadavg()[0])
    if args.json:
        print(json.dumps({"rows": rows, "launcher": launcher, "target": TARGET,
                          "load_average": load}, indent=2))
        return 0
    print(f"fault-free step, runtime vs torch's own tool in the same processes (fp32, "
          f"{args.steps - args.skip} paired steps after {args.skip}; target <= {TARGET}x; "
          f"load average {load[0]:.1f} -> {load[1]:.1f})")
    print(f"{'case':<11} {'plan':<8} {'torch tool':<19} {'ours s':>8} {'torch s':>8} "
          f"{'ratio':>6} {'spread':>12}  note")
    for r in rows:
        note = ""
        if "allreduce_s" in r:
            note = (f"sum {r['allreduce_s'] * 1e3:.1f} ms = "
                    f"{100 * r['allreduce_s'] / r['backward_s']:.0f}% of backward")
        print(f"{r['case']:<11} {r['plan']:<8} {r['native']:<19} {r['ours_s']:>8.4f} "
              f"{r['native_s']:>8.4f} {r['ratio']:>6.3f} "
              f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}  {note}")
    if launcher is not None:
        print(f"train_hf.py dp 2: chameleon-run {statistics.median(launcher['chameleon_run_s']):.4f}"
              f" s vs torchrun {statistics.median(launcher['torchrun_s']):.4f} s: ratio "
              f"{launcher['ratio']:.3f} (per round {' '.join(f'{x:.3f}' for x in launcher['ratios'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
