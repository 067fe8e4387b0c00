"""An ordinary torchrun DDP script (CPU, gloo): nothing in it knows about chameleon-run.

    torchrun      --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 20
    chameleon-run --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 20
    python examples/ddp_torchrun.py --steps 20        # alone: a world of one

Each rank trains a small MLP on its own shard of a synthetic regression problem; gradients are
averaged by DistributedDataParallel. Rank 0 prints the loss every few steps.

The end is written with care, as a gloo DDP script's should be on torch 2.13: the ranks meet in
a barrier before any tears down, and the process leaves without the interpreter's teardown.
DistributedDataParallel keeps its process group alive after ``destroy_process_group`` (gloo's
three threads still run: measured, none without DDP), so they were torn down with the
interpreter, where runs aborted now and then after their last step (``terminate called without
an active exception``, SIGABRT: 2 of 20 under torchrun, 4 of 24 under chameleon-run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    if "RANK" in os.environ:   # started by torchrun or chameleon-run
        dist.init_process_group("gloo")
    else:                       # alone: a world of one, on an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    true_w = torch.linspace(-1, 1, 16)
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=gen)
        y = (x @ true_w).unsqueeze(1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} world {world} "
                  f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    dist.barrier()   # nobody tears down while a peer may still use its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # everything is done and said: skip the teardown that could abort (above)
