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
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from chameleon_elastic.runtime.model import PipelineModel

__all__ = ["EmulatedLayer", "Reference", "RegressionData", "StepCounter", "WeightEMA",
           "adamw_groups", "emulated_model", "featured_model", "megatron_plan", "mlp_model",
           "reference_evaluation", "reference_run", "reference_training", "tp_mlp_model",
           "warmup_cosine"]


class _Dense(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.linear(x)))


def _dense(i: int, width: int, dtype: torch.dtype, dropout: float = 0.0) -> nn.Module:
    return _Dense(width, dtype, dropout)


def _regression_sample(index: int, width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed * 7_919 + index)
    x = torch.randn(width, generator=g, dtype=dtype)
    y = torch.sin(x.flip(0)) * 0.5
    return x, y


class RegressionData(torch.utils.data.Dataset):
    """:func:`mlp_model`'s samples as a map-style dataset of ``length`` samples (``seed``: another
    seed gives other samples, e.g. a held-out set)."""

    def __init__(self, length: int, width: int = 16, dtype: torch.dtype = torch.float64,
                 seed: int = 0) -> None:
        self.length, self.width, self.dtype, self.seed = length, width, dtype, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of a dataset of {self.length}")
        return _regression_sample(index, self.width, self.dtype, self.seed)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _sgd(params: Iterable[nn.Parameter], lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def mlp_model(layers: int = 7, width: int = 16, dtype: torch.dtype = torch.float64,
              seed: int = 0, lr: float = 0.1, momentum: float = 0.9,
              dataset: object = None) -> PipelineModel:
    """``dataset``: train on it in seeded epochs instead of on ``sample(index)``."""
    return PipelineModel(
        num_layers=layers,
        build_layer=functools.partial(_dense, width=width, dtype=dtype),
        loss=_mse,
        make_optimizer=functools.partial(_sgd, lr=lr, momentum=momentum),
        sample=(None if dataset is not None else
                functools.partial(_regression_sample, width=width, dtype=dtype, seed=seed)),
        seed=seed,
        dataset=dataset,
    )


class _Gated(nn.Module):
    """A layer of :func:`featured_model`: the hidden state travels with a mask (no gradient)
    and a step counter (an integer), as a tuple on even boundaries and a dict on odd ones."""

    def __init__(self, i: int, layers: int, width: int, dtype: torch.dtype,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.i, self.last = i, i == layers - 1
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        if self.i == 0:
            h, mask, count = x, (x > 0).to(x.dtype), torch.zeros(x.shape[0], dtype=torch.int64)
        elif isinstance(x, dict):
            h, mask, count = x["h"], x["mask"], x["count"]
        else:
            h, mask, count = x
        h = (self.dropout(torch.tanh(self.linear(h))) * (0.5 + 0.5 * mask) if not self.last
             else self.linear(h))
        if self.last:
            return h
        count = count + 1
        return {"h": h, "mask": mask, "count": count} if self.i % 2 else (h, mask, count)


def _gated(i: int, layers: int, width: int, dtype: torch.dtype,
           dropout: float = 0.0) -> nn.Module:
    return _Gated(i, layers, width, dtype, dropout)


def _adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def adamw_groups(named: Iterable[tuple[str, nn.Parameter]], lr: float,
                 weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW with parameter groups chosen by name, as LLMs are trained: no weight decay on
    biases, ``weight_decay`` on the rest."""
    named = list(named)
    groups = [{"params": [(n, p) for n, p in named if n.endswith(".bias") == bias],
               "weight_decay": 0.0 if bias else weight_decay} for bias in (False, True)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int,
                  total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up, then cosine decay: torch's chainable schedules, stepped once a step."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(optimizer, [
        sched.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
        sched.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup)),
    ], milestones=[warmup])


def featured_model(layers: int = 7, width: int = 8, dtype: torch.dtype = torch.float64,
                   seed: int = 0, lr: float = 0.05, tie: bool = True, schedule: bool = True,
                   structured: bool = True, groups: bool = False,
                   dropout: float = 0.0) -> PipelineModel:
    """A model with what real training brings: the first and last layers' weights tied, a
    warm-up + cosine schedule, AdamW, and stages that pass (hidden, mask, counter) as tuples
    and dicts (``structured``; else plain tensors through :func:`mlp_model`'s layers).
    ``groups``: AdamW's parameter groups chosen by name (:func:`adamw_groups`). ``dropout``:
    after every hidden layer's activation."""
    from chameleon_elastic.runtime.model import Tie

    build = (functools.partial(_gated, layers=layers, width=width, dtype=dtype, dropout=dropout)
             if structured else functools.partial(_dense, width=width, dtype=dtype,
                                                  dropout=dropout))
    return PipelineModel(
        num_layers=layers,
        build_layer=build,
        loss=_mse,
        make_optimizer=functools.partial(adamw_groups if groups else _adamw, lr=lr),
        sample=functools.partial(_regression_sample, width=width, dtype=dtype, seed=seed),
        seed=seed,
        make_scheduler=(functools.partial(warmup_cosine, warmup=2, total=8) if schedule
                        else None),
        named_parameters=groups,
        tied=((Tie(((0, "linear.weight"), (layers - 1, "linear.weight"))),) if tie else ()),
    )


class _MegatronMLP(nn.Module):
    """A residual MLP block as Megatron shards it: ``up`` column-wise, ``down`` row-wise."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width, dtype=dtype)
        self.down = nn.Linear(2 * width, width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _mlp_block(i: int, width: int, dtype: torch.dtype) -> nn.Module:
    return _MegatronMLP(width, dtype)


def megatron_plan(i: int) -> dict:
    """The tensor-parallel plan of every :func:`tp_mlp_model` layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def tp_mlp_model(layers: int = 6, width: int = 8, dtype: torch.dtype = torch.float64,
                 seed: int = 0, lr: float = 0.05) -> PipelineModel:
    """Residual MLP blocks with a tensor-parallel plan (``megatron_plan``), AdamW."""
    return PipelineModel(
        num_layers=layers,
        build_layer=functools.partial(_mlp_block, width=width, dtype=dtype),
        loss=_mse,
        make_optimizer=functools.partial(_adamw, lr=lr),
        sample=functools.partial(_regression_sample, width=width, dtype=dtype, seed=seed),
        seed=seed,
        tp_plan=megatron_plan,
    )


class _Timed(torch.autograd.Function):
    """Occupies the "device" for a fixed time. It keeps a tensor for its backward, as a real
    kernel does, so activation recomputation replays it too (torch stops recomputing after the
    last saved tensor)."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        out = x.clone()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 - unpacking is what triggers a recomputation
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """Linear + tanh whose forward/backward take at least ``forward_s``/``backward_s``.

    The timed node sits after the weights, so its backward runs whenever the layer has
    gradients to compute, as a real layer's weight-gradient kernels do, even in the first stage
    where nothing needs the input's gradient."""

    def __init__(self, width: int, forward_s: float, backward_s: float,
                 params: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.linear = nn.Linear(width, width, dtype=dtype)
        # optional extra weight so gradient sync moves a realistic amount of data
        self.extra = nn.Parameter(torch.zeros(params, dtype=dtype)) if params else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Timed.apply(torch.tanh(self.linear(x)), self.forward_s, self.backward_s)
        if self.extra is not None:
            y = y + self.extra.sum() * 0.0
        return y


def _emulated(i: int, width: int, forward_s: float, backward_s: float,
              params: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    return EmulatedLayer(width, forward_s, backward_s, params, dtype)


def emulated_model(layers: int, forward_s: float, backward_s: float, width: int = 16,
                   params: int = 0, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> PipelineModel:
    """Layers that occupy their "device" by sleeping ``forward_s`` / ``backward_s`` around a
    tiny real computation: on a CPU with fewer cores than devices, a stopped or throttled
    process slows only its own device, as on accelerators. The losses are real and depend
    only on the seed (times 0 give the same training, fast: a reference run)."""
    return PipelineModel(
        num_layers=layers,
        build_layer=functools.partial(_emulated, width=width, forward_s=forward_s,
                                      backward_s=backward_s, params=params, dtype=dtype),
        loss=_mse,
        make_optimizer=functools.partial(_sgd, lr=0.01, momentum=0.0),
        sample=functools.partial(_regression_sample, width=width, dtype=dtype, seed=seed),
        seed=seed,
    )


class WeightEMA:
    """An exponential moving average of one layer's parameters, updated after every step: a
    per-layer user state (``layer_state={"ema": WeightEMA}``, :mod:`.user_state`)."""

    def __init__(self, layer: int, module: nn.Module, decay: float = 0.9) -> None:
        self.module, self.decay = module, decay
        self.shadow = {n: p.detach().clone() for n, p in module.named_parameters()}

    def after_step(self, step: int) -> None:
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                self.shadow[name].copy_(value)


class StepCounter:
    """Counts the steps it saw and remembers the last: a job-wide user state."""

    def __init__(self) -> None:
        self.steps, self.last = 0, -1

    def after_step(self, step: int) -> None:
        self.steps, self.last = self.steps + 1, step

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "last": self.last}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps, self.last = int(state["steps"]), int(state["last"])


@dataclass(frozen=True)
class Reference:
    """Single-process ground truth: per-step loss, gradient norm (before clipping) and
    learning rate, and the layers after training (tied weights truly shared)."""

    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    layers: nn.ModuleList


def reference_run(model: PipelineModel, steps: int, global_micro_batches: int,
                  micro_batch_size: int = 1, *, max_grad_norm: float | None = None,
                  precision: str = "fp32",
                  after_step: Callable[[int, nn.ModuleList], None] | None = None) -> Reference:
    """Single-process training on the same global batches, with torch's own tools: one shared
    parameter per tie, ``clip_grad_norm_``, autocast, ``GradScaler`` for fp16, the model's
    schedule stepped once per step, each layer on the random stream of (seed, step, global
    micro-batch, layer) (:mod:`.streams`).

    Per step, the loss is the mean over the global batch computed as the sum of per-micro-batch
    mean losses divided by the micro-batch count, exactly the runtime's weighting.
    ``after_step(step, layers)`` runs after each step's optimizer step and schedule (where the
    trainer calls its registered objects' ``after_step``).
    """
    from chameleon_elastic.runtime.data import step_sample_ids
    from chameleon_elastic.runtime.execution.streams import layer_seeder, own_streams
    from chameleon_elastic.runtime.model import (
        build_layers,
        collate,
        sample_indices,
        tied_parameter,
    )
    from chameleon_elastic.runtime.precision import autocast, check_precision

    precision = check_precision(precision)
    device = torch.device("cpu")
    layers = build_layers(model, 0, model.num_layers)
    for tie in model.tied:  # one parameter, as a single-process model would have it
        (first, first_name), *rest = tie.members
        shared = tied_parameter(layers[first], first, first_name)
        for x, name in rest:
            owner, _, leaf = name.rpartition(".")
            target = layers[x].get_submodule(owner) if owner else layers[x]
            setattr(target, leaf, shared)
    named, seen = [], set()   # each shared parameter once, under its first name
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((model.parameter_name(i, name), p))
    params = [p for _, p in named]
    optimizer = model.make_optimizer(named if model.named_parameters else params)
    scheduler = model.make_scheduler(optimizer) if model.make_scheduler else None
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    out = Reference([], [], [], layers)
    for step in range(steps):
        optimizer.zero_grad()
        ids = sample_indices(model, step_sample_ids(step, global_micro_batches,
                                                    micro_batch_size),
                             global_micro_batches * micro_batch_size)
        total = 0.0
        for g in range(global_micro_batches):
            x, y = collate(model, ids[g * micro_batch_size:(g + 1) * micro_batch_size])
            with autocast(precision, device):
                with own_streams(device):
                    seed = layer_seeder(model.seed, step, g, device)
                    for i, layer in enumerate(layers):
                        seed(i)
                        x = layer(x)
                loss = model.loss(x, y) / global_micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss.detach())
        if scaler:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_grad_norm if max_grad_norm is not None else math.inf)
        out.lrs.append(float(optimizer.param_groups[0]["lr"]))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(step, layers)
        out.losses.append(total)
        out.grad_norms.append(float(norm))
    return out


def reference_training(model: PipelineModel, steps: int, global_micro_batches: int,
                       micro_batch_size: int = 1, **options) -> tuple[list[float], nn.ModuleList]:
    """:func:`reference_run`'s losses and layers (``options``: its keyword arguments)."""
    ref = reference_run(model, steps, global_micro_batches, micro_batch_size, **options)
    return ref.losses, ref.layers


def reference_evaluation(model: PipelineModel, layers: nn.ModuleList, dataset) -> float:
    """Single-process evaluation: the model's loss over every sample of ``dataset`` at once, in
    eval mode and without gradients (what the runtime's evaluation must equal)."""
    from chameleon_elastic.runtime.model import collate_samples

    x, y = collate_samples(dataset, range(len(dataset)))
    training = layers.training
    layers.eval()
    try:
        with torch.no_grad():
            for layer in layers:
                x = layer(x)
            return float(model.loss(x, y).double())
    finally:
        layers.train(training)
