"""What a training script hands the runtime: a model as an ordered list of layers.

The runtime never sees the whole model on one device. It asks ``build_layer(i)`` only for the
layers of its stage, seeding torch's generator with ``(seed, i)`` just for that call, so layer
``i`` starts with the same weights on every device that holds it, under every plan, and in a
single-process reference. The loss is computed per micro-batch on the last stage (a mean over
the micro-batch's samples); data is a pure function of the global sample index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import PipelineRuntimeError

__all__ = ["PipelineModel", "build_layers", "collate"]

LayerFactory = Callable[[int], nn.Module]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SampleFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PipelineModel:
    """A model the runtime can cut anywhere.

    ``build_layer(i)`` builds layer ``i`` (0-based) of ``num_layers``; layer ``i + 1`` consumes
    layer ``i``'s output tensor. ``loss(output, target)`` returns the mean loss of one
    micro-batch. ``sample(index)`` returns ``(input, target)`` of one global sample.
    ``make_optimizer(params)`` builds the optimizer of one device's layers; optimizers whose
    update of a parameter depends only on that parameter (SGD, Adam, AdamW, ...) give the same
    result however the layers are split.
    """

    num_layers: int
    build_layer: LayerFactory
    loss: LossFn
    make_optimizer: OptimizerFactory
    sample: SampleFn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise PipelineRuntimeError(
                f"PipelineModel.num_layers = {self.num_layers}; a model needs at least one layer."
            )


def build_layers(model: PipelineModel, start: int, end: int) -> nn.ModuleList:
    """Layers ``[start, end)``, each built under its own seed so its weights do not depend on
    which device builds it or what was built before."""
    if not 0 <= start < end <= model.num_layers:
        raise PipelineRuntimeError(
            f"layer range [{start}, {end}) is not inside the model's {model.num_layers} layers; "
            "the plan was made for a different model: pass a plan whose num_layers matches."
        )
    layers = []
    for i in range(start, end):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.seed * 1_000_003 + i)
            layer = model.build_layer(i)
        if not isinstance(layer, nn.Module):
            raise PipelineRuntimeError(
                f"build_layer({i}) returned {type(layer).__name__}; it must return an nn.Module."
            )
        layers.append(layer)
    return nn.ModuleList(layers)


def collate(model: PipelineModel, sample_ids: Sequence[int]) -> tuple[Any, Any]:
    """Stack the samples ``sample_ids`` into one micro-batch ``(inputs, targets)``."""
    pairs = [model.sample(int(i)) for i in sample_ids]
    inputs = torch.stack([torch.as_tensor(x) for x, _ in pairs])
    targets = torch.stack([torch.as_tensor(y) for _, y in pairs])
    return inputs, targets
