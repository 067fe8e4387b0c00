"""Evaluation under any plan: the mean loss over a held-out dataset, forward only.

``trainer.run(steps, report, evaluate=Every(K, dataset))`` evaluates after every K committed
steps and after the last one. The held-out samples are cut into micro-batches of the training
micro-batch size, in index order (no shuffling: the mean does not depend on order), and spread
over the plan's pipelines as a step's micro-batches are: round ``r`` gives global micro-batch
``g`` eval micro-batch ``r * G + g``. Every device runs the forwards of its 1F1B order, round
after round (a rerouted micro-batch goes where the plan sends it), with the layers in eval mode
and no gradients. A last micro-batch with fewer samples is padded by repeating its last sample
and its loss taken over the real rows only; micro-batches beyond the data are skipped by every
device. The last stages add ``loss * samples``; one all-reduce over the world sums them, so
every rank gets the same mean, which equals the mean loss over the dataset in one process
(exactly for a loss that is a mean over samples, up to the order of float sums).

A lost peer during an evaluation is a :class:`~.errors.PeerLost` like one during a step: the
trainer recovers in place and evaluates again under the new plan (the state has not moved, so
the result is the same), then goes on training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..data import global_micro_batch
from ..errors import PeerLost, PipelineRuntimeError
from ..model import check_dataset, collate_samples
from ..tensors import leaf_map

__all__ = ["Every", "evaluate"]

#: a PipelineTrainer, read through its fields (never its methods)
TrainerState = Any


@dataclass(frozen=True)
class Every:
    """Evaluate on ``dataset`` (map-style, ``(input, target)`` items) after every ``steps``
    committed steps and after the last step of ``trainer.run``."""

    steps: int
    dataset: Any

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise PipelineRuntimeError(
                f"Every({self.steps}, ...): evaluate every 1 or more steps.")
        check_dataset(self.dataset, "the evaluation dataset")

    def due(self, committed: int, last: int) -> bool:
        """Is an evaluation due once ``committed`` steps are committed (``last``: the run's
        step count)?"""
        return committed > 0 and (committed % self.steps == 0 or committed == last)


def evaluate(t: TrainerState, dataset: Any) -> float:
    """The mean loss over ``dataset`` under the trainer's plan (collective over the world;
    :class:`~.errors.PeerLost` when a peer is lost)."""
    t.phases(t.committed, "evaluate")
    size = len(dataset)
    mbs = t.micro_batch_size
    batches = math.ceil(size / mbs)
    total = 0.0
    if t.executor is not None:
        plan, big_g = t.plan, t.plan.global_micro_batches
        forwards = [op for op in t.orders if op.kind == "F"]
        for r in range(math.ceil(batches / big_g)):
            def first(pipeline: int, micro_batch: int, r: int = r) -> int:
                return (r * big_g + global_micro_batch(plan, pipeline, micro_batch)) * mbs

            def count(pipeline: int, micro_batch: int) -> int:
                return max(0, min(mbs, size - first(pipeline, micro_batch)))

            def read(pipeline: int, micro_batch: int) -> tuple[Any, Any]:
                start = first(pipeline, micro_batch)
                ids = [min(i, size - 1) for i in range(start, start + mbs)]
                move = lambda x: x.to(t.executor.torch_device)
                inputs, targets = collate_samples(dataset, ids)
                return leaf_map(move, inputs), leaf_map(move, targets)

            total += t.executor.infer(forwards, count, read)
    summed = torch.tensor([total], dtype=torch.float64)
    try:
        dist.all_reduce(summed)
    except RuntimeError as exc:
        raise PeerLost(f"device {t.device} lost a peer while summing an evaluation: "
                       f"{exc}") from exc
    return float(summed.item()) / size
