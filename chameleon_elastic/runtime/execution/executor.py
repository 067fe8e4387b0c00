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

What crosses a boundary is one tensor or a tuple / list / dict of tensors (:mod:`.tensors`),
sent leaf by leaf; gradients go back for the leaves that require one (hidden states), not for
the others (an attention mask, token ids). Point-to-point messages carry a tag unique to
(pipeline, micro-batch, consuming stage, direction, leaf), so a receive can never take another
micro-batch's tensor even when two devices walk their orders differently. Receives block; sends
are asynchronous and awaited at the end of the step, which is what the schedule's no-deadlock
guarantee assumes. Receive buffers are sized from the stage's input (known before the step, see
:func:`boundary_spec`) and, for gradients, from the output this device produced.

Forwards and the loss run under the trainer's precision (:mod:`.precision`: autocast for
bf16/fp16). Each layer runs on the random stream of (seed, step, global micro-batch, layer)
(:mod:`.streams`), so dropout does not depend on the plan. A stage the plan marks for
recomputation runs its layers under torch's non-reentrant activation checkpointing: per
micro-batch in flight it keeps only its input, and runs the forward again, under the same
autocast and random streams, just before that micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.torch_compat import fake_tensor_mode

from ..data import global_micro_batch
from ..errors import PeerLost, PipelineRuntimeError, communication_failure
from ..model import PipelineModel, _sizing, build_layers, collate, sample_indices
from ..precision import Precision, autocast
from ..tensors import Structure, flatten, leaf_map, unflatten
from ..topology import RankMap
from ..world import wire
from .feed import Feed
from .inbox import FifoInbox
from .streams import layer_seeder, own_streams

__all__ = ["BoundarySpec", "OpTiming", "PipelineExecutor", "StepOutcome", "TensorSpec",
           "boundary_spec"]

MAX_LEAVES = 64  # tensors per stage boundary; part of every message tag


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


@dataclass(frozen=True)
class BoundarySpec:
    """What enters a layer for one micro-batch: the tree's structure and one spec per leaf."""

    structure: Structure
    leaves: tuple[TensorSpec, ...]


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


