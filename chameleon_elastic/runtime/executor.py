"""Run one device's 1F1B operation order for one training step.

The order comes from :func:`chameleon_elastic.planning.schedule.device_orders` and is executed
exactly as given; this module never decides what runs when. Each operation is one micro-batch
through this device's layers:

- ``F``: take the micro-batch's inputs from the data (first stage) or receive the activation
  from ``op.source``; run the layers; on the last stage compute the loss divided by the global
  micro-batch count (so SUM over all gradients is the global-batch mean), otherwise send the
  output to ``op.dest`` without blocking.
- ``B``: on the last stage back-propagate the loss, otherwise receive the output's gradient
  from ``op.source`` and back-propagate it; then send the input's gradient to ``op.dest``
  without blocking (nothing is sent from the first stage).

A rerouted micro-batch is an operation whose ``device`` is a data-parallel peer of the dead
device; the peer holds the same layers, so it runs them on its own copy and the gradients land
there, to be summed with the other holders' at the gradient sync.

Point-to-point messages carry a tag unique to (pipeline, micro-batch, consuming stage,
direction), so a receive can never take another micro-batch's tensor even when two devices
walk their orders differently. Receives block; sends are asynchronous and awaited at the end
of the step, which is what the schedule's no-deadlock guarantee assumes. Receive buffers are
sized from the stage's input shape (known before the step, see ``boundary_shape``) and, for
gradients, from the output this device produced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import ExecutionPlan

from .data import sample_ids
from .errors import PeerLost, PipelineRuntimeError
from .model import PipelineModel, collate
from .topology import RankMap

__all__ = ["OpTiming", "PipelineExecutor", "StepOutcome", "TensorSpec", "boundary_shape"]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class OpTiming:
    kind: str
    pipeline: int
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class StepOutcome:
    """``loss_sum``: this device's share of the global-batch mean loss (0 off the last stage)."""

    loss_sum: float
    ops: int
    timings: tuple[OpTiming, ...] = ()


def boundary_shape(model: PipelineModel, layer: int, micro_batch_size: int) -> TensorSpec:
    """Shape and dtype of the tensor entering ``layer`` for one micro-batch.

    Layers ``[0, layer)`` are built on the meta device and run on a meta copy of sample 0's
    micro-batch: no memory, no arithmetic, the same answer on every device.
    """
    inputs, _ = collate(model, range(micro_batch_size))
    if layer == 0:
        return TensorSpec(tuple(inputs.shape), inputs.dtype)
    try:
        with torch.device("meta"):
            layers = [model.build_layer(i) for i in range(layer)]
        x = inputs.to("meta")
        with torch.no_grad():
            for m in layers:
                x = m(x)
    except Exception as exc:
        raise PipelineRuntimeError(
            f"cannot infer the shape entering layer {layer} on the meta device ({exc}); make "
            "build_layer honour torch's default device (create tensors without device=...), "
            "so stage boundaries can be sized without running the model."
        ) from exc
    if not isinstance(x, torch.Tensor):
        raise PipelineRuntimeError(
            f"layer {layer - 1} returns {type(x).__name__}; pipeline stages exchange exactly "
            "one tensor, so every layer must return a single tensor."
        )
    return TensorSpec(tuple(x.shape), x.dtype)


