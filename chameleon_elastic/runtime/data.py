"""Which samples a micro-batch holds: a pure function of (step, plan), and of (seed, epoch).

Positions. Quotas are laid end to end in pipeline order (``ExecutionPlan.micro_batch_offset``),
so global micro-batch ``g`` of step ``t`` holds global sample positions
``t * G * mbs + g * mbs + j`` for ``j < mbs``, where ``G`` is the global micro-batch count.
Every plan with the same ``G`` and ``mbs`` covers exactly the same positions each step; only
which pipeline takes which slice changes. A rerouted micro-batch keeps its pipeline and local
index, so it keeps its positions too.

Epochs. A model with ``sample(index)`` reads position ``p`` as sample ``p``. A model with a
map-style ``dataset`` of ``N`` samples reads positions as epochs laid end to end
(:class:`Epochs`): epoch ``e`` is positions ``[e * E, (e + 1) * E)``, and position ``p`` reads
``permutation(seed, e)[p - e * E]``, a permutation of ``range(N)`` that depends only on the
model's seed and the epoch. ``E`` is ``N``, or with ``drop_last`` the largest multiple of the
global batch ``G * mbs`` not above ``N`` (the permutation's last ``N - E`` samples are left out
of that epoch, other samples each epoch, and no step spans two epochs). So every sample is read
exactly once per epoch (``drop_last``: every sample the epoch keeps) under every plan and
through every recovery: the data position is the committed step, which costs nothing to
checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chameleon_elastic.plan import ExecutionPlan

from .errors import PipelineRuntimeError

__all__ = ["Epochs", "global_micro_batch", "permutation", "sample_ids", "step_sample_ids"]


def global_micro_batch(plan: ExecutionPlan, pipeline: int, micro_batch: int) -> int:
    quota = plan.pipelines[pipeline].micro_batches
    if not 0 <= micro_batch < quota:
        raise ValueError(
            f"micro-batch {micro_batch} is outside pipeline {pipeline}'s quota of {quota}"
        )
    return plan.micro_batch_offset(pipeline) + micro_batch


def sample_ids(step: int, plan: ExecutionPlan, pipeline: int, micro_batch: int,
               micro_batch_size: int) -> range:
    """Global sample positions of local ``micro_batch`` of ``pipeline`` at ``step``."""
    g = global_micro_batch(plan, pipeline, micro_batch)
    first = (step * plan.global_micro_batches + g) * micro_batch_size
    return range(first, first + micro_batch_size)


def step_sample_ids(step: int, global_micro_batches: int, micro_batch_size: int) -> range:
    """Every sample position of ``step``, whatever the plan (what a single-process reference
    trains on)."""
    size = global_micro_batches * micro_batch_size
    return range(step * size, (step + 1) * size)


@functools.lru_cache(maxsize=4)   # the epoch being read and the next one, for two datasets
def permutation(seed: int, epoch: int, length: int) -> torch.Tensor:
    """The order of epoch ``epoch``: a permutation of ``range(length)``, a pure function of its
    arguments (torch's ``randperm`` under a generator seeded from them)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 17) % (2 ** 63))
    return torch.randperm(length, generator=g)


@dataclass(frozen=True)
class Epochs:
    """How global sample positions read a dataset of ``length`` samples (see the module's
    docstring). ``batch``: the global batch in samples (``G * mbs``), used by ``drop_last``."""

    length: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    batch: int = 1

    def __post_init__(self) -> None:
        if self.length < 1:
            raise PipelineRuntimeError("the dataset is empty; give the model at least one "
                                       "sample.")
        if self.drop_last and self.length < self.batch:
            raise PipelineRuntimeError(
                f"drop_last with {self.length} samples and a global batch of {self.batch} "
                "leaves no step in an epoch; pass drop_last=False or a larger dataset.")

    @property
    def per_epoch(self) -> int:
        """Positions per epoch (``E``)."""
        return self.length - self.length % self.batch if self.drop_last else self.length

    def epoch(self, position: int) -> int:
        return position // self.per_epoch

    def indices(self, positions: Sequence[int]) -> list[int]:
        """The dataset index each position reads."""
        out = []
        for p in positions:
            epoch, within = divmod(int(p), self.per_epoch)
            out.append(int(permutation(self.seed, epoch, self.length)[within])
                       if self.shuffle else within)
        return out
