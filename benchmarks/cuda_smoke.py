"""The cuda / nccl path on a machine with a GPU: what the suite (CPU, gloo) cannot exercise.

Two modes. The default, **one process** in a one-rank world, checks the NCCL path on one GPU
(NCCL refuses two ranks on one GPU, so recovery between NCCL peers needs a multi-GPU machine).
``--procs N`` (**several processes sharing one GPU**, over gloo) checks the recovery in place
on the GPU instead: see *Several processes on one GPU* below.

The one-process mode checks, for each NCCL implementation
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

Several processes on one GPU (``--procs N``, 2 to 8; benchmarks/cuda_smoke_procs.py runs it).
Why: it is the only way one GPU can show a real ``kill -9`` and the recovery in place on CUDA
tensors, and it is how a small machine would share a GPU among workers. NCCL refuses two ranks
on one GPU, so the workers' world is gloo (``CHAMELEON_BACKEND=gloo``), and gloo cannot send or
receive a CUDA tensor point to point (its collectives stage them through host memory
themselves); the runtime's transfers go through host memory there (runtime/world/wire.py).
What it checks, in order:

- gloo with tensors on the device, in two bare processes: the collectives the runtime uses
  (all-reduce, broadcast, all-gather) and its point-to-point transfers through wire.py, for
  their values; a raw ``dist.isend`` / ``dist.recv`` of a device tensor is reported as a note
  (what torch's source says cannot work, seen for real);
- ``chameleon-run --job`` (one pipeline of N stages: every stage has a single replica) with
  in-memory snapshots every ``--snapshot-every`` steps, N workers (benchmarks/
  cuda_smoke_worker.py) training a float64 MLP on GPU 0; with ``--kill``, a ``kill -9`` of
  device N // 2's worker right after step ``--kill-at``; its layers exist nowhere else, so the
  survivors go back to its partner's snapshot in host memory and train on in place;
- every step reported once, each loss equal to failure-free single-process training (float64,
  CPU; ``--rtol``), the ``recovered`` event (in place, from the snapshot: its phases), kill ->
  next new step, every survivor's layers on the GPU and its transfers staged, the memory each
  survivor held before the kill and holds afterwards (the caching allocator's figures), the
  device's (``torch.cuda.mem_get_info``; nvidia-smi's per-process list where present: the
  killed worker must hold nothing), the GPU's memory before the job and once it is gone (all
  of it given back), and no process left behind.

``--device cpu`` is a dry run of that mode: the same flow with the workers on the CPU (nothing
staged, memory as RSS), so everything but the CUDA placement runs on a machine without a GPU.
What only a GPU can show: the staged transfers of real CUDA tensors, gloo's own staging of the
collectives, the memory figures, and what a raw gloo send of a CUDA tensor does.

    python benchmarks/cuda_smoke.py --procs 4 --kill [--json] [--json-out FILE]
    python benchmarks/cuda_smoke.py --procs 4 --kill --device cpu     # the dry run

Exit status 0 when every check passes, 1 when one fails, 2 when there is no GPU (one line; the
``--device cpu`` dry run needs none). Everything has a deadline: the probes' worlds (90 s and
60 s), the job (``--deadline``, then every process it started is killed), each look at the
GPU's memory (90 s), nvidia-smi (15 s).
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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to train (default: 20; 16 with --procs)")
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    multi = parser.add_argument_group("several processes on one GPU (--procs N)")
    multi.add_argument("--procs", type=int, default=1, metavar="N",
                       help="N workers (2-8) sharing GPU 0 under chameleon-run, over gloo")
    multi.add_argument("--kill", action="store_true",
                       help="kill -9 the worker of device N // 2 after step --kill-at")
    multi.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="cpu: a dry run of the same flow without a GPU")
    multi.add_argument("--kill-at", type=int, default=10)
    multi.add_argument("--snapshot-every", type=int, default=4)
    multi.add_argument("--width", type=int, default=64, help="the MLP's width")
    multi.add_argument("--rtol", type=float, default=1e-6,
                       help="losses against the single-process reference")
    multi.add_argument("--deadline", type=float, default=240.0,
                       help="seconds before the job is killed and counted as hung")
    multi.add_argument("--json-out", type=Path, default=None, metavar="FILE",
                       help="also write the JSON report there")
    args = parser.parse_args(argv)
    if args.procs == 1 and (args.kill or args.device == "cpu" or args.json_out):
        parser.error("--kill, --device cpu and --json-out belong to the multi-process mode; "
                     "pass --procs N (2 to 8)")
    if args.procs != 1 and not 2 <= args.procs <= 8:
        parser.error(f"--procs {args.procs}: pass 2 to 8 (the model has 8 layers)")
    steps = args.steps if args.steps is not None else (20 if args.procs == 1 else 16)
    if args.kill and not 0 < args.kill_at < steps - 1:
        parser.error(f"--kill-at {args.kill_at} must lie inside the {steps} steps")
    args.steps = steps
    return args


def _procs(args: argparse.Namespace) -> int:
    """The multi-process mode (benchmarks/cuda_smoke_procs.py): table or JSON, exit status."""
    import cuda_smoke_procs as procs

    opts = procs.Options(args.procs, args.kill, args.device, steps=args.steps,
                         kill_at=args.kill_at, snapshot_every=args.snapshot_every,
                         width=args.width, rtol=args.rtol, deadline_s=args.deadline)
    try:
        rows, figures = procs.assess(opts)
    except Exception as exc:  # noqa: BLE001 - a report, and exit 1, whatever went wrong
        rows, figures = procs.crashed(exc)
    # asked after the job: the driver holds no CUDA context while the workers are measured
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    rep = procs.report(opts, rows, figures, {"torch": torch.__version__, "device_name": name})
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rep, indent=2))
    print(json.dumps(rep, indent=2) if args.json else procs.render(rep))
    return 0 if rep["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cuda = get_backend("cuda")
    assert isinstance(cuda, CudaBackend)
    if not cuda.is_available() and not (args.procs > 1 and args.device == "cpu"):
        print("cuda_smoke: no GPU here (torch.cuda.is_available() is False); run it on a "
              "machine with one, or pass --procs N --device cpu for the dry run.",
              file=sys.stderr)
        return 2
    if args.procs > 1:
        return _procs(args)
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