class PipelineExecutor:
    """Executes the operation orders of one device; owns no process groups."""

    def __init__(self, plan: ExecutionPlan, device: int, model: PipelineModel,
                 layers: nn.ModuleList | None, layer_start: int, micro_batch_size: int,
                 ranks: RankMap, torch_device: torch.device | None = None) -> None:
        self.plan = plan
        self.device = device
        self.model = model
        self.layer_start = layer_start
        self.layers = layers if layers is not None else nn.ModuleList()
        self.micro_batch_size = micro_batch_size
        self.ranks = ranks
        self.torch_device = torch_device or torch.device("cpu")
        self._max_quota = max(p.micro_batches for p in plan.pipelines) or 1
        self._max_stages = max(p.num_stages for p in plan.pipelines)
        self._input_spec = (boundary_shape(model, layer_start, micro_batch_size)
                            if layer_start > 0 else None)

    # ------------------------------------------------------------------ helpers

    def _tag(self, pipeline: int, micro_batch: int, consumer_stage: int, backward: bool) -> int:
        key = (pipeline * self._max_quota + micro_batch) * self._max_stages + consumer_stage
        return key * 2 + int(backward)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def _recv(self, spec: TensorSpec, device: int, tag: int) -> torch.Tensor:
        buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.torch_device)
        try:
            dist.recv(buf, src=self.ranks.rank(device), tag=tag)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} timed out or failed receiving from device "
                           f"{device} (tag {tag}): {exc}") from exc
        return buf

    def _send(self, tensor: torch.Tensor, device: int, tag: int, pending: list) -> None:
        tensor = tensor.detach().contiguous()
        try:
            work = dist.isend(tensor, dst=self.ranks.rank(device), tag=tag)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} could not send to device {device}: {exc}") from exc
        pending.append((work, tensor))

    def _batch(self, step: int, pipeline: int, micro_batch: int):
        ids = sample_ids(step, self.plan, pipeline, micro_batch, self.micro_batch_size)
        inputs, targets = collate(self.model, ids)
        return inputs.to(self.torch_device), targets.to(self.torch_device)

    # ------------------------------------------------------------------ one step

    def run(self, step: int, ops: Sequence, record: bool = False,
            on_phase: Callable[[int, str], None] | None = None) -> StepOutcome:
        """Execute ``ops`` (this device's order) for ``step``; gradients accumulate in place.
        ``on_phase(step, "forward" | "backward")`` runs before the first operation of each kind
        (the trainer's fault-injection hook)."""
        scale = 1.0 / self.plan.global_micro_batches
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        pending: list = []
        timings: list[OpTiming] = []
        loss_sum = 0.0
        entered: set[str] = set()
        for op in ops:
            if on_phase is not None and op.kind not in entered:
                entered.add(op.kind)
                on_phase(step, "forward" if op.kind == "F" else "backward")
            if op.device != self.device:
                raise PipelineRuntimeError(
                    f"operation {op} belongs to device {op.device}, not {self.device}; pass "
                    "this device's entry of device_orders(plan)."
                )
            began = time.perf_counter() if record else 0.0
            key = (op.pipeline, op.micro_batch)
            if op.kind == "F":
                targets = None
                if op.source is None:
                    x, targets = self._batch(step, op.pipeline, op.micro_batch)
                else:
                    assert self._input_spec is not None
                    x = self._recv(self._input_spec, op.source,
                                   self._tag(op.pipeline, op.micro_batch, op.stage, False))
                    x.requires_grad_(True)
                out = self._forward(x)
                if op.dest is None:
                    if targets is None:
                        _, targets = self._batch(step, op.pipeline, op.micro_batch)
                    loss = self.model.loss(out, targets)
                    loss_sum += float(loss.detach()) * scale
                    stash[key] = (x, loss * scale)
                else:
                    self._send(out, op.dest,
                               self._tag(op.pipeline, op.micro_batch, op.stage + 1, False),
                               pending)
                    stash[key] = (x, out)
            elif op.kind == "B":
                try:
                    x, out = stash.pop(key)
                except KeyError:
                    raise PipelineRuntimeError(
                        f"backward of pipeline {op.pipeline} micro-batch {op.micro_batch} comes "
                        f"before its forward on device {self.device}; the order is invalid."
                    ) from None
                if op.source is None:
                    out.backward()
                else:
                    grad = self._recv(TensorSpec(tuple(out.shape), out.dtype), op.source,
                                      self._tag(op.pipeline, op.micro_batch, op.stage, True))
                    torch.autograd.backward(out, grad)
                if op.dest is not None:
                    if x.grad is None:
                        raise PipelineRuntimeError(
                            f"stage input of device {self.device} got no gradient; the first "
                            "layer of a stage must use its input differentiably."
                        )
                    self._send(x.grad, op.dest,
                               self._tag(op.pipeline, op.micro_batch, op.stage - 1, True),
                               pending)
            else:
                raise PipelineRuntimeError(f"unknown operation kind {op.kind!r}")
            if record:
                timings.append(OpTiming(op.kind, op.pipeline, op.micro_batch, began,
                                        time.perf_counter()))
        for work, _ in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerLost(f"device {self.device} could not complete a send of step "
                               f"{step}: {exc}") from exc
        if stash:
            raise PipelineRuntimeError(
                f"device {self.device} ran forwards without backwards for {sorted(stash)}; the "
                "operation order is incomplete."
            )
        return StepOutcome(loss_sum, len(ops), tuple(timings))
