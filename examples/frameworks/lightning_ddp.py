"""A PyTorch Lightning DDP script that follows chameleon-run's plan (one line: the Trainer's).

    torchrun --standalone --nproc-per-node 2 examples/frameworks/lightning_ddp.py OUT
    torchrun --standalone --nproc-per-node 1 examples/frameworks/lightning_ddp.py OUT \
        --devices 1 --accumulate 4                  # the same global batch in one process
    chameleon-run --standalone --nproc-per-node 2 --job job.toml \\
        examples/frameworks/lightning_ddp.py OUT

The line that follows the plan is ``Trainer(**lightning_plan.trainer_kwargs(...), ...)``: under
``--job`` it gives the Trainer the node's slots, the plan's accumulation and a DDP strategy for
the plan's world; elsewhere it hands back the script's own ``--devices`` and ``--accumulate``.
``lightning_plan.micro_batch_size`` gives the loader the job's micro-batch size.

A small MLP learns a synthetic regression in float32 with SGD on ``--samples`` samples.
Under DDP Lightning always shuffles the training data with a ``DistributedSampler`` seeded by
``seed_everything``'s seed and the epoch: one permutation of the data whatever the world, rank
``r`` taking its places ``r, r + W, ...``, so a step covers the same consecutive places of it
whatever the world. (Run alone, without a launcher, Lightning keeps the loader's own order:
another order, hence the one-process torchrun line above for a reference.) A checkpoint is taken after the last step of every
epoch (``--samples`` must be a whole number of global batches), on the train batch's end, and a
relaunch resumes from the newest: Lightning restarts an epoch's loader from its first batch, so
an epoch's end is where it resumes exactly, and a checkpoint taken in ``on_train_epoch_end``
(``save_on_train_epoch_end=True``) resumes one batch off (measured on Lightning 2.6.6, with or
without a plan; docs/frameworks.md).

Rank 0 appends one JSON line per optimizer step to ``OUT/steps.jsonl``: the step, the mean loss
over the whole global batch (summed over the ranks), and the rank, world size, accumulation,
plan generation and process id it was trained under.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from chameleon_elastic.frameworks import lightning_plan


def synthetic(samples: int) -> TensorDataset:
    """The same samples in every process: a fixed linear map plus a fixed wiggle."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16) + 0.3 * torch.sin(3 * x[:, 0])
    return TensorDataset(x, y.unsqueeze(1))


class Regression(pl.LightningModule):
    def __init__(self, out: Path, hold_after: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.out, self.hold_after = out, hold_after
        self._sum, self._count, self._step = 0.0, 0, -1

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self._count == 0:
            self._step = self.global_step
        self._sum += loss.item()
        self._count += 1
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_step == self._step:   # still accumulating this step's micro-batches
            return
        total = torch.tensor([self._sum, float(self._count)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(total)
        if self.global_rank == 0:
            record = {"step": self._step, "loss": total[0].item() / total[1].item(),
                      "rank": self.global_rank, "world_size": self.trainer.world_size,
                      "accumulation": self.trainer.accumulate_grad_batches,
                      "generation": int(os.environ.get("CHAMELEON_PLAN_GENERATION", "-1")),
                      "pid": os.getpid()}
            with open(self.out / "steps.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            hold_if_asked(self.hold_after, self._step)
        self._sum, self._count = 0.0, 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def hold_if_asked(hold_after: int | None, step: int) -> None:
    """``--hold-after-step K``: under the first plan, rank 0 stops after logging step K and
    waits there for good, as a stuck worker would (tests kill it there: a kill at a known step,
    with no race against the steps that follow)."""
    if hold_after == step and os.environ.get("CHAMELEON_PLAN_GENERATION", "0") == "0":
        while True:
            time.sleep(1)


def newest_checkpoint(folder: Path) -> str | None:
    """The checkpoint of the highest step (Lightning writes each one atomically)."""
    found = sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    return str(found[-1]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=48, help="one epoch's samples")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--hold-after-step", type=int, default=None,
                        help="tests: rank 0 waits after this step of the first plan, to be killed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    launched = "RANK" in os.environ   # by torchrun or chameleon-run; alone, one process
    pl.seed_everything(0, verbose=False)
    model = Regression(args.out, args.hold_after_step)
    batch_size = lightning_plan.micro_batch_size(args.micro_batch_size)
    loader = DataLoader(synthetic(args.samples), batch_size=batch_size, shuffle=False)
    plan = lightning_plan.trainer_kwargs(devices=args.devices,
                                         accumulate_grad_batches=args.accumulate,
                                         strategy="ddp" if launched else "auto")
    global_batch = batch_size * plan["accumulate_grad_batches"] * int(os.environ.get("WORLD_SIZE", "1"))
    checkpoints = args.out / "checkpoints"
    trainer = pl.Trainer(
        **plan, accelerator="cpu", max_steps=args.steps, max_epochs=-1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(   # at each epoch's last step (see above)
            dirpath=checkpoints, filename="{step}", save_top_k=-1,
            every_n_train_steps=args.samples // global_batch)])
    trainer.fit(model, loader, ckpt_path=newest_checkpoint(checkpoints))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # gloo's threads outlive the process group: skip the teardown (ddp_torchrun.py)
