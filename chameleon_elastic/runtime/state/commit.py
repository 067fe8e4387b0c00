"""The commit protocol: an optimizer step is applied by every holder of a layer or by none.

Step ``t`` on every rank of the world, in this order:

=========  ============================================  ======================================
phase      what                                          afterwards
=========  ============================================  ======================================
forward    this device's 1F1B forwards (point to point)
backward   its backwards (point to point)
sync       gradients summed over each layer's holders    ``synced = t``: .grad holds the sums
vote       all-reduce of the loss and the squared        the COMMIT POINT
           gradient norm over the whole world
apply      clip by the norm, ``optimizer.step()``,       ``committed = t + 1``
           loss scale and LR schedule move on
=========  ============================================  ======================================

The vote's value is the step's loss; its *completion* is the vote. A rank contributes to it only
after its own sync has finished, and no rank can finish an all-reduce before every rank has
contributed. Two facts follow:

1. If any survivor has committed ``t + 1``, every rank, the dead included, finished step t's
   sync. So every survivor holds step t's summed gradients (nothing touches ``.grad`` between
   the sync and the next step's start) and can apply them itself: it *rolls forward*.
2. No survivor is two steps ahead of another: committing ``t + 2`` needs every rank in step
   ``t + 1``'s vote, hence past step t's apply.

After a failure the new world all-gathers one :class:`Row` per rank and :func:`agree` computes,
identically on every rank, the step to resume at, ``R = max committed``; ranks at ``R - 1``
roll forward. A rank that rolls forward did not see step R - 1's vote complete, so the rows of
the ranks at R carry that vote's gradient norm (for clipping and fp16's overflow test) and the
loss scale to continue with. Then every live replica of every layer holds step R's state, bit
for bit what its peers computed (the same summed gradients, clipped by the same norm, through
the same optimizer). A rank at ``R - 1``
without step ``R - 1``'s gradients would contradict fact 1: that is a :class:`ProtocolError`,
never papered over. Where a layer has no live holder at all, state comes from the last committed
checkpoint, for every layer (one consistent step), and the steps since are redone and said so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import PipelineRuntimeError

__all__ = ["Agreement", "ProtocolError", "Row", "StateLost", "agree"]

_FIELDS = 12


class ProtocolError(PipelineRuntimeError):
    """The survivors' states contradict the commit protocol (a bug, not a fault)."""


class StateLost(PipelineRuntimeError):
    """Some layer's state exists nowhere: no live holder and no checkpoint."""


@dataclass(frozen=True)
class Row:
    """What one rank brings to the agreement. ``committed`` is None for a process that holds no
    training state (a fresh worker); ``held`` is the layer range it holds, ``(0, 0)`` for none."""

    device: int
    committed: int | None
    synced: int | None
    held: tuple[int, int]
    last_loss: float            # loss of step committed - 1, NaN when unknown
    reported: int               # last step this rank handed to a report callback, -1 for none
    checkpoint: int | None      # step of the newest committed checkpoint it can read
    last_norm: float = math.nan     # gradient norm of step committed - 1 (from its vote)
    scale: float = 1.0              # loss scale for step committed (fp16; 1 otherwise)
    scale_good: int = 0             # clean steps since the scale last changed
    tp_rank: int = 0                # this card's place in its unit (tensor parallelism)

    def to_tensor(self) -> torch.Tensor:
        def num(x: int | None) -> float:
            return -1.0 if x is None else float(x)

        return torch.tensor([self.device, num(self.committed), num(self.synced), *self.held,
                             self.last_loss, self.reported, num(self.checkpoint),
                             self.last_norm, self.scale, self.scale_good, self.tp_rank],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Row:
        v = [float(x) for x in t.tolist()]

        def opt(x: float) -> int | None:
            return None if x < 0 else int(x)

        return cls(int(v[0]), opt(v[1]), opt(v[2]), (int(v[3]), int(v[4])), v[5], int(v[6]),
                   opt(v[7]), v[8], v[9], int(v[10]), int(v[11]))

    @staticmethod
    def width() -> int:
        return _FIELDS


@dataclass(frozen=True)
class Agreement:
    """The outcome every rank computes from the same rows."""

    resume: int | None                 # R = max committed; None when nobody holds state
    roll_forward: frozenset[tuple[int, int]]  # (device, tp rank) of the cards at R - 1: they apply
    holders: dict[int, tuple[int, ...]]  # layer -> devices holding it at step R
    last_loss: float                   # loss of step R - 1 as a holder of step R knows it
    reported: int                      # last step reported by anyone, -1 for none
    checkpoint: int | None             # newest committed checkpoint any rank can read
    last_norm: float = math.nan        # step R - 1's gradient norm (from its vote)
    scale: tuple[float, int] = (1.0, 0)  # loss scale and clean-step count at step R

    def orphans(self, num_layers: int) -> list[int]:
        """Layers no live process holds at step R."""
        return [x for x in range(num_layers) if x not in self.holders]


def agree(rows: Sequence[Row]) -> Agreement:
    """The resume step, who rolls forward, and who holds what (pure; same on every rank)."""
    stateful = [r for r in rows if r.committed is not None]
    resume = max((r.committed for r in stateful), default=None)  # type: ignore[type-var]
    roll = set()
    for r in stateful:
        if r.committed == resume:
            continue
        if r.committed != resume - 1 or r.synced != r.committed:  # type: ignore[operator]
            raise ProtocolError(
                f"device {r.device} has committed {r.committed} steps (summed gradients of "
                f"step {r.synced}) while another survivor has committed {resume}; the commit "
                "protocol allows only a roll forward by one step with that step's gradients."
            )
        roll.add((r.device, r.tp_rank))
    holders: dict[int, set[int]] = {}
    for r in stateful:   # every card of a unit holds its device's layers: count the device once
        for layer in range(*r.held):
            holders.setdefault(layer, set()).add(r.device)
    ahead = [r for r in stateful if r.committed == resume]
    known = [r for r in ahead if not math.isnan(r.last_loss)]
    checkpoints = [r.checkpoint for r in rows if r.checkpoint is not None]
    return Agreement(
        resume=resume,
        roll_forward=frozenset(roll),
        holders={layer: tuple(sorted(d)) for layer, d in sorted(holders.items())},
        last_loss=known[0].last_loss if known else math.nan,
        reported=max((r.reported for r in rows), default=-1),
        checkpoint=max(checkpoints) if checkpoints else None,
        last_norm=known[0].last_norm if known else math.nan,
        scale=(ahead[0].scale, ahead[0].scale_good) if ahead else (1.0, 0),
    )
