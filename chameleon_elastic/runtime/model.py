"""What a training script hands the runtime: a model as an ordered list of layers.

The runtime never sees the whole model on one device. It asks ``build_layer(i)`` only for the
layers of its stage, seeding torch's generator with ``(seed, i)`` just for that call, so layer
``i`` starts with the same weights on every device that holds it, under every plan, and in a
single-process reference. The loss is computed per micro-batch on the last stage (a mean over
the micro-batch's samples); data is a pure function of the global sample index.

Tied weights (an embedding reused by the output head) are declared, not shared by reference:
every layer that uses the weight keeps its own copy, because the layers may sit on different
devices. The copies start equal (the first member's initial value), the trainer sums their
gradients over every device that holds any of them, and so they stay equal, step after step,
exactly as one shared parameter would evolve in a single process.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .data import Epochs
from .errors import PipelineRuntimeError
from .tensors import stack

__all__ = ["PipelineModel", "Tie", "build_layers", "check_dataset", "collate", "collate_samples",
           "read_samples", "sample_indices", "sizing_boundaries", "tied_parameter"]

LayerFactory = Callable[[int], nn.Module]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SampleFn = Callable[[int], tuple[Any, Any]]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
#: Layer -> its tensor-parallel plan: submodule name -> torch ``ParallelStyle``
#: (``ColwiseParallel()``, ``RowwiseParallel()``, ...), or None to replicate the layer.
TensorParallelPlan = Callable[[int], "Mapping[str, Any] | None"]


_SIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("chameleon_sizing", default=False)


def sizing_boundaries() -> bool:
    """True while the runtime calls ``build_layer`` only to size stage boundaries: under
    torch's FakeTensorMode, where tensors have shapes but no data (see ``boundary_spec``). A
    factory that reads weights from disk or draws them may skip that work then: nobody will
    see the values, and reading another stage's weights would load what this device never
    holds."""
    return _SIZING.get()


@contextlib.contextmanager
def _sizing() -> Iterator[None]:
    token = _SIZING.set(True)
    try:
        yield
    finally:
        _SIZING.reset(token)


@dataclass(frozen=True)
class Tie:
    """One weight used by several layers: ``members`` are ``(layer, parameter name)`` pairs,
    e.g. ``Tie(((0, "tokens.weight"), (7, "out.weight")))`` for tied embeddings. The first
    member's initial value is every copy's initial value."""

    members: tuple[tuple[int, str], ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.members)


@dataclass(frozen=True)
class PipelineModel:
    """A model the runtime can cut anywhere.

    ``build_layer(i)`` builds layer ``i`` (0-based) of ``num_layers``; layer ``i + 1`` consumes
    layer ``i``'s output tensor. ``loss(output, target)`` returns the mean loss of one
    micro-batch. The data is either ``sample(index)``, which returns ``(input, target)`` of
    global sample ``index``, or ``dataset``: any map-style dataset (``torch.utils.data.Dataset``
    or an object with ``__getitem__`` and ``__len__``) whose items are ``(input, target)``
    pairs, read in epochs, each a permutation drawn from ``(seed, epoch)`` (``shuffle=False``:
    in index order) so that every sample is trained once per epoch under every plan;
    ``drop_last`` leaves out each epoch's last incomplete global batch (see :mod:`.data`). A
    dataset with ``__getitems__`` (as torch's ``DataLoader`` uses) is read a micro-batch at a
    time. Items must be a pure function of the index, and reading must be thread-safe: the
    trainer reads the next step's micro-batches in the background.
    ``make_optimizer(params)`` builds the optimizer of one device's layers; optimizers whose
    update of a parameter depends only on that parameter (SGD, Adam, AdamW, ...) give the same
    result however the layers are split (global gradient-norm clipping is the trainer's
    ``max_grad_norm``, which sees the whole job). ``make_scheduler(optimizer)``: an optional
    learning-rate schedule (any of torch's ``LRScheduler``; its state must be a function of
    the step count, so ``ReduceLROnPlateau`` is refused). ``tied``: weights shared between
    layers (:class:`Tie`). ``tp_plan(i)``: how layer ``i`` is sharded over a unit of cards
    under ``training.tp > 1`` (torch's ``parallelize_module`` plan; see
    :mod:`.tensor_parallel`); the layer's code must work on the local shards (take head counts
    from tensor shapes, not from constants).
    """

    num_layers: int
    build_layer: LayerFactory
    loss: LossFn
    make_optimizer: OptimizerFactory
    sample: SampleFn | None = None
    seed: int = 0
    make_scheduler: SchedulerFactory | None = None
    tied: tuple[Tie, ...] = ()
    tp_plan: TensorParallelPlan | None = None
    dataset: Any = None
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise PipelineRuntimeError(
                f"PipelineModel.num_layers = {self.num_layers}; a model needs at least one layer."
            )
        if (self.sample is None) == (self.dataset is None):
            raise PipelineRuntimeError(
                "a PipelineModel needs its data from exactly one of sample= (a function of "
                "the global sample index) and dataset= (a map-style dataset); pass one.")
        if self.dataset is not None:
            check_dataset(self.dataset, "dataset")
        seen: set[tuple[int, str]] = set()
        for tie in self.tied:
            if len(tie.members) < 2 or len(set(tie.layers)) != len(tie.layers):
                raise PipelineRuntimeError(
                    f"tie {tie.members} must name at least two different layers; a weight "
                    "used twice inside one layer is already shared by torch."
                )
            for layer, name in tie.members:
                if not 0 <= layer < self.num_layers or (layer, name) in seen:
                    raise PipelineRuntimeError(
                        f"tie member ({layer}, {name!r}) is outside the model's "
                        f"{self.num_layers} layers or in two ties; name each tied parameter "
                        "once, by an existing layer."
                    )
                seen.add((layer, name))


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
    _tie_initial_values(model, start, layers)
    return nn.ModuleList(layers)


def tied_parameter(module: nn.Module, layer: int, name: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError as exc:
        raise PipelineRuntimeError(
            f"layer {layer} has no parameter {name!r} to tie; name it as "
            f"layer.named_parameters() does ({', '.join(n for n, _ in module.named_parameters())})."
        ) from exc


def _tie_initial_values(model: PipelineModel, start: int, layers: Sequence[nn.Module]) -> None:
    """Give every tied copy built here the first member's initial value (building the first
    member's layer under its seed when it is not among these)."""
    for tie in model.tied:
        (first, first_name), *rest = tie.members
        mine = [(x, n) for x, n in rest if start <= x < start + len(layers)]
        if not mine:
            continue
        if start <= first < start + len(layers):
            owner = layers[first - start]
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(model.seed * 1_000_003 + first)
                owner = model.build_layer(first)
        value = tied_parameter(owner, first, first_name).detach()
        for x, name in mine:
            param = tied_parameter(layers[x - start], x, name)
            if param.shape != value.shape or param.dtype != value.dtype:
                raise PipelineRuntimeError(
                    f"tied parameters ({first}, {first_name!r}) and ({x}, {name!r}) differ "
                    f"({tuple(value.shape)} {value.dtype} vs {tuple(param.shape)} "
                    f"{param.dtype}); a tie needs the same shape and dtype."
                )
            with torch.no_grad():
                param.copy_(value)


