"""The cuda / nccl path on a machine with a GPU: what the suite (CPU, gloo) cannot exercise.

One process in a one-rank world, so one GPU is enough (NCCL refuses two ranks on one GPU, so
recovery between GPU peers needs a multi-GPU machine). It checks, for each NCCL implementation
the installed torch builds (``nccl``, which is nccl2 from torch 2.15, and ``nccl-legacy``, the
classic one, from 2.14: the cuda plugin's choice, plugins/cuda.py):

- the world made as the runtime makes it (runtime/world/groups.py ``init_world``): bound to the GPU
  (``device_id``), and built on the implementation torch_compat expects for the name;
- a subgroup made the way runtime/world/groups.py decides for that backend (``split_group`` on nccl2,
  ``new_group`` on the classic NCCL), and an all-reduce on it;
- ``PipelineTrainer`` on cuda (a float32 MLP, 8 layers) for ``--steps`` steps, against the same
  steps on the CPU with gloo in the same run: the losses must agree;

and once, with the default implementation:

- the cuda plugin: device, memory figures (torch's caching allocator), synchronize;
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_elastic import torch_compat
from chameleon_elastic.models.toy import mlp_model
from chameleon_elastic.plugins import get_backend
from chameleon_elastic.plugins.cuda import CudaBackend
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.state.checkpoint import latest_step, load_checkpoint
from chameleon_elastic.runtime.world.groups import init_world, subgroup_method

Check = tuple[str, bool, str]
_PORTS = iter(range(29517, 29600))


def _world(backend: str) -> None:
    """A one-rank world on a fresh port, made as the runtime makes it."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(next(_PORTS)))
    init_world(backend, timedelta(seconds=60))


def _train(backend: str, device: torch.device | None, steps: int, ckpt: Path | None,
           resume: bool = False) -> tuple[list[float], float]:
    _world(backend)
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


def _groups(cuda: CudaBackend, dev: torch.device) -> Check:
    """The world's binding and implementation, and one subgroup made as the runtime decides."""
    _world(cuda.dist_backend)
    try:
        world = dist.group.WORLD
        bound = world.bound_device_id == dev
        built = type(world._get_backend(dev)).__name__
        nccl2 = cuda.nccl == "nccl2" or (cuda.nccl == "nccl" and torch_compat.nccl_means_nccl2())
        expected = "ProcessGroupNCCL2" if nccl2 else "ProcessGroupNCCL"
        method = subgroup_method(cuda.dist_backend)
        group = (dist.split_group(split_ranks=[[0]]) if method == "split_group"
                 else dist.new_group([0]))
        t = torch.ones(4, device=dev)
        dist.all_reduce(t, group=group)
        summed = bool(t.sum().item() == 4)
    finally:
        dist.destroy_process_group()
    return ((f"{cuda.dist_backend}: world bound to {dev}, built as {expected}, a subgroup by "
            f"{method}"), bound and built == expected and summed,
            f"bound: {bound}; built: {built}; subgroup all-reduce: {summed}")


def _trains_like_the_cpu(cuda: CudaBackend, dev: torch.device, steps: int) -> Check:
    gpu, gpu_s = _train(cuda.dist_backend, dev, steps, None)
    cpu, cpu_s = _train("gloo", None, steps, None)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(gpu, cpu, strict=True))
    return (f"trainer on cuda ({cuda.dist_backend}), {steps} steps = CPU + gloo", worst < 1e-4,
            (f"max relative loss difference {worst:.1e}; {gpu_s:.2f} s on the GPU, "
            f"{cpu_s:.2f} s on the CPU"))


def _checkpoint_and_abort(cuda: CudaBackend, dev: torch.device, steps: int) -> list[Check]:
    checks: list[Check] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        _train(cuda.dist_backend, dev, steps, ckpt)
        cuda.synchronize(0)
        peak = cuda.memory_stats(0).peak
        saved = latest_step(ckpt)
        more, _ = _train("gloo", None, steps + 2, ckpt, resume=True)
        checks.append(("checkpoint written from the GPU, read on the CPU",
                       saved == steps and len(more) == 2,
                       (f"checkpoint of step {saved}; resumed for {len(more)} more steps; GPU "
                       f"peak {peak / 2**20:.1f} MiB")))
    _world(cuda.dist_backend)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    began = time.perf_counter()
    cuda.abort_process_groups()
    abort_s = time.perf_counter() - began
    gone = not dist.is_initialized()
    _world(cuda.dist_backend)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    again = bool(t.sum().item() == 4)
    dist.destroy_process_group()
    checks.append(("abort_process_groups (ncclCommAbort), then a new group", gone and again,
                   (f"aborted in {abort_s * 1e3:.0f} ms; no group after it: {gone}; "
                   f"a new group all-reduces: {again}")))
    return checks


def _checked(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """The checks ``run`` makes; one failed check naming the exception when it raises, so
    that one broken path does not hide the others."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        if dist.is_initialized():
            dist.destroy_process_group()
        return [(name, False, f"raised {type(exc).__name__}: {exc}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cuda = get_backend("cuda")
    assert isinstance(cuda, CudaBackend)
    if not cuda.is_available():
        print("cuda_smoke: no GPU here (torch.cuda.is_available() is False); run it on a "
              "machine with one.", file=sys.stderr)
        return 2
    dev = cuda.device(0)
    stats = cuda.memory_stats(0)
    checks: list[Check] = [("plugin: device and memory figures", stats.total > 0,
                            (f"{dev}, {torch.cuda.get_device_name(dev)}, "
                            f"{stats.total / 2**30:.0f} GiB"))]
    names = ["nccl", "nccl-legacy"] if torch_compat.torch_release() >= (2, 14) else ["nccl"]
    for name in names:
        flavour = get_backend(name)
        assert isinstance(flavour, CudaBackend)
        checks += _checked(f"{flavour.dist_backend}: groups",
                           lambda f=flavour: [_groups(f, dev)])
        checks += _checked(f"{flavour.dist_backend}: trainer",
                           lambda f=flavour: [_trains_like_the_cpu(f, dev, args.steps)])
    checks += _checked("checkpoint and abort",
                       lambda: _checkpoint_and_abort(cuda, dev, args.steps))
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
