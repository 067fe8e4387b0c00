"""An ``accelerate`` training loop that follows chameleon-run's plan (one line: the Accelerator's).

    python examples/frameworks/accelerate_loop.py OUT --accumulate 4      # one process
    torchrun --standalone --nproc-per-node 2 examples/frameworks/accelerate_loop.py OUT --accumulate 2
    chameleon-run --standalone --nproc-per-node 2 --job job.toml \\
        examples/frameworks/accelerate_loop.py OUT

The line that follows the plan is ``Accelerator(**accelerate_plan.accelerator_kwargs(...), ...)``:
under ``--job`` it gives the ``Accelerator`` the plan's accumulation; elsewhere the script's own
``--accumulate``. ``accelerate_plan.micro_batch_size`` gives the loader the job's micro-batch
size, ``accelerate_plan.loss_weight`` the factor that weighs ranks of unequal quotas alike (1.0
here: two workers, or one).

A small MLP learns a synthetic regression in float32 with SGD. The loader shuffles with
accelerate's seedable sampler (one permutation per seed and epoch, whatever the world) and
accelerate deals its batches out to the ranks in turn, so a step covers the same samples
whatever the world. After every step the state is saved (``accelerator.save_state`` into a
temporary folder, renamed once every rank has written its part); a relaunch loads the newest
with ``accelerate_plan.load_state`` (accelerate's own count of micro-batches into the
accumulation window is the old plan's: it starts afresh), and skips the batches of the resumed
epoch already trained: steps done x the new plan's accumulation (a count of batches would be a
count of the old plan's micro-batches).

Rank 0 appends one JSON line per optimizer step to ``OUT/steps.jsonl``: the step, the mean loss
over the whole global batch (summed over the ranks), and the rank, world size, accumulation,
plan generation and process id it was trained under.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from chameleon_elastic.frameworks import accelerate_plan


def synthetic(samples: int) -> TensorDataset:
    """The same samples in every process: a fixed linear map plus a fixed wiggle."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16) + 0.3 * torch.sin(3 * x[:, 0])
    return TensorDataset(x, y.unsqueeze(1))


def newest_state(folder: Path) -> tuple[Path | None, int]:
    """The newest saved state and its step count (renamed into place only when complete)."""
    found = sorted((int(p.name.split("-")[1]), p) for p in folder.glob("step-*"))
    return (found[-1][1], found[-1][0]) if found else (None, 0)


def save(accelerator: Accelerator, folder: Path, steps: int) -> None:
    """Every rank writes its part into a temporary folder; rank 0 renames it when all have."""
    partial = folder / f"partial-{steps}"
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        partial.rename(folder / f"step-{steps}")
        shutil.rmtree(folder / f"step-{steps - 2}", ignore_errors=True)


def log_step(accelerator: Accelerator, out: Path, step: int, loss_sum: float, count: int,
             hold_after: int | None) -> None:
    """Rank 0 writes the step's mean loss over the world; ``--hold-after-step K`` makes it wait
    after step K of the first plan for good, as a stuck worker would (tests kill it there)."""
    total = accelerator.reduce(torch.tensor([loss_sum, float(count)], dtype=torch.float64), "sum")
    if not accelerator.is_main_process:
        return
    record = {"step": step, "loss": total[0].item() / total[1].item(),
              "rank": accelerator.process_index, "world_size": accelerator.num_processes,
              "accumulation": accelerator.gradient_accumulation_steps,
              "generation": int(os.environ.get("CHAMELEON_PLAN_GENERATION", "-1")),
              "pid": os.getpid()}
    with open(out / "steps.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    if step == hold_after and os.environ.get("CHAMELEON_PLAN_GENERATION", "0") == "0":
        while True:
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--hold-after-step", type=int, default=None,
                        help="tests: rank 0 waits after this step of the first plan, to be killed")
    args = parser.parse_args()
    accelerator = Accelerator(
        **accelerate_plan.accelerator_kwargs(gradient_accumulation_steps=args.accumulate),
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    states = args.out / "checkpoints"
    states.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic(args.samples), shuffle=True,
                        batch_size=accelerate_plan.micro_batch_size(args.micro_batch_size))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    weight = accelerate_plan.loss_weight()
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = len(loader) // accumulation
    newest, step = newest_state(states)
    if newest is not None:
        accelerate_plan.load_state(accelerator, str(newest))   # the window starts afresh
    while step < args.steps:
        epoch, done = divmod(step, steps_per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done * accumulation) if done else loader
        loss_sum, count = 0.0, 0
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss * weight)
                optimizer.step()
                optimizer.zero_grad()
            loss_sum, count = loss_sum + loss.item(), count + 1
            if accelerator.sync_gradients:
                log_step(accelerator, args.out, step, loss_sum, count, args.hold_after_step)
                step, loss_sum, count = step + 1, 0.0, 0
                save(accelerator, states, step)
                if step == args.steps:
                    break
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # gloo's threads outlive the process group: skip the teardown (ddp_torchrun.py)
