"""Mixed precision: autocast forwards over fp32 master weights, and fp16's loss scaling.

``bf16`` and ``fp16`` run every forward (and the loss) under ``torch.autocast``: parameters,
gradients and optimizer state stay fp32, as torch's own mixed precision does; only the
operations autocast lists run in low precision, and the tensors between stages carry whatever
dtype the stage produced. Backward runs outside autocast, as torch recommends.

fp16 overflows where bf16 does not, so ``fp16`` also scales the loss. Torch's ``GradScaler``
decides per process whether a step overflowed; a pipeline must decide for the whole job, or one
stage would step and another skip. So the scale lives here, as plain state that every rank
updates identically from the job-wide gradient norm the trainer's vote already computes: a
non-finite norm means some gradient overflowed somewhere, every rank skips the optimizer step
and halves the scale; 2000 clean steps in a row double it (torch's defaults). The state is a
pure function of the committed steps' norms, carried in the commit rows and checkpoints so a
process that joins, or a world restored from a checkpoint, continues with the same scale.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from chameleon_elastic.spec import PRECISIONS, Precision

from .errors import PipelineRuntimeError

__all__ = ["PRECISIONS", "LossScale", "Precision", "autocast", "check_precision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise PipelineRuntimeError(
            f"precision {precision!r} is not one of {', '.join(PRECISIONS)}; pass fp32, bf16 "
            "(autocast, no loss scaling) or fp16 (autocast with loss scaling)."
        )
    return precision  # type: ignore[return-value]


def autocast(precision: Precision, device: torch.device):
    """The context every forward and loss runs in: autocast for bf16/fp16, nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale: ``scale`` multiplies the loss; ``good`` counts clean steps
    since the last change. ``fixed``: no scaling at all (fp32, bf16)."""

    scale: float = 1.0
    good: int = 0
    fixed: bool = True

    GROWTH_INTERVAL = 2000

    @classmethod
    def for_precision(cls, precision: Precision) -> LossScale:
        return cls(2.0 ** 16, 0, False) if precision == "fp16" else cls()

    def after(self, norm: float) -> LossScale:
        """The scale for the next step, given this step's (unscaled) job-wide gradient norm."""
        if self.fixed:
            return self
        if not math.isfinite(norm):
            return replace(self, scale=self.scale * 0.5, good=0)
        if self.good + 1 >= self.GROWTH_INTERVAL:
            return replace(self, scale=self.scale * 2.0, good=0)
        return replace(self, good=self.good + 1)

    def skips(self, norm: float) -> bool:
        """Whether the optimizer step is skipped: only a scaled (fp16) step that overflowed."""
        return not self.fixed and not math.isfinite(norm)

    def unscale_factor(self) -> float:
        """What summed gradients are multiplied by before clipping and the step (torch's
        ``GradScaler`` multiplies by the fp32 reciprocal of its scale; so do we)."""
        return float(torch.tensor(self.scale, dtype=torch.float32).reciprocal())