def check_dataset(dataset: Any, what: str) -> None:
    """A map-style dataset, or one sentence."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise PipelineRuntimeError(
            f"{what} is a {type(dataset).__name__}, which has no __getitem__ and __len__; "
            "pass a map-style dataset (torch.utils.data.Dataset, a list, ...), not an "
            "iterable one.")
    if len(dataset) < 1:
        raise PipelineRuntimeError(f"{what} is empty; give it at least one sample.")


def sample_indices(model: PipelineModel, positions: Sequence[int],
                   global_batch: int) -> list[int]:
    """The dataset index (or ``sample`` index) each global sample position reads; a
    ``dataset`` is read in epochs (:class:`~.data.Epochs`), ``sample`` at the position."""
    if model.dataset is None:
        return [int(p) for p in positions]
    return Epochs(len(model.dataset), model.seed, model.shuffle, model.drop_last,
                  global_batch).indices(positions)


def read_samples(source: Any, indices: Sequence[int]) -> list[tuple[Any, Any]]:
    """``(input, target)`` of each index: one ``__getitems__`` call when the dataset has it
    (a batched read), else one ``source[i]`` (a dataset) or ``source(i)`` (a function) each."""
    indices = [int(i) for i in indices]
    many = getattr(source, "__getitems__", None)
    if many is not None:
        pairs = list(many(indices))
        if len(pairs) != len(indices):
            raise PipelineRuntimeError(
                f"the dataset's __getitems__ returned {len(pairs)} items for {len(indices)} "
                "indices; it must return one (input, target) pair per index.")
        return pairs
    if hasattr(source, "__getitem__"):
        return [source[i] for i in indices]
    return [source(i) for i in indices]


def collate_samples(source: Any, indices: Sequence[int]) -> tuple[Any, Any]:
    """Stack the samples ``indices`` of ``source`` into one micro-batch ``(inputs, targets)``;
    inputs and targets may be tensors or tuples / dicts of tensors (stacked leaf by leaf)."""
    pairs = read_samples(source, indices)
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise PipelineRuntimeError(
                f"a sample is a {type(pair).__name__}; the data must give (input, target) "
                "pairs.")
    return (stack([x for x, _ in pairs], "a sample's input"),
            stack([y for _, y in pairs], "a sample's target"))


def collate(model: PipelineModel, sample_ids: Sequence[int]) -> tuple[Any, Any]:
    """The micro-batch of the model's samples (``sample``) or dataset items ``sample_ids``."""
    return collate_samples(model.dataset if model.dataset is not None else model.sample,
                           sample_ids)
