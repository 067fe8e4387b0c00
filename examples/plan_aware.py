"""A plan-aware script: each worker builds only its own pipeline stage from ``CHAMELEON_*``.

    chameleon-run --standalone --nproc-per-node 4 --preset tiny-cpu examples/plan_aware.py
    chameleon-run --standalone --nproc-per-node 4 --preset tiny-cpu \
        --profile-out profile.json examples/plan_aware.py --steps 20

What the launcher tells the worker (see docs/launcher.md): its pipeline and stage, the layer
range ``[CHAMELEON_LAYER_START, CHAMELEON_LAYER_END)``, its micro-batch quota (including what it
absorbs for a dead peer under rerouting) and the whole plan (``CHAMELEON_PLAN_FILE``). The
runtime (``chameleon_elastic.runtime``) builds exactly those layers, runs the plan's 1F1B order
with point-to-point transfers and synchronises gradients by the plan's colour rounds. After a
re-plan the launcher restarts the script with the new roles: this example drives
``trainer.step`` itself, so it is relaunched and starts again from step 0 (examples/train_gpt.py
trains through ``trainer.run`` and recovers in place instead, keeping every committed step).

Each step's time goes to the launcher's profiler through ``record_step`` (a no-op elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist

from chameleon_elastic.models.toy import mlp_model
from chameleon_elastic.runtime import PipelineTrainer, init_distributed, plan_from_env
from chameleon_elastic.runtime.recording import record_step


def say(text: str) -> None:
    """One line in one write: two workers sharing the terminal must not glue their lines
    (print writes the text and its newline apart when output is unbuffered)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if k.startswith("CHAMELEON_")}
    if "CHAMELEON_PLAN_FILE" not in env:
        raise SystemExit("run me under chameleon-run --job/--preset: I need CHAMELEON_* variables")
    plan = plan_from_env()
    assert plan is not None
    init_distributed()
    rank = dist.get_rank()
    say(f"[rank {rank}] device {env['CHAMELEON_DEVICE']} plan generation "
          f"{env['CHAMELEON_PLAN_GENERATION']} ({env['CHAMELEON_POLICY']}): pipeline "
          f"{env['CHAMELEON_PIPELINE']}/{env['CHAMELEON_NUM_PIPELINES']}, stage "
          f"{env['CHAMELEON_STAGE']}/{env['CHAMELEON_NUM_STAGES']}, layers "
          f"[{env['CHAMELEON_LAYER_START']}, {env['CHAMELEON_LAYER_END']}), "
          f"{env['CHAMELEON_MICRO_BATCHES']} of {env['CHAMELEON_GLOBAL_MICRO_BATCHES']} "
          "micro-batches")

    trainer = PipelineTrainer.from_env(mlp_model(layers=plan.num_layers))
    for step in range(args.steps):
        began = time.perf_counter()
        result = trainer.step(step)
        record_step(time.perf_counter() - began)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            say(f"step {step} loss {result.loss:.5f}")
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
