"""Which samples a micro-batch holds: a pure function of (step, plan).

Quotas are laid end to end in pipeline order (``ExecutionPlan.micro_batch_offset``), so global
micro-batch ``g`` of step ``t`` holds samples ``t * G * mbs + g * mbs + j`` for ``j < mbs``,
where ``G`` is the global micro-batch count. Every plan with the same ``G`` and ``mbs`` covers
exactly the same samples each step; only which pipeline takes which slice changes. A rerouted
micro-batch keeps its pipeline and local index, so it keeps its samples too.
"""

from __future__ import annotations

from chameleon_elastic.plan import ExecutionPlan

__all__ = ["global_micro_batch", "sample_ids", "step_sample_ids"]


def global_micro_batch(plan: ExecutionPlan, pipeline: int, micro_batch: int) -> int:
    quota = plan.pipelines[pipeline].micro_batches
    if not 0 <= micro_batch < quota:
        raise ValueError(
            f"micro-batch {micro_batch} is outside pipeline {pipeline}'s quota of {quota}"
        )
    return plan.micro_batch_offset(pipeline) + micro_batch


def sample_ids(step: int, plan: ExecutionPlan, pipeline: int, micro_batch: int,
               micro_batch_size: int) -> range:
    """Global sample indices of local ``micro_batch`` of ``pipeline`` at ``step``."""
    g = global_micro_batch(plan, pipeline, micro_batch)
    first = (step * plan.global_micro_batches + g) * micro_batch_size
    return range(first, first + micro_batch_size)


def step_sample_ids(step: int, global_micro_batches: int, micro_batch_size: int) -> range:
    """Every sample of ``step``, whatever the plan (what a single-process reference trains on)."""
    size = global_micro_batches * micro_batch_size
    return range(step * size, (step + 1) * size)
