"""What a plan means for the processes that run it: who holds which layer, the colour rounds,
the data-parallel plan used without one, and how the back-end matches its transfers.

Pure functions of the plan, shared by entering a plan (:mod:`.entering`), the gradient sync
and the benchmarks; kept out of the trainer so that reading a plan needs no trainer.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from chameleon_elastic.plan import AllReduceGroup, ExecutionPlan, Pipeline

from ..errors import PipelineRuntimeError

__all__ = ["FIFO_ENV", "data_parallel_plan", "fifo_matching", "layer_holders", "links_into",
           "plan_rounds"]


def layer_holders(plan: ExecutionPlan) -> dict[int, tuple[int, ...]]:
    """Layer -> live devices holding it (dead devices' layers are held by their peers)."""
    dead = set(plan.failed_devices)
    out: dict[int, list[int]] = {}
    for p in plan.pipelines:
        for d, (start, end) in zip(p.devices, p.layers):
            if d in dead:
                continue
            for layer in range(start, end):
                out.setdefault(layer, []).append(d)
    return {layer: tuple(sorted(devs)) for layer, devs in sorted(out.items())}


def plan_rounds(plan: ExecutionPlan) -> tuple[tuple[AllReduceGroup, ...], ...]:
    """The plan's colour rounds; hand-built plans without rounds get the restorer's."""
    if plan.allreduce_rounds:
        return plan.allreduce_rounds
    from chameleon_elastic.planning.allreduce import allreduce_rounds

    return tuple(tuple(r) for r in allreduce_rounds(plan.pipelines, plan.failed_devices))


def data_parallel_plan(world_size: int, num_layers: int,
                       global_micro_batches: int) -> ExecutionPlan:
    """Plain data parallelism (one single-stage pipeline per rank), for running a script under
    torchrun without a plan; quotas differ by at most one."""
    if global_micro_batches < world_size:
        raise PipelineRuntimeError(
            f"{global_micro_batches} global micro-batches cannot feed {world_size} ranks; "
            "raise the batch or start fewer workers."
        )
    base, extra = divmod(global_micro_batches, world_size)
    pipelines = tuple(Pipeline((d,), ((0, num_layers),), base + (1 if d < extra else 0))
                      for d in range(world_size))
    return ExecutionPlan(policy="initial", generation=0, pipelines=pipelines).validate()


#: set to 1, gloo too reads every link in send order and sends no tags (tests of the FIFO path)
FIFO_ENV = "CHAMELEON_FIFO_P2P"


def fifo_matching() -> bool:
    """Whether point-to-point messages are matched first-in first-out: NCCL and HCCL ignore
    tags; gloo honours them, unless ``CHAMELEON_FIFO_P2P=1`` asks it to act as they do."""
    return str(dist.get_backend()) != "gloo" or os.environ.get(FIFO_ENV) == "1"


def links_into(orders, device: int) -> dict[int, tuple]:
    """Per sending device, the operations whose outputs reach ``device``, in send order
    (what :class:`~.inbox.FifoInbox` reads each link by)."""
    from chameleon_elastic.planning.schedule import link_messages

    return {src: ops for (src, dst), ops in link_messages(orders).items() if dst == device}
