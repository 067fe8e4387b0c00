"""An ordinary torchrun DDP script (CPU, gloo): nothing in it knows about chameleon-run.

    torchrun      --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 20
    chameleon-run --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 20

Each rank trains a small MLP on its own shard of a synthetic regression problem; gradients are
averaged by DistributedDataParallel. Rank 0 prints the loss every few steps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    dist.init_process_group("gloo")
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
                  f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
