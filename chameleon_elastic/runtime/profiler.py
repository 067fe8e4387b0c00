"""Runtime-side layer profiler: the per-layer figures a job spec's [model] table needs.

Each layer is built alone (as a stage would build it) and timed on one micro-batch: forward
with the input requiring gradients, then backward from a gradient of ones, ``repeats`` times
after ``warmup`` untimed runs; the median is kept, which shrugs off the odd descheduling on a
shared machine. Bytes are counted, not timed: parameters, the optimizer state after one real
optimizer step, and the layer's output (what a pipeline stage keeps per micro-batch in flight).
The launcher has its own profiler for whole scripts; this one needs a :class:`PipelineModel`
and exists so the runtime can feed the estimator from the very layers it trains.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from .model import PipelineModel, build_layers, collate

__all__ = ["LayerProfile", "profile_layers"]


@dataclass(frozen=True)
class LayerProfile:
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    param_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]

    def model_table(self) -> dict[str, Any]:
        """The ``[model]`` table of a job spec (``JobSpec.from_dict({"model": ...})``)."""
        return {
            "layers": len(self.forward_s),
            "forward_s": list(self.forward_s),
            "backward_s": list(self.backward_s),
            "param_bytes": list(self.param_bytes),
            "optimizer_bytes": list(self.optimizer_bytes),
            "activation_bytes": list(self.activation_bytes),
        }


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def profile_layers(model: PipelineModel, micro_batch_size: int = 1, repeats: int = 5,
                   warmup: int = 1, device: torch.device | None = None) -> LayerProfile:
    device = device or torch.device("cpu")
    x, _ = collate(model, range(micro_batch_size))
    x = x.to(device)
    fwd, bwd, params, optim, acts = [], [], [], [], []
    for i in range(model.num_layers):
        layer = build_layers(model, i, i + 1)[0].to(device)
        floating = x.is_floating_point()
        f_times, b_times = [], []
        out = None
        for rep in range(warmup + repeats):
            inp = x.detach().requires_grad_(floating)
            t0 = time.perf_counter()
            out = layer(inp)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            if rep >= warmup:
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
        assert out is not None
        optimizer = model.make_optimizer(layer.parameters())
        optimizer.step()
        state = [v for s in optimizer.state.values() for v in s.values()]
        fwd.append(statistics.median(f_times))
        bwd.append(statistics.median(b_times))
        params.append(float(_nbytes(layer.parameters())))
        optim.append(float(_nbytes(state)))
        acts.append(float(_nbytes([out])))
        x = out.detach()
    return LayerProfile(tuple(fwd), tuple(bwd), tuple(params), tuple(optim), tuple(acts))
