"""The worker of ``benchmarks/cuda_smoke.py --procs N``: what chameleon-run starts on each device.

A float64 MLP (``toy.mlp_model``, 8 layers) trained by the runtime (``PipelineTrainer.from_env``:
the job's plan, recovery in place, the job's in-memory snapshots) on ``--device``: ``cuda``
puts every process's layers on GPU 0 (the processes share it; the world is gloo, which
``CHAMELEON_BACKEND=gloo`` from the driver selects, since NCCL refuses two ranks on one GPU),
``cpu`` is the driver's dry run of the same flow.

    cuda_smoke_worker.py OUT STEPS [--device cuda|cpu] [--width W]

Writes into OUT: ``pid-<device>`` (every pid that ran the device), ``steps.jsonl`` (one line
per reported step: step, loss, redone; from the reporting process) and, once the survivors
finished, ``memory-<device>.json``: this process's memory on its device (the plugin's figures:
allocated, reserved, peak; and after each step it trained, with the time), the device's free
and total memory, where its layers are, whether its transfers went through host memory
(runtime/world/wire.py), and, from the reporting process on a GPU, ``nvidia-smi``'s per-process
memory. Prints ``step N loss X`` lines for the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_elastic.models.toy import mlp_model
from chameleon_elastic.plugins import get_backend
from chameleon_elastic.runtime import PipelineTrainer, StepResult, init_distributed
from chameleon_elastic.runtime.world import wire

LAYERS = 8


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def nvidia_smi(timeout_s: float = 15.0) -> list[dict] | None:
    """Every compute process on the GPUs with its memory (MiB), as nvidia-smi lists them; None
    without nvidia-smi or when it fails (a container may hide other processes' pids)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    apps = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps.append({"pid": int(parts[0]),
                         "used_mib": int(parts[1]) if parts[1].isdigit() else None})
    return apps


def device_memory(dev: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the whole device: the GPU's (every process's use counted), or the
    host's memory on the CPU."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def memory_record(trainer: PipelineTrainer, dev: torch.device, out: Path,
                  history: list[dict]) -> None:
    """After training: this process's figures, taken while every survivor is alive and done
    (a barrier before and after nvidia-smi's look, so none has exited or freed yet), with
    ``history``, its figures after each step it trained (the driver picks the last one before
    the kill out of them: what a survivor held before the recovery, against what it holds
    after)."""
    plugin = get_backend(dev.type)
    plugin.synchronize(0)
    stats = plugin.memory_stats(0)
    free, total = device_memory(dev)
    where = sorted({str(p.device) for m in trainer.layers.values() for p in m.parameters()})
    dist.barrier()
    apps = nvidia_smi() if dev.type == "cuda" and trainer.is_reporter else None
    dist.barrier()
    record = {"device": trainer.device, "pid": os.getpid(), "rank": dist.get_rank(),
              **{k: stats.to_dict()[k] for k in ("allocated", "reserved", "peak")},
              "device_free": free, "device_total": total, "layers": sorted(trainer.layers),
              "layers_on": where, "through_host": wire.through_host(dev), "nvidia_smi": apps,
              "history": history}
    (out / f"memory-{trainer.device}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args(argv)
    device = os.environ["CHAMELEON_DEVICE"]
    with (args.out / f"pid-{device}").open("a") as fh:
        fh.write(f"{os.getpid()}\n")
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    init_distributed()
    trainer = PipelineTrainer.from_env(mlp_model(layers=LAYERS, width=args.width),
                                       torch_device=dev if dev.type == "cuda" else None)
    steps_file = args.out / "steps.jsonl"

    def report(result: StepResult) -> None:
        with steps_file.open("a") as fh:
            fh.write(json.dumps({"step": result.step, "loss": result.loss,
                                 "redone": bool(result.redone)}) + "\n")
        again = "  (trained again)" if result.redone else ""
        say(f"step {result.step:4d}  loss {result.loss:.6f}{again}")

    plugin = get_backend(dev.type)
    history: list[dict] = []

    def after_step(result: StepResult) -> None:
        # time.monotonic is the machine's clock (CLOCK_MONOTONIC): the driver's kill is on it
        stats = plugin.memory_stats(0)
        history.append({"t": time.monotonic(), "step": result.step,
                        "allocated": stats.allocated, "reserved": stats.reserved})

    trainer.run(args.steps, report, on_step=after_step)
    memory_record(trainer, dev, args.out, history)
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
