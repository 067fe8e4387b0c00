"""Real torch.distributed worker (gloo): join, all-reduce, and let rank 0 crash on the first
``N`` launches after the process group is up - the case where torchrun's shared store hands the
relaunched workers the previous attempt's gloo addresses."""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    out, crashes = sys.argv[1], int(sys.argv[2])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.ones(2)
    dist.all_reduce(t)
    rank = dist.get_rank()
    with open(os.path.join(out, f"ran-{restart}-{rank}.json"), "w") as fh:
        json.dump({"restart": restart, "rank": rank, "sum": t.tolist(), "port": os.environ["MASTER_PORT"]}, fh)
    if restart < crashes:
        if rank == 0:
            os._exit(1)
        time.sleep(60)  # stopped by the launcher
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