def boundary_spec(model: PipelineModel, layer: int, micro_batch_size: int,
                  precision: Precision = "fp32",
                  device: torch.device | None = None) -> BoundarySpec:
    """Structure, shapes, dtypes and gradient flags of what enters ``layer``, per micro-batch.

    Layers ``[0, layer)`` run on fake tensors (no memory, no arithmetic, the same answer on
    every device) under the training precision's autocast, which decides the dtypes; a fake
    parameter requires gradients as a real one does, so the flags say which leaves carry a
    gradient back. ``build_layer`` is called with :func:`~.model.sizing_boundaries` true.

    A factory that cannot build or run under FakeTensorMode (deep-copying a module with
    buffers, a library that checks tensor types) is not an error: the layers are then run for
    real on one micro-batch, built one at a time under their seeds (one layer's memory at a
    time), and a warning says why in one sentence. Only when that fails too is it an error.
    """
    inputs, _ = collate(model, sample_indices(model, range(micro_batch_size),
                                              micro_batch_size))
    device = device or torch.device("cpu")
    try:
        with fake_tensor_mode(), _sizing(), _quiet("torch._subclasses.fake_tensor"):
            layers = [model.build_layer(i) for i in range(layer)]
            x = leaf_map(lambda t: t.to(device), inputs)
            with torch.enable_grad(), autocast(precision, device):
                for m in layers:
                    x = m(x)
            specs, structure = _specs(x, layer)
    except PipelineRuntimeError:
        raise
    except Exception as fake_exc:  # noqa: BLE001 - any failure on fake tensors falls back
        fake_error = _first_line(fake_exc)
        try:
            specs, structure = _real_boundary(model, layer, inputs, precision, device)
        except PipelineRuntimeError:
            raise
        except Exception as exc:
            raise PipelineRuntimeError(
                f"cannot size what enters layer {layer}: building and running layers 0-"
                f"{layer - 1} failed on fake tensors ({fake_error}) and for real "
                f"({_first_line(exc)}); layers must not depend on tensor values for their "
                "shapes (no .item(), no data-dependent branches)."
            ) from exc
        warnings.warn(
            f"stage boundary of layer {layer} sized by running layers 0-{layer - 1} for real "
            f"on one micro-batch, because build_layer or a layer's forward failed under "
            f"torch's FakeTensorMode ({fake_error}); see sizing_boundaries() in "
            "chameleon_elastic.runtime.model.", RuntimeWarning, stacklevel=2)
    if len(specs) > MAX_LEAVES:
        raise PipelineRuntimeError(
            f"layer {layer} receives {len(specs)} tensors; at most {MAX_LEAVES} may cross a "
            "stage boundary: pack them into fewer tensors."
        )
    return BoundarySpec(structure, specs)


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """torch logs a traceback when an operation fails on fake tensors; the fallback handles
    that failure, and the warning says it in one sentence."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _specs(x: Any, layer: int) -> tuple[tuple[TensorSpec, ...], Structure]:
    leaves, structure = flatten(x, f"the output of layer {layer - 1}")
    return tuple(TensorSpec(tuple(t.shape), t.dtype, bool(t.requires_grad))
                 for t in leaves), structure


def _real_boundary(model: PipelineModel, layer: int, inputs: Any, precision: Precision,
                   device: torch.device) -> tuple[tuple[TensorSpec, ...], Structure]:
    """The fallback of :func:`boundary_spec`: layers ``[0, layer)`` run for real, one built
    at a time (as in training: its seed, its tie), on one micro-batch."""
    x = leaf_map(lambda t: t.to(device), inputs)
    specs: tuple[TensorSpec, ...] = ()
    structure: Structure = None
    for i in range(layer):
        module = build_layers(model, i, i + 1)[0].to(device)
        with torch.enable_grad(), autocast(precision, device):
            x = module(x)
        specs, structure = _specs(x, i + 1)
        # cut the graph (one layer's memory at a time), keeping each leaf's gradient flag
        x = leaf_map(lambda t: t.detach().requires_grad_(t.requires_grad), x)
        del module
    return specs, structure


class PipelineExecutor:
    """Executes the operation orders of one device; owns no process groups.

    ``input_spec``: what enters this stage (:func:`boundary_spec` of its first layer; None for
    the first stage). ``recompute``: run the stage under activation checkpointing.
    ``loss_scale``: multiplies each micro-batch's loss before backward (fp16). ``tp_rank``:
    this card's place in its unit; it talks to the cards of the same rank, and only card 0 of
    the last stage counts the loss (every card of a unit computes it). ``feed``: where
    micro-batches come from (:mod:`.feed`; default: read when needed, no read-ahead).
    ``fifo_links``: on a back-end that matches point-to-point messages first-in first-out
    (NCCL, HCCL), per sending device the operations whose outputs it sends here, in its order
    (``schedule.link_messages``); each link is then read in that order (:mod:`.inbox`) and
    tags are not sent. None: gloo, messages matched by tag.
    """

    def __init__(self, plan: ExecutionPlan, device: int, model: PipelineModel,
                 layers: nn.ModuleList | None, micro_batch_size: int, ranks: RankMap, *,
                 input_spec: BoundarySpec | None = None, torch_device: torch.device | None = None,
                 precision: Precision = "fp32", recompute: bool = False,
                 tp_rank: int = 0, feed: Feed | None = None,
                 fifo_links: Mapping[int, Sequence] | None = None) -> None:
        self.plan = plan
        self.device = device
        self.model = model
        self.layers = layers if layers is not None else nn.ModuleList()
        self.micro_batch_size = micro_batch_size
        self.ranks = ranks
        self.torch_device = torch_device or torch.device("cpu")
        self.precision = precision
        self.recompute = recompute
        self.tp_rank = tp_rank
        self._input_spec = input_spec
        self._fifo_links = fifo_links
        self._inbox: FifoInbox | None = None
        self.feed = feed or Feed(model, micro_batch_size, self.torch_device, prefetch=False)
        self._max_quota = max(p.micro_batches for p in plan.pipelines) or 1
        self._max_stages = max(p.num_stages for p in plan.pipelines)
        self._first_layer = 0   # the index of this stage's first layer
        # seconds spent computing (forwards, losses, backwards), never waiting for a peer:
        # what a device's speed is measured from (the agent's straggler watch)
        self.busy_s = 0.0
        if device in plan.working_devices:
            pipeline, stage = plan.locate(device)
            self._first_layer = plan.pipelines[pipeline].layers[stage][0]

    # ------------------------------------------------------------------ helpers

    def _tag(self, pipeline: int, micro_batch: int, consumer_stage: int, backward: bool,
             leaf: int) -> int:
        key = (pipeline * self._max_quota + micro_batch) * self._max_stages + consumer_stage
        return (key * 2 + int(backward)) * MAX_LEAVES + leaf

    def _layers(self, x: Any, step: int | None = None, micro_batch: int = 0) -> Any:
        """This stage's layers, each on its own random stream (:mod:`.streams`) of training
        step ``step``, also when recomputed; without a step (evaluation, in eval mode) on the
        process's own."""
        if step is None:
            for layer in self.layers:
                x = layer(x)
            return x
        with own_streams(self.torch_device):
            seed = layer_seeder(self.model.seed, step, micro_batch, self.torch_device)
            for index, layer in enumerate(self.layers, start=self._first_layer):
                seed(index)
                x = layer(x)
        return x

    def _forward(self, x: Any, step: int, micro_batch: int) -> Any:
        """``micro_batch``: the global micro-batch index."""
        with autocast(self.precision, self.torch_device):
            if self.recompute:
                return checkpoint(self._layers, x, step, micro_batch, use_reentrant=False)
            return self._layers(x, step, micro_batch)

    def _recv(self, spec: TensorSpec, device: int, tag: int) -> torch.Tensor:
        if self._inbox is not None:
            return self._inbox.take(device, tag)
        return self._recv_wire(spec, device, tag)

    def _recv_wire(self, spec: TensorSpec, device: int, tag: int = 0) -> torch.Tensor:
        buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.torch_device)
        try:
            wire.recv(buf, src=self.ranks.rank(device, self.tp_rank), tag=tag)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} timed out or failed receiving from device "
                           f"{device} (tag {tag}): {exc}") from exc
        return buf

    def _send(self, tensor: torch.Tensor, device: int, tag: int, pending: list) -> None:
        tensor = tensor.detach().contiguous()
        sent_tag = 0 if self._fifo_links is not None else tag
        try:
            work = wire.isend(tensor, dst=self.ranks.rank(device, self.tp_rank), tag=sent_tag)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} could not send to device {device}: "
                           f"{exc}") from exc
        pending.append((work, tensor))

    def _messages(self, stash: Mapping, op: Any) -> list[tuple[int, TensorSpec]]:
        """The tagged messages ``op`` (another device's operation) sends here: a forward
        sends what enters this stage; a backward, the gradients of this device's output for
        that micro-batch, which it holds (it has not run that backward yet)."""
        if op.kind == "F":
            assert self._input_spec is not None
            return [(self._tag(op.pipeline, op.micro_batch, op.stage + 1, False, i), spec)
                    for i, spec in enumerate(self._input_spec.leaves)]
        _, out = stash[(op.pipeline, op.micro_batch)]
        leaves, _ = flatten(out)
        return [(self._tag(op.pipeline, op.micro_batch, op.stage - 1, True, i),
                 TensorSpec(tuple(leaf.shape), leaf.dtype))
                for i, leaf in enumerate(leaves) if leaf.requires_grad]

    def _batch(self, step: int, pipeline: int, micro_batch: int):
        return self.feed.batch(self.plan, step, pipeline, micro_batch)

    def _receive_input(self, op) -> tuple[Any, list[torch.Tensor]]:
        """The stage input from ``op.source``, and the leaves that will want a gradient."""
        assert self._input_spec is not None
        leaves, wanting = [], []
        for i, spec in enumerate(self._input_spec.leaves):
            x = self._recv(spec, op.source, self._tag(op.pipeline, op.micro_batch, op.stage,
                                                      False, i))
            if spec.requires_grad:
                x.requires_grad_(True)
                wanting.append(x)
            leaves.append(x)
        return unflatten(leaves, self._input_spec.structure), wanting

    # ------------------------------------------------------------------ one step

    def run(self, step: int, ops: Sequence, record: bool = False,
            on_phase: Callable[[int, str], None] | None = None,
            loss_scale: float = 1.0,
            final_backward: Callable[[], contextlib.AbstractContextManager] | None = None,
            superseded: threading.Event | None = None) -> StepOutcome:
        """Execute ``ops`` (this device's order) for ``step``; gradients accumulate in place.
        ``on_phase(step, "forward" | "backward")`` runs before the first operation of each kind
        (the trainer's fault-injection hook). ``final_backward()``: a context entered around
        the step's last backward here, the one after which this device's gradients are final
        (the gradient sums start inside it, :class:`~.grad_sync.GradientSums`). ``superseded``:
        set when the agents have published a newer generation (the watchdog's); the step is
        then given up before its next operation (:class:`~.errors.PeerLost`)."""
        scale = 1.0 / self.plan.global_micro_batches
        stash: dict[tuple[int, int], tuple[list[torch.Tensor], Any]] = {}
        pending: list = []
        timings: list[OpTiming] = []
        loss_sum = 0.0
        entered: set[str] = set()
        last_b = max((i for i, op in enumerate(ops) if op.kind == "B"), default=-1)
        if self._fifo_links is not None:
            self._inbox = FifoInbox(self._fifo_links, functools.partial(self._messages, stash),
                                    self._recv_wire)
        self.feed.begin(self.plan, step, [(op.pipeline, op.micro_batch) for op in ops
                                          if op.kind == "F" and None in (op.source, op.dest)])
        try:
            for index, op in enumerate(ops):
                if superseded is not None and superseded.is_set():
                    raise PeerLost(f"device {self.device} gave step {step} up: the agents "
                                   "published a newer plan generation")
                if on_phase is not None and op.kind not in entered:
                    entered.add(op.kind)
                    on_phase(step, "forward" if op.kind == "F" else "backward")
                if op.device != self.device:
                    raise PipelineRuntimeError(
                        f"operation {op} belongs to device {op.device}, not {self.device}; pass "
                        "this device's entry of device_orders(plan)."
                    )
                began = time.perf_counter() if record else 0.0
                if op.kind == "F":
                    loss_sum += self._forward_op(step, op, scale, loss_scale, stash, pending)
                elif op.kind == "B":
                    final = (final_backward() if final_backward is not None and index == last_b
                             else contextlib.nullcontext())
                    with final:
                        self._backward_op(op, stash, pending)
                else:
                    raise PipelineRuntimeError(f"unknown operation kind {op.kind!r}")
                if record:
                    timings.append(OpTiming(op.kind, op.pipeline, op.micro_batch, began,
                                            time.perf_counter()))
        except PipelineRuntimeError:
            raise
        except RuntimeError as exc:
            if not communication_failure(exc):
                raise
            # a collective inside a sharded layer (tensor parallelism) broke: a peer of this
            # unit is gone, as for a broken transfer
            raise PeerLost(f"device {self.device}: a collective failed in step {step}: "
                           f"{str(exc).splitlines()[0][:300]}") from exc
        finally:
            self._inbox = None
        self._wait_sends(pending, step)
        if stash:
            raise PipelineRuntimeError(
                f"device {self.device} ran forwards without backwards for {sorted(stash)}; the "
                "operation order is incomplete."
            )
        return StepOutcome(loss_sum, len(ops), tuple(timings))

    def _forward_op(self, step: int, op: Any, scale: float, loss_scale: float,
                    stash: dict, pending: list) -> float:
        """One forward: the input from the data (first stage) or the previous stage, the
        output to the next stage or, on the last stage, the loss kept for its backward.
        Returns this micro-batch's share of the step's loss (counted by tensor-parallel rank 0
        only)."""
        key = (op.pipeline, op.micro_batch)
        targets = None
        if op.source is None:
            x, targets = self._batch(step, op.pipeline, op.micro_batch)
            wanting: list[torch.Tensor] = []
        else:
            x, wanting = self._receive_input(op)
        began = time.perf_counter()
        out = self._forward(x, step, global_micro_batch(self.plan, op.pipeline, op.micro_batch))
        self.busy_s += time.perf_counter() - began
        if op.dest is not None:
            leaves, _ = flatten(out, f"device {self.device}'s stage output")
            for i, leaf in enumerate(leaves):
                tag = self._tag(op.pipeline, op.micro_batch, op.stage + 1, False, i)
                self._send(leaf, op.dest, tag, pending)
            stash[key] = (wanting, out)
            return 0.0
        if targets is None:
            _, targets = self._batch(step, op.pipeline, op.micro_batch)
        began = time.perf_counter()
        with autocast(self.precision, self.torch_device):
            loss = self.model.loss(out, targets)
        self.busy_s += time.perf_counter() - began
        stash[key] = (wanting, loss * (scale * loss_scale))
        return float(loss.detach()) * scale if self.tp_rank == 0 else 0.0

    def _backward_op(self, op: Any, stash: dict, pending: list) -> None:
        """One backward: from the loss (last stage) or the gradients the next stage sent, and
        the input's gradients on to the previous stage (only the leaves that want them)."""
        try:  # kept until its gradients arrive: a FIFO inbox sizes them from it
            wanting, out = stash[(op.pipeline, op.micro_batch)]
        except KeyError:
            raise PipelineRuntimeError(
                f"backward of pipeline {op.pipeline} micro-batch {op.micro_batch} "
                f"comes before its forward on device {self.device}; the order is "
                "invalid.") from None
        if op.source is None:
            del stash[(op.pipeline, op.micro_batch)]
            began = time.perf_counter()
            out.backward()
            self.busy_s += time.perf_counter() - began
        else:
            leaves, _ = flatten(out)
            outs, grads = [], []
            for i, leaf in enumerate(leaves):
                if leaf.requires_grad:
                    outs.append(leaf)
                    grads.append(self._recv(
                        TensorSpec(tuple(leaf.shape), leaf.dtype), op.source,
                        self._tag(op.pipeline, op.micro_batch, op.stage, True, i)))
            del stash[(op.pipeline, op.micro_batch)]
            if outs:
                began = time.perf_counter()
                torch.autograd.backward(outs, grads)
                self.busy_s += time.perf_counter() - began
        if op.dest is None:
            return
        assert self._input_spec is not None
        wanted = iter(wanting)
        for i, spec in enumerate(self._input_spec.leaves):
            if not spec.requires_grad:
                continue
            x = next(wanted)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            tag = self._tag(op.pipeline, op.micro_batch, op.stage - 1, True, i)
            self._send(grad, op.dest, tag, pending)

    def _wait_sends(self, pending: list, step: int) -> None:
        for work, _ in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerLost(f"device {self.device} could not complete a send of step "
                               f"{step}: {exc}") from exc

    # ------------------------------------------------------------------ forward only

    def infer(self, ops: Sequence, count: Callable[[int, int], int],
              read: Callable[[int, int], tuple[Any, Any]]) -> float:
        """Forward only, in eval mode and without gradients (evaluation): the ``F`` operations
        of ``ops`` in their order, which cannot deadlock since the order without its
        backwards only loses dependencies. ``count(pipeline, micro_batch)``: the real samples
        of that micro-batch, the same on every device (0: skipped everywhere; fewer than the
        micro-batch size: the micro-batch is padded and the loss taken over the first
        ``count`` rows). ``read``: its ``(inputs, targets)``, asked only where needed. Returns
        this device's sum of ``loss * count`` (0 off the last stage, and off card 0)."""
        total, pending, training = 0.0, [], self.layers.training
        self.layers.eval()
        try:
            with torch.no_grad():
                for op in ops:
                    n = count(op.pipeline, op.micro_batch)
                    if op.kind != "F" or n == 0:
                        continue
                    total += self._infer_op(op, n, read, pending)
            self._wait_sends(pending, -1)
        except RuntimeError as exc:
            if isinstance(exc, PipelineRuntimeError) or not communication_failure(exc):
                raise
            raise PeerLost(f"device {self.device}: a collective failed in an "
                           f"evaluation: {str(exc).splitlines()[0][:300]}") from exc
        finally:
            self.layers.train(training)
        return total

    def _infer_op(self, op: Any, n: int, read: Callable[[int, int], tuple[Any, Any]],
                  pending: list) -> float:
        targets = None
        if op.source is None:
            x, targets = read(op.pipeline, op.micro_batch)
        else:
            x, _ = self._receive_input(op)
        with autocast(self.precision, self.torch_device):
            out = self._layers(x)
        if op.dest is not None:
            leaves, _ = flatten(out, f"device {self.device}'s stage output")
            for i, leaf in enumerate(leaves):
                self._send(leaf, op.dest,
                           self._tag(op.pipeline, op.micro_batch, op.stage + 1, False, i),
                           pending)
            return 0.0
        if targets is None:
            _, targets = read(op.pipeline, op.micro_batch)
        if n < self.micro_batch_size:
            out, targets = (leaf_map(lambda t: t[:n], z) for z in (out, targets))
        with autocast(self.precision, self.torch_device):
            loss = self.model.loss(out, targets)
        return float(loss.detach().double()) * n if self.tp_rank == 0 else 0.0
