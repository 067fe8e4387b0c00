"""Small picklable models for tests, benchmarks and examples.

``mlp_model`` is a stack of Linear + tanh layers on regression data that depends only on the
sample index (the runtime's data contract). Everything is built from module-level functions and
``functools.partial`` so a model can be sent to spawned worker processes.
``EmulatedLayer`` stands in for an accelerator kernel: forward and backward occupy the "device"
for a fixed wall time (a sleep, leaving the CPU free) around a tiny real computation, so
pipeline timing can be studied on a CPU machine with fewer cores than devices.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

import torch
from torch import nn

from .model import PipelineModel

__all__ = ["EmulatedLayer", "emulated_model", "mlp_model", "reference_training"]


class _Dense(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _dense(i: int, width: int, dtype: torch.dtype) -> nn.Module:
    return _Dense(width, dtype)


def _regression_sample(index: int, width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed * 7_919 + index)
    x = torch.randn(width, generator=g, dtype=dtype)
    y = torch.sin(x.flip(0)) * 0.5
    return x, y


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _sgd(params: Iterable[nn.Parameter], lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def mlp_model(layers: int = 7, width: int = 16, dtype: torch.dtype = torch.float64,
              seed: int = 0, lr: float = 0.1, momentum: float = 0.9) -> PipelineModel:
    return PipelineModel(
        num_layers=layers,
        build_layer=functools.partial(_dense, width=width, dtype=dtype),
        loss=_mse,
        make_optimizer=functools.partial(_sgd, lr=lr, momentum=momentum),
        sample=functools.partial(_regression_sample, width=width, dtype=dtype, seed=seed),
        seed=seed,
    )


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """Linear + tanh whose forward/backward take at least ``forward_s``/``backward_s``."""

    def __init__(self, width: int, forward_s: float, backward_s: float,
                 params: int = 0) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.linear = nn.Linear(width, width)
        # optional extra weight so gradient sync moves a realistic amount of data
        self.extra = nn.Parameter(torch.zeros(params)) if params else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(_Timed.apply(x, self.forward_s, self.backward_s)))
        if self.extra is not None:
            y = y + self.extra.sum() * 0.0
        return y


def _emulated(i: int, width: int, forward_s: float, backward_s: float,
              params: int) -> nn.Module:
    return EmulatedLayer(width, forward_s, backward_s, params)


def emulated_model(layers: int, forward_s: float, backward_s: float, width: int = 16,
                   params: int = 0, seed: int = 0) -> PipelineModel:
    return PipelineModel(
        num_layers=layers,
        build_layer=functools.partial(_emulated, width=width, forward_s=forward_s,
                                      backward_s=backward_s, params=params),
        loss=_mse,
        make_optimizer=functools.partial(_sgd, lr=0.01, momentum=0.0),
        sample=functools.partial(_regression_sample, width=width, dtype=torch.float32,
                                 seed=seed),
        seed=seed,
    )


def reference_training(model: PipelineModel, steps: int, global_micro_batches: int,
                       micro_batch_size: int = 1) -> tuple[list[float], nn.ModuleList]:
    """Single-process training on the same global batches: the ground truth for equivalence.

    Per step, the loss is the mean over the global batch computed as the sum of per-micro-batch
    mean losses divided by the micro-batch count, exactly the runtime's weighting.
    """
    from .data import step_sample_ids
    from .model import build_layers, collate

    layers = build_layers(model, 0, model.num_layers)
    optimizer = model.make_optimizer(layers.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        ids = list(step_sample_ids(step, global_micro_batches, micro_batch_size))
        total = 0.0
        for g in range(global_micro_batches):
            x, y = collate(model, ids[g * micro_batch_size:(g + 1) * micro_batch_size])
            for layer in layers:
                x = layer(x)
            loss = model.loss(x, y) / global_micro_batches
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, layers
