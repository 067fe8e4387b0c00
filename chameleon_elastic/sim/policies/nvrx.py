"""The NVRx-like baseline: restart everyone, fast, with hot spares, and reload a checkpoint.

Why a model of it: NVIDIA's nvidia-resiliency-ext (``inprocess/wrap.py``,
``fault_tolerance/launcher.py``) is what a large job on GPUs uses today to shorten a restart,
and its only policy is to restart every rank. What it saves is the relaunch (no new processes,
no scheduler), not the work since the last checkpoint, so it is the fair "fast restart" point
between torchrun's full restart (``checkpoint``) and recovery in place (``chameleon``,
``torchft``).

Mechanism modelled, at every loss of a working device:

* every rank restarts in process: ``BaselineConstants.nvrx_restart_s`` = 1.5 s at 16k ranks
  (about 0.5 s teardown of the process groups + 0.5 s rank assignment + 0.5 s barrier, NVRx's
  in-process restart docs, quoted in docs/rendezvous.md, *NCCL, on paper*), plus
  **one iteration** that its docs count in the restart's cost (a pause of one step of the new
  layout here);
* it **reloads the last checkpoint** every time, as its docs advise: the work since that
  checkpoint is lost and the shard is read back (``shard / storage bandwidth``, the same load
  ``checkpoint`` pays). Checkpoints are asynchronous (NVRx's checkpointing module, Megatron /
  NeMo async saves): no stall in fault-free training; taken at Young's interval on the save
  time, as every other policy's (``BaselineConstants.interval_s``);
* **hot spares**: the restarted job takes a live standby (a device beyond the job's size,
  ``cluster.devices > training.dp x training.pp``, or a repaired one) in the lost device's
  place and keeps its full ``training.dp x training.pp`` layout. With no standby left it runs
  as many full ``training.pp``-stage pipelines as the live devices allow (NVRx's rank
  assignment shrinks the world), and restarts again to grow back when repairs complete another
  pipeline, as ``checkpoint`` does.

Simplified: detection is free (NVRx finds a dead rank by its exception or a heartbeat timeout;
neither is charged); the restart never fails over to a job restart (``ft_launcher``); GPU
memory reclaim waits (up to 50 s after a peer dies, per its docs) and NCCL communicator set-up
beyond the quoted 1.5 s are not charged. Each of these favours NVRx. The step time of every
layout comes from ``planning.estimator`` like every other policy's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import EventContext, Phase, Reaction
from .restart import CheckpointFallback

__all__ = ["REDO_STEPS", "NvrxPolicy"]

#: The iteration NVRx's quoted in-process restart cost includes, re-run after the restart.
REDO_STEPS = 1


class NvrxPolicy(CheckpointFallback):
    name = "nvrx"

    def start(self) -> tuple[Phase, ...]:
        return self.begin(stalls=False)   # asynchronous checkpoints: no stall

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        if not self.needs_restart(failed, joined):
            return Reaction(ctx.remaining, 0.0, "spare")
        self.plan, reaction = self.restart(ctx, sorted(self.live), stalls=False, label="run",
                                           restart_s=self.constants.nvrx_restart_s,
                                           redo_steps=REDO_STEPS)
        return reaction
