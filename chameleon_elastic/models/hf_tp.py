"""transformers' ``replicated_with_grad_allreduce`` as a torch ``ParallelStyle``.

Qwen3 normalises each attention head's queries and keys (``q_norm``, ``k_norm``: one weight of
``head_dim`` shared by all heads). Under tensor parallelism a card holds only some heads, so
the weight stays whole on every card but each card's gradient covers only its heads: the unit
must sum them. :class:`SumGradients` keeps the module's parameters as they are (plain tensors,
replicated, as the runtime expects of norms) and adds a gradient hook that all-reduces each
gradient over the unit's group as backward produces it.

Every card of a unit runs the same micro-batches in the same order (docs/runtime.md), so the
cards reach these all-reduces in the same order; a peer lost mid-collective breaks it as any
collective inside a sharded layer does (the executor turns that into a lost peer).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["SumGradients"]


def _summed(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class SumGradients(ParallelStyle):
    """A replicated module whose gradients are partial on each card: summed over the unit."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(functools.partial(_summed, group=group))
        return module
