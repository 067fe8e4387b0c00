"""Tiny gloo job for the agent tests: all-reduce in a loop, report progress to a folder.

Usage: _gloo_worker.py OUT_DIR MAX_STEPS. Stops after MAX_STEPS steps, or as soon as the file
OUT_DIR/stop exists on any rank (agreed by an all-reduce, so every rank stops at the same step).
Progress: OUT_DIR/progress-g<GROUP_RANK>-pid<PID>.json, rewritten atomically every step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    report = out / f"progress-g{os.environ['GROUP_RANK']}-pid{os.getpid()}.json"
    for step in range(1, max_steps + 1):
        stop = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        ones = torch.ones(4)
        dist.all_reduce(ones)
        tmp = report.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "step": step, "world_size": world, "rank": rank, "sum": ones[0].item(),
            "group_rank": int(os.environ["GROUP_RANK"]),
            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "pid": os.getpid(),
        }))
        tmp.replace(report)
        if stop.item() > 0:
            break
        time.sleep(0.05)  # pacing, so the loop does not burn the shared CPUs
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
