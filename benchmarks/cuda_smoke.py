"""The cuda / nccl path on a machine with a GPU: what the suite (CPU, gloo) cannot exercise.

One process in a one-rank world, so one GPU is enough (NCCL refuses two ranks on one GPU, so
recovery between GPU peers needs a multi-GPU machine):

- the cuda plugin: device, memory figures (torch's caching allocator), synchronize;
- ``PipelineTrainer`` on cuda with nccl (a float32 MLP, 8 layers) for ``--steps`` steps,
  against the same steps on the CPU with gloo in the same run: the losses must agree;
- a checkpoint written from the GPU and read back into a CPU run;
- ``abort_process_groups`` (torch's ``_abort_process_group``: ``ncclCommAbort``), which is how a
  survivor unblocks a collective waiting on a dead peer, leaves no group, and a new group forms
  after it.

    python benchmarks/cuda_smoke.py [--steps 20] [--json]

Exit status 0 when every check passes, 1 when one fails, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_elastic.plugins import get_backend
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.checkpoint import latest_step, load_checkpoint
from chameleon_elastic.runtime.toy import mlp_model


def _train(backend: str, device: torch.device | None, steps: int, ckpt: Path | None,
           resume: bool = False) -> tuple[list[float], float]:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        trainer = PipelineTrainer.from_env(mlp_model(layers=8, dtype=torch.float32),
                                           global_micro_batches=4, torch_device=device,
                                           checkpoint_dir=ckpt, link=None)
        if resume:
            assert ckpt is not None
            load_checkpoint(trainer, ckpt)
        losses: list[float] = []
        began = time.perf_counter()
        trainer.run(steps, lambda r: losses.append(r.loss),
                    checkpoint_every=steps if ckpt is not None and not resume else 0)
        return losses, time.perf_counter() - began
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cuda = get_backend("cuda")
    if not cuda.is_available():
        print("cuda_smoke: no GPU here (torch.cuda.is_available() is False); run it on a "
              "machine with one.", file=sys.stderr)
        return 2
    checks: list[tuple[str, bool, str]] = []
    dev = cuda.device(0)
    stats = cuda.memory_stats(0)
    checks.append(("plugin: device and memory figures", stats.total > 0,
                   f"{dev}, {torch.cuda.get_device_name(dev)}, {stats.total / 2**30:.0f} GiB"))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        gpu, gpu_s = _train(cuda.dist_backend, dev, args.steps, ckpt)
        cuda.synchronize(0)
        peak = cuda.memory_stats(0).peak
        cpu, cpu_s = _train("gloo", None, args.steps, None)
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(gpu, cpu, strict=True))
        checks.append((f"trainer on cuda ({cuda.dist_backend}), {args.steps} steps = CPU + gloo",
                       worst < 1e-4, (f"max relative loss difference {worst:.1e}; "
                       f"{gpu_s:.2f} s on the GPU, {cpu_s:.2f} s on the CPU; peak "
                       f"{peak / 2**20:.1f} MiB")))
        saved = latest_step(ckpt)
        more, _ = _train("gloo", None, args.steps + 2, ckpt, resume=True)
        checks.append(("checkpoint written from the GPU, read on the CPU",
                       saved == args.steps and len(more) == 2,
                       f"checkpoint of step {saved}; resumed for {len(more)} more steps"))
    os.environ["MASTER_PORT"] = "29518"
    dist.init_process_group(cuda.dist_backend, rank=0, world_size=1, device_id=dev)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    began = time.perf_counter()
    cuda.abort_process_groups()
    abort_s = time.perf_counter() - began
    gone = not dist.is_initialized()
    os.environ["MASTER_PORT"] = "29519"
    dist.init_process_group(cuda.dist_backend, rank=0, world_size=1, device_id=dev)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    again = bool(t.sum().item() == 4)
    dist.destroy_process_group()
    checks.append(("abort_process_groups (ncclCommAbort), then a new group", gone and again,
                   (f"aborted in {abort_s * 1e3:.0f} ms; no group after it: {gone}; "
                   f"a new group all-reduces: {again}")))
    ok = all(passed for _, passed, _ in checks)
    if args.json:
        print(json.dumps({"benchmark": "cuda_smoke", "torch": torch.__version__, "ok": ok,
                          "checks": [{"check": c, "passed": p, "detail": d}
                                     for c, p, d in checks]}, indent=2))
    else:
        print(f"cuda_smoke: torch {torch.__version__}, {torch.cuda.get_device_name(dev)}")
        width = max(len(c) for c, _, _ in checks)
        for c, passed, detail in checks:
            print(f"{c:{width}s}  {'ok  ' if passed else 'FAIL'}  {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
