"""One training step, and applying a step's summed gradients.

A step is

1. zero gradients; run this device's 1F1B order (:mod:`.executor`), forwards under the
   training precision (:mod:`.precision`);
2. sum gradients over each bucket's holders by colour rounds, and each tied weight's over its
   copies (:mod:`.grad_sync`); unscale them (fp16);
3. vote: all-reduce the loss and each device's share of the squared gradient norm over the
   world (the commit point, see :mod:`.commit`);
4. apply (:func:`apply_step`): clip by the job-wide norm (``max_grad_norm``), optimizer step
   (skipped by every rank when an fp16 step overflowed), loss scale and learning-rate schedule
   move on; the step is committed, and the script's registered objects see it
   (:mod:`.user_state`).

Why apart from the trainer: entering a plan applies a step too (a rank that rolls forward
applies the summed gradients its peers applied), and it must not call back into the trainer
that called it. The functions take the trainer's state (its fields) and call only downward.
A broken transfer or collective raises :class:`~.errors.PeerLost`.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerLost, PipelineRuntimeError
from ..state.user_state import after_step
from .executor import OpTiming
from .grad_sync import group_by_kind, square_share, sync_gradients

__all__ = ["StepResult", "apply_step", "learning_rate", "train_step"]

#: a PipelineTrainer, read and updated through its fields (never its methods)
TrainerState = Any


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean over the global batch
    compute_s: float
    sync_s: float
    step_s: float
    allreduces: int
    timings: tuple[OpTiming, ...] = ()
    redone: bool = False  # trained again after a rollback (to a checkpoint, or to step 0)
    grad_norm: float = math.nan  # job-wide gradient norm before clipping (each weight once)
    lr: float = math.nan         # learning rate the step was applied with (first param group)
    skipped: bool = False        # fp16: a gradient overflowed, no rank applied the step
    data_s: float = 0.0          # this device's wait for its micro-batches (within compute_s)
    eval_loss: float = math.nan  # held-out mean loss after this step (run's ``evaluate``)


def learning_rate(t: TrainerState) -> float:
    return float(t.optimizer.param_groups[0]["lr"]) if t.optimizer else math.nan


def apply_step(t: TrainerState, norm: float) -> bool:
    """Apply the summed gradients of step ``t.committed`` given the step's job-wide gradient
    norm: clip, step (unless an fp16 step overflowed: every rank skips it), move the loss
    scale and the schedule on. Returns whether the optimizer step was skipped."""
    if t.committed is None or t.synced != t.committed:
        raise PipelineRuntimeError("internal: apply without the step's summed gradients")
    skipped = t.loss_scale.skips(norm)
    if t.optimizer is not None and not skipped:
        if t.max_grad_norm is not None:
            coefficient = t.max_grad_norm / (norm + 1e-6)
            if coefficient < 1.0:   # one _foreach_mul_ per (device, dtype), as torch clips
                grads = [p.grad for group in t.optimizer.param_groups for p in group["params"]
                         if p.grad is not None]
                for kind in group_by_kind(grads):
                    torch._foreach_mul_(kind, coefficient)
        t.optimizer.step()
    t.loss_scale = t.loss_scale.after(norm)
    if t.scheduler is not None:
        with warnings.catch_warnings():  # skipped fp16 steps: the schedule moves on anyway
            warnings.simplefilter("ignore", UserWarning)
            t.scheduler.step()
    t.committed += 1
    t.synced = None
    after_step([*(o for objects in t.extras.values() for o in objects.values()),
                *t.job_state.values()], t.committed - 1)
    return skipped


def _compute_and_sync(t: TrainerState, step: int, record: bool
                      ) -> tuple[float, float, tuple[OpTiming, ...], int, float]:
    """Steps 1-2 on a working device: (loss share, squared-norm share, timings, all-reduces
    issued, when compute ended)."""
    assert t.optimizer is not None and t.groups is not None
    t.optimizer.zero_grad(set_to_none=False)
    sums = t.sums   # started during the last backward where that pays, as gradients are final
    if sums is not None:
        sums.restart()
    outcome = t.executor.run(step, t.orders, record=record, on_phase=t.phases,
                             loss_scale=t.loss_scale.scale,
                             final_backward=(sums.armed if sums is not None and sums.overlaps
                                             else None),
                             superseded=t.superseded)
    compute_done = time.perf_counter()
    t.feed.read_ahead(step + 2)   # the readers work while this thread waits for the sums
    t.phases(step, "sync")
    issued = sync_gradients(t.layers, t.device, t.ranks, t.groups, rounds=t.rounds,
                            holders=t.holders, mode=t.sync_mode, ties=t.ties, tp_rank=t.tp_rank,
                            sums=sums)
    if not t.loss_scale.fixed:
        factor = t.loss_scale.unscale_factor()
        for module in t.layers.values():
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
    square = square_share(t.layers, t.device, t.holders, t.ties, t.tp_rank)
    return outcome.loss_sum, square, outcome.timings, issued, compute_done


def _vote(t: TrainerState, step: int, loss_sum: float, square: float) -> tuple[float, float]:
    """Step 3: (the global-batch loss, the job-wide gradient norm). A rank asked to stop for
    a preemption says so in the same all-reduce, so every rank learns at this step that it is
    the last (runtime/recovery/preemption.py)."""
    stop = 1.0 if t.preemption.requested else 0.0
    total = torch.tensor([loss_sum, square, stop], dtype=torch.float64)
    try:
        dist.all_reduce(total)
    except RuntimeError as exc:
        raise PeerLost(f"device {t.device} lost a peer in step {step}'s vote: {exc}") from exc
    loss, norm, stop = (float(x) for x in total.tolist())
    t.preemption.agreed = t.preemption.agreed or stop > 0
    return loss, math.sqrt(norm) if norm >= 0 else math.nan


def train_step(t: TrainerState, step: int, record: bool = False) -> StepResult:
    """Train global step ``step``, which must be the next one (collective)."""
    if step != t.committed:
        raise PipelineRuntimeError(
            f"step {step} is not the next step: {t.committed} steps are committed, so "
            f"the next one is step {t.committed}."
        )
    began = time.perf_counter()
    waited = t.feed.waited_s
    loss_sum, square, timings, issued, compute_done = 0.0, 0.0, (), 0, began
    if t.executor is not None:
        loss_sum, square, timings, issued, compute_done = _compute_and_sync(t, step, record)
    t.synced = step
    t.snapshots.fence(step)   # a snapshot under way is complete here before the commit point
    synced = time.perf_counter()
    t.phases(step, "vote")
    loss, norm = _vote(t, step, loss_sum, square)
    t.phases(step, "apply")
    lr = learning_rate(t)
    skipped = apply_step(t, norm)
    result = StepResult(step, loss, compute_done - began, synced - compute_done,
                        time.perf_counter() - began, issued, timings,
                        redone=step < t.redo_below, grad_norm=norm, lr=lr, skipped=skipped,
                        data_s=t.feed.waited_s - waited)
    t.results[step] = result
    t.results.pop(step - 8, None)
    t.phases(step, "applied")
    return result
