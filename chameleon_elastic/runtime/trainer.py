"""One device's training under one plan: layers, optimizer, schedule, gradient sync.

Setup is collective and happens once per plan (``PipelineTrainer(...)``): every rank
all-gathers its device id (:func:`~.topology.exchange_rank_map`) and creates the bucket process
groups in the same order (:class:`~.groups.GroupTable`). A training step is then

1. zero gradients;
2. run this device's 1F1B order (:mod:`.executor`), accumulating gradients of the global-batch
   mean loss;
3. sum gradients over each bucket's holders by colour rounds (:mod:`.grad_sync`);
4. optimizer step; all-reduce the loss over the world for reporting.

Everything plan-dependent lives on the trainer object, nothing at module level, so after a
failure the same process can ``close()`` it and build a new one for the next plan
(in-place recovery keeps the layers it already holds via ``layers=``).
Spare devices take part in setup and in the loss all-reduce, and do nothing else.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup, ExecutionPlan, Pipeline

from .errors import PipelineRuntimeError
from .executor import OpTiming, PipelineExecutor
from .grad_sync import SyncMode, bucket_rank_sets, layer_holder_rank_sets, sync_gradients
from .groups import GroupTable
from .model import PipelineModel, build_layers
from .topology import RankMap, collective_timeout, device_from_env, exchange_rank_map, plan_from_env

__all__ = ["PipelineTrainer", "StepResult", "data_parallel_plan", "layer_holders", "plan_rounds"]


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean over the global batch
    compute_s: float
    sync_s: float
    step_s: float
    allreduces: int
    timings: tuple[OpTiming, ...] = ()


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
    from chameleon_elastic.planning.restorer import allreduce_rounds

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


def _check_message_matching(orders) -> None:
    """Our transfers are matched by tag, which gloo honours; NCCL/HCCL match point-to-point
    messages first-in first-out and ignore tags, which is only correct on links where the
    receiver consumes messages in the sender's order (``schedule.fifo_violations``)."""
    backend = str(dist.get_backend())
    if backend == "gloo":
        return
    from chameleon_elastic.planning.schedule import fifo_violations

    bad = fifo_violations(orders)
    if bad:
        raise PipelineRuntimeError(
            f"this plan needs tag-matched point-to-point messages on links {bad[:4]}, but "
            f"backend {backend!r} matches them in FIFO order; run it on gloo, or use a plan "
            "whose pipelines share length and quota (symmetric layouts are always safe)."
        )


class PipelineTrainer:
    """Train ``model`` on this device's share of ``plan``. Collective constructor."""

    def __init__(self, model: PipelineModel, plan: ExecutionPlan, device: int, *,
                 micro_batch_size: int = 1, sync_mode: SyncMode = "rounds",
                 torch_device: torch.device | None = None,
                 layers: nn.ModuleList | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 timeout_s: float | None = None) -> None:
        if not dist.is_initialized():
            raise PipelineRuntimeError(
                "torch.distributed is not initialised; call "
                "chameleon_elastic.runtime.init_distributed() (or init_process_group) first."
            )
        plan.validate()
        if plan.num_layers != model.num_layers:
            raise PipelineRuntimeError(
                f"plan generation {plan.generation} splits {plan.num_layers} layers but the "
                f"model has {model.num_layers}; make the job's model.layers match the model."
            )
        self.model = model
        self.plan = plan
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.sync_mode = sync_mode
        self.ranks: RankMap = exchange_rank_map(plan, device)
        self.rounds = plan_rounds(plan)
        self.holders = layer_holders(plan)
        rank_sets = (bucket_rank_sets(self.rounds, self.ranks) if sync_mode == "rounds"
                     else layer_holder_rank_sets(self.holders, self.ranks))
        self.groups = GroupTable(rank_sets, timeout=collective_timeout(timeout_s))
        self.working = device in plan.working_devices
        self.executor: PipelineExecutor | None = None
        self.orders: tuple = ()
        self.layer_ids: tuple[int, ...] = ()
        self.optimizer = optimizer
        if self.working:
            from chameleon_elastic.planning.schedule import device_orders

            pipeline, stage = plan.locate(device)
            start, end = plan.pipelines[pipeline].layers[stage]
            if layers is None:
                layers = build_layers(model, start, end)
            if len(layers) != end - start:
                raise PipelineRuntimeError(
                    f"device {device} was given {len(layers)} layers but its stage holds "
                    f"layers [{start}, {end})."
                )
            if torch_device is not None:
                layers = layers.to(torch_device)
            self.layer_ids = tuple(range(start, end))
            self.executor = PipelineExecutor(plan, device, model, layers, start,
                                             micro_batch_size, self.ranks, torch_device)
            orders = device_orders(plan)
            self.orders = tuple(orders[device])
            _check_message_matching(orders)
            if self.optimizer is None:
                self.optimizer = model.make_optimizer(layers.parameters())

    @classmethod
    def from_env(cls, model: PipelineModel, *, global_micro_batches: int | None = None,
                 micro_batch_size: int | None = None, **kwargs) -> PipelineTrainer:
        """Plan from ``CHAMELEON_PLAN_FILE`` (chameleon-run); without it, plain data parallelism
        over ``WORLD_SIZE`` with ``global_micro_batches`` (torchrun)."""
        plan = plan_from_env()
        if plan is None:
            if global_micro_batches is None:
                raise PipelineRuntimeError(
                    "no CHAMELEON_PLAN_FILE and no global_micro_batches; run under "
                    "chameleon-run --job, or pass global_micro_batches for data parallelism."
                )
            plan = data_parallel_plan(dist.get_world_size(), model.num_layers,
                                      global_micro_batches)
        mbs = micro_batch_size or int(os.environ.get("CHAMELEON_MICRO_BATCH_SIZE", "1"))
        return cls(model, plan, device_from_env(plan), micro_batch_size=mbs, **kwargs)

    @property
    def layers(self) -> dict[int, nn.Module]:
        if self.executor is None:
            return {}
        return dict(zip(self.layer_ids, self.executor.layers))

    def step(self, step: int, record: bool = False) -> StepResult:
        """One optimizer step for global step ``step`` (collective)."""
        began = time.perf_counter()
        loss_sum = 0.0
        timings: tuple[OpTiming, ...] = ()
        issued = 0
        compute_done = began
        if self.executor is not None:
            assert self.optimizer is not None
            self.optimizer.zero_grad(set_to_none=False)
            outcome = self.executor.run(step, self.orders, record=record)
            loss_sum, timings = outcome.loss_sum, outcome.timings
            compute_done = time.perf_counter()
            issued = sync_gradients(self.layers, self.device, self.ranks, self.groups,
                                    rounds=self.rounds, holders=self.holders,
                                    mode=self.sync_mode)
            self.optimizer.step()
        synced = time.perf_counter()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)
        return StepResult(step, float(total.item()), compute_done - began, synced - compute_done,
                          time.perf_counter() - began, issued, timings)

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Layer -> its parameters (detached copies), for checks and transfers."""
        return {i: {k: v.detach().clone() for k, v in m.state_dict().items()}
                for i, m in self.layers.items()}

    def close(self) -> None:
        """Release this plan's process groups (the default group stays)."""
        self.groups.destroy()

