"""One device's training under a plan, and under every plan that follows a failure.

Entering a plan (:meth:`PipelineTrainer.enter`, collective over the plan's world) is one chain
for every case: a fresh start, a resume from a checkpoint, a process that joins a running job,
and a survivor after a failure. Every rank all-gathers what it holds and has committed
(:mod:`.commit`), the ranks that are one step behind roll forward, missing layers arrive from
peers with their optimizer state (:mod:`.migrate`; from the checkpoint only when no live process
holds some layer; built from the seed at step 0), and the bucket groups and the 1F1B executor
are rebuilt for the plan. A training step is then

1. zero gradients; run this device's 1F1B order (:mod:`.executor`), forwards under the
   training precision (:mod:`.precision`);
2. sum gradients over each bucket's holders by colour rounds, and each tied weight's over its
   copies (:mod:`.grad_sync`); unscale them (fp16);
3. vote: all-reduce the loss and each device's share of the squared gradient norm over the
   world (the commit point, see :mod:`.commit`);
4. apply: clip by the job-wide norm (``max_grad_norm``), optimizer step (skipped by every rank
   when an fp16 step overflowed), loss scale and learning-rate schedule move on; the step is
   committed.

Per-step state other than the layers' (the learning-rate schedule, fp16's loss scale) is a
function of the committed steps: a schedule is carried over to the optimizer of a new plan, or
replayed up to the committed step in a process that has none (a joiner, a checkpoint restore);
the loss scale travels in the commit rows and the checkpoint.

:meth:`PipelineTrainer.run` is the fault-tolerant loop: under ``chameleon-run --job`` a broken
transfer or collective (:class:`~.errors.PeerLost`) never reaches the caller; the trainer
recovers in place (:mod:`.recovery`) and goes on at the first step that was not committed
everywhere, reporting every committed step exactly once. Spare devices take part in the vote and
in recoveries and do nothing else.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup, ExecutionPlan, Pipeline
from chameleon_elastic.timeouts import Timeouts

from .abort import GroupSockets, new_sockets
from .checkpoint import latest_step, load_layers, load_loss_scale, save_checkpoint
from .commit import Agreement, Row, StateLost, agree
from .errors import PeerLost, PipelineRuntimeError, say_peer_loss_in_one_line
from .executor import BoundarySpec, OpTiming, PipelineExecutor, boundary_spec
from .grad_sync import (
    SyncMode,
    TiedCopies,
    bucket_rank_sets,
    layer_holder_rank_sets,
    square_share,
    sync_gradients,
    tied_copies,
)
from .groups import GroupTable
from .layer_state import export_layer, import_layer
from .migrate import move_layers, plan_moves, stage_layers
from .model import PipelineModel, build_layers
from .precision import LossScale, Precision, check_precision
from .recovery import Recovery, WorkerLink
from .tensor_parallel import full, make_mesh, shard_layer
from .topology import RankMap, check_world, device_from_env, plan_from_env, tp_from_env

__all__ = ["Entry", "PipelineTrainer", "StepResult", "data_parallel_plan", "layer_holders",
           "plan_rounds"]

Phase = Literal["forward", "backward", "sync", "vote", "apply", "applied"]
PhaseHook = Callable[[int, str], None]
Report = Callable[["StepResult"], None]


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean over the global batch
    compute_s: float
    sync_s: float
    step_s: float
    allreduces: int
    timings: tuple[OpTiming, ...] = ()
    redone: bool = False  # trained again after a rollback (to a checkpoint, or to step 0)
    grad_norm: float = math.nan  # job-wide gradient norm before clipping (each weight once)
    lr: float = math.nan         # learning rate the step was applied with (first param group)
    skipped: bool = False        # fp16: a gradient overflowed, no rank applied the step


@dataclass(frozen=True)
class Entry:
    """How the trainer entered a plan: where state came from and what moved."""

    resume: int
    source: str            # "peers", "none" (nothing to move), "checkpoint" or "init"
    rolled_forward: bool
    moved_layers: int
    moved_bytes: float
    planned_moves: bool    # the plan's own transfers were used (not a recomputed choice)
    transfer_s: float
    redone_steps: int


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


def _ranges(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


class PipelineTrainer:
    """Train ``model`` on this device's share of ``plan``. Collective constructor.

    ``checkpoint_dir``: where :meth:`run` commits checkpoints, and where state comes from when a
    fresh world starts or when no live process holds some layer. ``link``: the agent channel
    (``chameleon-run --job``), which makes recovery in place possible. ``on_phase(step, phase)``
    is a fault-injection hook for tests, called before each phase of a step (``forward``,
    ``backward``, ``sync``, ``vote``, ``apply``) and after ``apply`` (``applied``), and with
    ``enter`` as the process starts entering a plan (``step``: steps committed, -1 when fresh).
    ``max_grad_norm``: clip the job-wide gradient norm to it (as
    ``torch.nn.utils.clip_grad_norm_`` over the whole model). ``precision``: ``fp32``, ``bf16``
    or ``fp16`` (:mod:`.precision`). Stages run with activation recomputation where the plan
    says so. ``tp_size`` > 1: the plan's ``device`` is a unit of that many cards, this process
    is card ``tp_rank`` of it, and the layers are sharded by the model's ``tp_plan``
    (:mod:`.tensor_parallel`).
    """

    def __init__(self, model: PipelineModel, plan: ExecutionPlan, device: int, *,
                 micro_batch_size: int = 1, sync_mode: SyncMode = "rounds",
                 torch_device: torch.device | None = None, timeouts: Timeouts | None = None,
                 checkpoint_dir: str | Path | None = None, link: WorkerLink | None = None,
                 on_phase: PhaseHook | None = None, max_grad_norm: float | None = None,
                 precision: Precision | str = "fp32", tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        if not dist.is_initialized():
            raise PipelineRuntimeError(
                "torch.distributed is not initialised; call "
                "chameleon_elastic.runtime.init_distributed() (or init_process_group) first."
            )
        self.model = model
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.sync_mode = sync_mode
        self.torch_device = torch_device
        self.timeouts = timeouts or Timeouts.resolve()
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.on_phase = on_phase
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise PipelineRuntimeError(
                f"max_grad_norm = {max_grad_norm!r}; pass a positive norm, or None not to clip.")
        self.max_grad_norm = max_grad_norm
        self.precision = check_precision(precision)
        if not 0 <= tp_rank < tp_size:
            raise PipelineRuntimeError(
                f"tensor-parallel rank {tp_rank} of a unit of {tp_size} cards; pass "
                "0 <= tp_rank < tp_size.")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tp_groups: GroupTable | None = None   # one per unit, rebuilt with every plan
        self.mesh = None                            # this unit's DeviceMesh (tp_size > 1)
        self._boundaries: dict[int, BoundarySpec] = {}   # layer -> what enters it (per model)
        # training state: survives plan changes
        self.layers: dict[int, nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.loss_scale = LossScale.for_precision(self.precision)
        self.committed: int | None = None   # steps applied here; None: no state yet
        self.synced: int | None = None      # the step whose summed gradients sit in .grad
        self.results: dict[int, StepResult] = {}
        self.reported = -1                  # last step handed to a report callback (job-wide)
        self.redo_below = 0                 # steps below this are trained again (rollback)
        # plan-dependent: rebuilt by enter()
        self.plan = plan
        self.ranks: RankMap = RankMap(())
        self.groups: GroupTable | None = None
        self.group_sockets: frozenset[int] = frozenset()   # see runtime/abort.py
        self._unit_sockets: frozenset[int] = frozenset()
        self.executor: PipelineExecutor | None = None
        self.orders: tuple = ()
        self.rounds: tuple[tuple[AllReduceGroup, ...], ...] = ()
        self.holders: dict[int, tuple[int, ...]] = {}
        self.ties: tuple[TiedCopies, ...] = ()
        self.recovery: Recovery | None = None
        if link is not None:
            from chameleon_elastic.plugins import get_backend

            backend = get_backend(os.environ.get("CHAMELEON_BACKEND") or dist.get_backend())
            self.recovery = Recovery(self, link, backend)
        failure = None
        try:
            entry = self.enter(plan, None if link is None else link.current().reported)
        except PeerLost as exc:
            if self.recovery is None:
                raise
            failure = str(exc)  # not the exception: its traceback would keep groups alive
        if self.recovery is not None:
            if failure is None:
                self.recovery.started(entry, regroup_s=0.0, noticed_at=None)
            else:
                self.recovery.recover(failure)

    @classmethod
    def from_env(cls, model: PipelineModel, *, global_micro_batches: int | None = None,
                 micro_batch_size: int | None = None, **kwargs) -> PipelineTrainer:
        """Plan from ``CHAMELEON_PLAN_FILE`` (chameleon-run); without it, plain data parallelism
        over ``WORLD_SIZE`` with ``global_micro_batches`` (torchrun). Under ``chameleon-run
        --job`` the trainer is linked to its agent and recovers in place.

        ``micro_batch_size`` and ``precision``: None (or not given) follows the job
        (``CHAMELEON_MICRO_BATCH_SIZE``, ``CHAMELEON_PRECISION``; 1 and fp32 without one); a
        micro-batch size that disagrees with the job's is refused, because the plan was
        priced for the job's. A plan made for another layer count is refused too."""
        plan = plan_from_env()
        if plan is None:
            if global_micro_batches is None:
                raise PipelineRuntimeError(
                    "no CHAMELEON_PLAN_FILE and no global_micro_batches; run under "
                    "chameleon-run --job, or pass global_micro_batches for data parallelism."
                )
            plan = data_parallel_plan(dist.get_world_size(), model.num_layers,
                                      global_micro_batches)
        if plan.num_layers != model.num_layers:
            raise PipelineRuntimeError(
                f"the job's plan has {plan.num_layers} layers but the model has "
                f"{model.num_layers}; set model.layers = {model.num_layers} in the job file "
                "(chameleon-job writes it from the model).")
        job_mbs = os.environ.get("CHAMELEON_MICRO_BATCH_SIZE")
        if micro_batch_size is not None and job_mbs is not None \
                and micro_batch_size != int(job_mbs):
            raise PipelineRuntimeError(
                f"the script trains micro-batches of {micro_batch_size} samples but the job "
                f"was planned for training.micro_batch_size = {job_mbs}; pass "
                "micro_batch_size=None to follow the job, or set the job's to "
                f"{micro_batch_size}.")
        mbs = micro_batch_size or int(job_mbs or "1")
        kwargs.setdefault("link", WorkerLink.from_env(kwargs.get("timeouts")))
        if kwargs.get("precision") is None:   # None, or not given: the job's
            kwargs["precision"] = os.environ.get("CHAMELEON_PRECISION", "fp32")
        tp_rank, tp_size = tp_from_env()
        kwargs.setdefault("tp_rank", tp_rank)
        kwargs.setdefault("tp_size", tp_size)
        device = device_from_env(plan)
        if kwargs["link"] is not None:   # under chameleon-run: its agent handles lost peers
            say_peer_loss_in_one_line(device)
        return cls(model, plan, device, micro_batch_size=mbs, **kwargs)

    # ------------------------------------------------------------------ views

    @property
    def working(self) -> bool:
        return self.device in self.plan.working_devices

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))

    @property
    def is_reporter(self) -> bool:
        """The lowest rank reports for the job: card 0 of the lowest working device, under any
        plan."""
        return bool(self.ranks.device_of_rank) and self.ranks.device_of_rank[0] == self.device \
            and self.tp_rank == 0

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Layer -> its parameters, whole (detached copies), for checks. Under tensor
        parallelism a collective over the unit: every card of it must call it."""
        return {i: {k: full(v).detach().clone() for k, v in m.state_dict().items()}
                for i, m in sorted(self.layers.items())}

    # ------------------------------------------------------------------ entering a plan

    def enter(self, plan: ExecutionPlan, reported: int | None) -> Entry:
        """Agree, restore, move and rebuild for ``plan`` (collective over its world).
        ``reported``: the last step the agents know was reported (None: unknown)."""
        self._phase(-1 if self.committed is None else self.committed, "enter")
        plan.validate()
        if plan.num_layers != self.model.num_layers:
            raise PipelineRuntimeError(
                f"plan generation {plan.generation} splits {plan.num_layers} layers but the "
                f"model has {self.model.num_layers}; make the job's model.layers match the model."
            )
        rows = self._gather(self._row())
        ranks = RankMap(tuple(r.device for r in rows), tuple(r.tp_rank for r in rows))
        check_world(plan, ranks)
        if ranks.tp_size != self.tp_size:
            raise PipelineRuntimeError(
                f"this card runs units of {self.tp_size} cards but the world's units have "
                f"{ranks.tp_size}; give every worker the same CHAMELEON_TP_SIZE (training.tp).")
        self._form_units(ranks)
        agreement = agree(rows)
        rolled = (self.device, self.tp_rank) in agreement.roll_forward
        if rolled:   # the interrupted step was committed elsewhere: apply its summed gradients
            lr = self._lr()
            skipped = self._apply(agreement.last_norm)
            step = self.committed - 1
            self.results[step] = StepResult(step, agreement.last_loss, 0.0, 0.0, 0.0, 0,
                                            grad_norm=agreement.last_norm, lr=lr,
                                            skipped=skipped)
        began = time.perf_counter()
        source, moved_layers, moved_bytes, planned = self._restore(plan, rows, agreement, ranks)
        transfer_s = time.perf_counter() - began
        self.synced = None
        redone = self._settle_reporting(source, agreement, reported)
        self._build(plan, ranks)
        return Entry(self.committed, source, rolled, moved_layers, moved_bytes, planned,
                     transfer_s, redone)

    def _restore(self, plan: ExecutionPlan, rows: list[Row], agreement: Agreement,
                 ranks: RankMap) -> tuple[str, int, float, bool]:
        """Hold this device's layers of ``plan`` at one step every rank agrees on: from peers
        (the normal case), from the checkpoint (a layer has no live holder, or nobody holds
        state), or built from the seed (step 0). Returns the source and (layers moved in the
        job, bytes received here, whether the plan's own transfers were used)."""
        wanted = stage_layers(plan, self.device)
        resume = agreement.resume
        orphans = [] if resume is None else agreement.orphans(plan.num_layers)
        if resume is not None and not orphans:
            held = {r.device: r.held for r in rows if r.committed is not None}
            moves, planned = plan_moves(plan, agreement, held)
            received = move_layers(moves, self.device, ranks, self._export,
                                   self.torch_device or torch.device("cpu"), self.tp_rank)
            self._install(wanted, received, step=resume)
            self.committed = resume
            self.loss_scale = LossScale(*agreement.scale, fixed=self.loss_scale.fixed)
            return ("peers" if moves else "none", sum(len(m.layers) for m in moves),
                    float(sum(s.nbytes for s in received.values())), planned)
        if agreement.checkpoint is not None:
            if self.checkpoint_dir is None:
                raise PipelineRuntimeError(
                    f"device {self.device} has no checkpoint directory while its peers restore "
                    f"the checkpoint of step {agreement.checkpoint}; give every worker the same "
                    "checkpoint directory."
                )
            step = agreement.checkpoint
            self._install(wanted, load_layers(self.checkpoint_dir, step, wanted), fresh=True,
                          step=step)
            self.committed = step
            self.loss_scale = load_loss_scale(self.checkpoint_dir, step, self.precision)
            return "checkpoint", 0, 0.0, True
        if not resume:   # nobody holds state, or only step 0's: the seeded start
            self._start_afresh(wanted)
            return "init", 0, 0.0, True
        present = {r.device for r in rows}
        if any(not t.from_checkpoint and t.src not in present and set(t.layers) & set(orphans)
               for t in plan.transfers):
            # the plan counted on a holder that died while it was being made: its agent will
            # see the exit and publish the next generation, which knows
            raise PeerLost(f"device {self.device}: a holder of layers {_ranges(tuple(orphans))} "
                           f"left before plan generation {plan.generation} could use it")
        # Every replica of some layers is gone (the plan may not know it: it was made from a
        # layout whose own transition a second loss cut short). Every rank sees the same rows,
        # so all take the same branch.
        if self.checkpoint_dir is not None:   # a checkpointing job before its first one
            self._start_afresh(wanted)
            return "init", 0, 0.0, True
        raise StateLost(
            f"layers {_ranges(tuple(orphans))} were lost with every device that held them and "
            f"the job has no checkpoint to restore them from (step {resume} was committed); "
            "training cannot go on. Give the script a checkpoint directory to survive such a "
            "loss."
        )

    def _settle_reporting(self, source: str, agreement: Agreement,
                          reported: int | None) -> int:
        """Where reporting resumes after entering a plan; returns the steps to be redone."""
        assert self.committed is not None
        start = self.committed
        known = max(agreement.reported, self.reported, -1 if reported is None else reported)
        if source in ("checkpoint", "init"):
            # a fresh world or a rollback: steps reported already are trained (and said) again
            self.reported = start - 1
            if start <= known:
                self.redo_below = known + 1
                return known + 1 - start
            return 0
        if reported is None and agreement.reported < 0:
            known = max(known, start - 2)   # a lost reporter had reported up to R - 2
        self.reported = min(known, start - 1)
        return 0

    def _start_afresh(self, wanted: tuple[int, ...]) -> None:
        """Step 0's state: layers from their seeds, a new schedule and loss scale."""
        self._install(wanted, {}, fresh=True, step=0)
        self.committed = 0
        self.loss_scale = LossScale.for_precision(self.precision)

    def _row(self) -> Row:
        held = (min(self.layers), max(self.layers) + 1) if self.layers else (0, 0)
        last = self.results.get(self.committed - 1) if self.committed else None
        return Row(self.device, self.committed, self.synced, held,
                   math.nan if last is None else last.loss, self.reported,
                   None if self.checkpoint_dir is None else latest_step(self.checkpoint_dir),
                   math.nan if last is None else last.grad_norm,
                   self.loss_scale.scale, self.loss_scale.good, self.tp_rank)

    def _gather(self, row: Row) -> list[Row]:
        mine = row.to_tensor()
        out = [torch.zeros(Row.width(), dtype=torch.float64)
               for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(out, mine)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} lost a peer while agreeing on the resume "
                           f"step: {exc}") from exc
        return [Row.from_tensor(t) for t in out]

    def _export(self, layer: int):
        return export_layer(layer, self.layers[layer], self.optimizer)

    def _install(self, wanted: tuple[int, ...], received: dict, *, step: int,
                 fresh: bool = False) -> None:
        """Hold exactly ``wanted`` at ``step`` committed steps: keep what is held, add what
        arrived, drop the rest; one new optimizer over them that keeps every kept parameter's
        state, and the schedule moved onto it. ``fresh``: start from nothing held (layers not
        received are built from their seed: the state of step 0)."""
        if fresh:
            self.layers, self.optimizer, self.scheduler = {}, None, None
        old = self.optimizer
        kept = self.layers
        if self.mesh is not None:
            # a sharded layer lives on one generation's mesh: build every held layer again on
            # the new one, with the shards this card holds
            received = {**{x: export_layer(x, m, old) for x, m in kept.items()
                           if x in wanted and x not in received}, **received}
            kept = {}
        modules: dict[int, nn.Module] = {}
        for layer in wanted:
            if layer in kept and layer not in received:
                modules[layer] = kept[layer]
            else:
                if not fresh and layer not in received:
                    raise PipelineRuntimeError(
                        f"internal: device {self.device} needs layer {layer}, holds it not and "
                        "was sent nothing")
                module = build_layers(self.model, layer, layer + 1)[0]
                if self.torch_device is not None:
                    module = module.to(self.torch_device)
                if self.mesh is not None and self.model.tp_plan is not None:
                    module = shard_layer(module, layer, self.model.tp_plan(layer), self.mesh)
                modules[layer] = module
        optimizer = (self.model.make_optimizer([p for x in wanted for p in modules[x].parameters()])
                     if wanted else None)
        for layer, module in modules.items():
            if layer in received:
                import_layer(received[layer], module, optimizer)
            elif old is not None and optimizer is not None:
                for p in module.parameters():
                    if p in old.state:
                        optimizer.state[p] = old.state[p]
        self.scheduler = self._move_schedule(optimizer, old, step)
        self.layers, self.optimizer = modules, optimizer

    def _move_schedule(self, optimizer: torch.optim.Optimizer | None,
                       old: torch.optim.Optimizer | None,
                       step: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule on ``optimizer`` at ``step`` committed steps: the current
        one carried over (its state and the hyper-parameters it set on the old optimizer's
        groups), or, in a process that has none at that step, a new one stepped ``step`` times.
        Both give what one schedule stepped once per committed step would."""
        if self.model.make_scheduler is None or optimizer is None:
            return None
        with warnings.catch_warnings():  # torch warns of a schedule stepped without a step
            warnings.simplefilter("ignore", UserWarning)
            scheduler = self.model.make_scheduler(optimizer)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise PipelineRuntimeError(
                    "ReduceLROnPlateau depends on the losses seen, not on the step, so a process "
                    "that joins cannot rebuild it; use a schedule that is a function of the step "
                    "(LambdaLR, CosineAnnealingLR, SequentialLR, ...).")
            current = self.scheduler
            if (current is not None and old is not None and current.last_epoch == step
                    and len(old.param_groups) == len(optimizer.param_groups)):
                scheduler.load_state_dict(current.state_dict())
                for new_group, old_group in zip(optimizer.param_groups, old.param_groups):
                    new_group.update({k: v for k, v in old_group.items() if k != "params"})
            else:
                for _ in range(step):
                    scheduler.step()
        return scheduler

    def _boundary(self, layer: int) -> BoundarySpec:
        """What enters ``layer`` (sized once per layer for the whole run: plans change, the
        model does not)."""
        if layer not in self._boundaries:
            self._boundaries[layer] = boundary_spec(self.model, layer, self.micro_batch_size,
                                                    self.precision, self.torch_device)
        return self._boundaries[layer]

    def _form_units(self, ranks: RankMap) -> None:
        """The units' process groups for this world (every rank creates every unit's group),
        and this unit's mesh; nothing without tensor parallelism."""
        if self.tp_groups is not None:
            self.tp_groups.destroy()
        with new_sockets() as sockets:
            self.tp_groups = GroupTable((ranks.unit(d) for d in set(ranks.device_of_rank)),
                                        timeout=self.timeouts.delta("collective_s"))
        self._unit_sockets = frozenset(sockets)
        self.mesh = None
        if self.tp_size > 1:
            device_type = (self.torch_device or torch.device("cpu")).type
            self.mesh = make_mesh(self.tp_groups.get(ranks.unit(self.device)), device_type)

    def _build(self, plan: ExecutionPlan, ranks: RankMap) -> None:
        from chameleon_elastic.planning.schedule import device_orders

        self.plan, self.ranks = plan, ranks
        self.rounds = plan_rounds(plan)
        self.holders = layer_holders(plan)
        self.ties = tied_copies(self.model, self.holders)
        rank_sets = (bucket_rank_sets(self.rounds, ranks) if self.sync_mode == "rounds"
                     else layer_holder_rank_sets(self.holders, ranks))
        rank_sets += [rs for t in self.ties for rs in ranks.every_tp_rank(t.devices)]
        with new_sockets() as sockets:
            self.groups = GroupTable(rank_sets, timeout=self.timeouts.delta("collective_s"))
        self.group_sockets = (frozenset(sockets) | self._unit_sockets
                              | GroupSockets.get(dist.group.WORLD, frozenset()))
        self.executor, self.orders = None, ()
        if self.working:
            pipeline, stage = plan.locate(self.device)
            pipe = plan.pipelines[pipeline]
            start = pipe.layers[stage][0]
            stack = nn.ModuleList([self.layers[x] for x in self.layer_ids])
            self.executor = PipelineExecutor(
                plan, self.device, self.model, stack, self.micro_batch_size, ranks,
                input_spec=self._boundary(start) if start > 0 else None,
                torch_device=self.torch_device, precision=self.precision,
                recompute=pipe.recompute[stage], tp_rank=self.tp_rank)
            orders = device_orders(plan)
            self.orders = tuple(orders[self.device])
            _check_message_matching(orders)

    def release_groups(self) -> None:
        """Drop this plan's bucket and unit groups (the default group stays; see
        recovery.abort)."""
        for table in (self.groups, self.tp_groups):
            if table is not None:
                table.destroy()

    # ------------------------------------------------------------------ one step

    def _phase(self, step: int, phase: str) -> None:
        """Entering a phase of a step: progress for the agent's hang detection (a worker that
        trains in ``run``), then the fault-injection hook."""
        if self.recovery is not None and self.recovery.registered:
            self.recovery.link.beat()
        if self.on_phase is not None:
            self.on_phase(step, phase)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else math.nan

    def _apply(self, norm: float) -> bool:
        """Apply the summed gradients of step ``committed`` given the step's job-wide gradient
        norm: clip, step (unless an fp16 step overflowed: every rank skips it), move the loss
        scale and the schedule on. Returns whether the optimizer step was skipped."""
        if self.committed is None or self.synced != self.committed:
            raise PipelineRuntimeError("internal: apply without the step's summed gradients")
        skipped = self.loss_scale.skips(norm)
        if self.optimizer is not None and not skipped:
            if self.max_grad_norm is not None:
                coefficient = self.max_grad_norm / (norm + 1e-6)
                if coefficient < 1.0:
                    for group in self.optimizer.param_groups:
                        for p in group["params"]:
                            if p.grad is not None:
                                p.grad.mul_(coefficient)
            self.optimizer.step()
        self.loss_scale = self.loss_scale.after(norm)
        if self.scheduler is not None:
            with warnings.catch_warnings():  # skipped fp16 steps: the schedule moves on anyway
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
        self.committed += 1
        self.synced = None
        return skipped

    def step(self, step: int, record: bool = False) -> StepResult:
        """Train global step ``step``, which must be the next one (collective). A broken
        transfer or collective raises :class:`~.errors.PeerLost`; use :meth:`run` for a loop
        that recovers instead."""
        if step != self.committed:
            raise PipelineRuntimeError(
                f"step {step} is not the next step: {self.committed} steps are committed, so "
                f"the next one is step {self.committed}."
            )
        began = time.perf_counter()
        loss_sum = 0.0
        square = 0.0
        timings: tuple[OpTiming, ...] = ()
        issued = 0
        compute_done = began
        if self.executor is not None:
            assert self.optimizer is not None and self.groups is not None
            self.optimizer.zero_grad(set_to_none=False)
            outcome = self.executor.run(step, self.orders, record=record,
                                        on_phase=self._phase, loss_scale=self.loss_scale.scale)
            loss_sum, timings = outcome.loss_sum, outcome.timings
            compute_done = time.perf_counter()
            self._phase(step, "sync")
            issued = sync_gradients(self.layers, self.device, self.ranks, self.groups,
                                    rounds=self.rounds, holders=self.holders,
                                    mode=self.sync_mode, ties=self.ties, tp_rank=self.tp_rank)
            if not self.loss_scale.fixed:
                factor = self.loss_scale.unscale_factor()
                for module in self.layers.values():
                    for p in module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)
            square = square_share(self.layers, self.device, self.holders, self.ties,
                                  self.tp_rank)
        self.synced = step
        synced = time.perf_counter()
        self._phase(step, "vote")
        total = torch.tensor([loss_sum, square], dtype=torch.float64)
        try:
            dist.all_reduce(total)
        except RuntimeError as exc:
            raise PeerLost(f"device {self.device} lost a peer in step {step}'s vote: "
                           f"{exc}") from exc
        loss, norm = (float(x) for x in total.tolist())
        norm = math.sqrt(norm) if norm >= 0 else math.nan
        self._phase(step, "apply")
        lr = self._lr()
        skipped = self._apply(norm)
        result = StepResult(step, loss, compute_done - began, synced - compute_done,
                            time.perf_counter() - began, issued, timings,
                            redone=step < self.redo_below, grad_norm=norm, lr=lr,
                            skipped=skipped)
        self.results[step] = result
        self.results.pop(step - 8, None)
        self._phase(step, "applied")
        return result

    # ------------------------------------------------------------------ the loop

    def run(self, steps: int, report: Report | None = None, *,
            checkpoint_every: int = 0) -> None:
        """Train until ``steps`` steps are committed, recovering in place from lost peers.

        ``report(result)`` is called exactly once per committed step, in the process that
        reports for the job (the lowest working device; after a failure another process takes
        over and goes on where the previous one stopped). A step trained again after a rollback
        to a checkpoint comes with ``result.redone``. With ``checkpoint_every`` and a
        ``checkpoint_dir``, a checkpoint is committed after every that many steps and after the
        last one.
        """
        if self.recovery is not None:
            self.recovery.register()
            if self.checkpoint_dir is not None and checkpoint_every:
                self.recovery.link.checkpoints()
        self._report(report)
        while self.committed < steps:
            failure = None
            try:
                if self.recovery is not None and self.recovery.announced():
                    raise PeerLost("the agent announced a new plan generation")
                self.step(self.committed)
                if self.recovery is not None:
                    self.recovery.step_committed()
                done = self.committed
                if (self.checkpoint_dir is not None and checkpoint_every
                        and (done % checkpoint_every == 0 or done == steps)):
                    save_checkpoint(self, self.checkpoint_dir, done)
                    if self.recovery is not None:
                        self.recovery.link.checkpointed(done)
            except PeerLost as exc:
                if self.recovery is None:
                    raise
                # keep the message only: the exception's traceback holds the frames of the
                # broken step, whose pending work keeps the process group (and its sockets)
                # alive, so the peers blocked on them would wait for their timeout
                failure = str(exc)
            if failure is not None:
                self.recovery.recover(failure)
            self._report(report)

    def _report(self, report: Report | None) -> None:
        if report is None or not self.is_reporter:
            return
        for step in range(self.reported + 1, self.committed):
            result = self.results.get(step)
            if result is not None:
                report(result)
            self.reported = step
            if self.recovery is not None:
                self.recovery.link.reported(step)

    def close(self) -> None:
        """Release this plan's process groups (the default group stays)."""
        if self.recovery is not None:
            self.recovery.close()
        self.release_groups()
