"""Learning-rate schedules for ``PipelineModel.make_scheduler``.

The runtime rebuilds a schedule in any process that needs it (a plan change builds a new
optimizer, a joiner replays the committed steps), so a schedule is a function of the optimizer
and its step count only. This is the one large models are usually trained with, shared by the
examples rather than copied into each.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["warmup_cosine", "warmup_cosine_factor"]


def warmup_cosine_factor(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int,
                  total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """``make_scheduler=functools.partial(warmup_cosine, warmup=W, total=STEPS)``."""
    factor = functools.partial(warmup_cosine_factor, warmup=warmup, total=total)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
