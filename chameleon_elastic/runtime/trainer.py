"""One device's training under a plan, and under every plan that follows a failure.

:class:`PipelineTrainer` holds the training state that survives plan changes (layers,
optimizer, schedule, loss scale, committed steps) and what one plan needs (groups, executor,
orders), and owns the loop. The work is done by the modules below it, each one job, each
called downward only:

- :mod:`.entering`: entering a plan, one chain for a fresh start, a checkpoint restore, a
  joiner and a survivor (agree, roll forward, restore, rebuild);
- :mod:`.restore`: where the layers come from (peers, checkpoint, seed);
- :mod:`.carry_over`: optimizer state and learning-rate schedule across a plan change;
- :mod:`.step`: one training step (1F1B, gradient sync, vote, apply);
- :mod:`.feed`: this device's micro-batches, read one step ahead;
- :mod:`.evaluation`: the held-out loss under the plan, forward only;
- :mod:`.snapshots`: in-memory copies of the state, taken in the background every K steps;
- :mod:`.recovery`: the in-place recovery chain after a lost peer;
- :mod:`.phases`: progress for the agent and the fault-injection hook at each phase.

:meth:`PipelineTrainer.run` is the fault-tolerant loop: under ``chameleon-run --job`` a broken
transfer or collective (:class:`~.errors.PeerLost`) never reaches the caller; the trainer
recovers in place (:mod:`.recovery`) and goes on at the first step that was not committed
everywhere, reporting every committed step exactly once. Spare devices take part in the vote and
in recoveries and do nothing else. Per-step state other than the layers' (the learning-rate
schedule, fp16's loss scale) is a function of the committed steps (:mod:`.carry_over`; the loss
scale travels in the commit rows and the checkpoint).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup, ExecutionPlan
from chameleon_elastic.timeouts import Timeouts

from .errors import PeerLost, PipelineRuntimeError, keep_message_only, say_peer_loss_in_one_line
from .execution.evaluation import Every, evaluate
from .execution.executor import BoundarySpec, PipelineExecutor
from .execution.feed import Feed
from .execution.grad_sync import GradientSums, SyncMode, TiedCopies
from .execution.layout import data_parallel_plan
from .execution.phases import PhaseHook, Phases
from .execution.step import StepResult, train_step
from .model import PipelineModel
from .precision import LossScale, Precision, check_precision
from .recording import record_step
from .recovery.entering import Entry, enter, release_groups
from .recovery.in_place import Recovery
from .recovery.preemption import Preemption, stop_here
from .state.background_save import BackgroundSave
from .state.snapshots import Snapshots, snapshots_from_env
from .state.user_state import LayerStateFactory, Stateful, copy_state
from .tensor_parallel import full
from .topology import RankMap, device_from_env, plan_from_env, tp_from_env
from .world.abort import Sockets
from .world.groups import GroupTable
from .world.link import WorkerLink

__all__ = ["PipelineTrainer"]

Report = Callable[[StepResult], None]


def _check_arguments(max_grad_norm: float | None, tp_rank: int, tp_size: int) -> None:
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise PipelineRuntimeError(
            f"max_grad_norm = {max_grad_norm!r}; pass a positive norm, or None not to clip.")
    if not 0 <= tp_rank < tp_size:
        raise PipelineRuntimeError(
            f"tensor-parallel rank {tp_rank} of a unit of {tp_size} cards; pass "
            "0 <= tp_rank < tp_size.")


def _job_micro_batch_size(micro_batch_size: int | None) -> int:
    """The script's micro-batch size, else the job's (``CHAMELEON_MICRO_BATCH_SIZE``), else 1;
    one that disagrees with the job's is refused, because the plan was priced for the job's."""
    job_mbs = os.environ.get("CHAMELEON_MICRO_BATCH_SIZE")
    if micro_batch_size is not None and job_mbs is not None \
            and micro_batch_size != int(job_mbs):
        raise PipelineRuntimeError(
            f"the script trains micro-batches of {micro_batch_size} samples but the job "
            f"was planned for training.micro_batch_size = {job_mbs}; pass "
            "micro_batch_size=None to follow the job, or set the job's to "
            f"{micro_batch_size}.")
    return micro_batch_size or int(job_mbs or "1")


class PipelineTrainer:
    """Train ``model`` on this device's share of ``plan``. Collective constructor.

    ``checkpoint_dir``: where :meth:`run` commits checkpoints, and where state comes from when a
    fresh world starts or when no live process holds some layer. ``link``: the agent channel
    (``chameleon-run --job``), which makes recovery in place possible. ``on_phase(step, phase)``
    is a fault-injection hook for tests, called before each phase of a step (``forward``,
    ``backward``, ``sync``, ``vote``, ``apply``) and after ``apply`` (``applied``), and with
    ``enter`` as the process starts entering a plan (``step``: steps committed, -1 when fresh),
    and ``evaluate`` as an evaluation starts (``step``: steps committed).
    ``max_grad_norm``: clip the job-wide gradient norm to it (as
    ``torch.nn.utils.clip_grad_norm_`` over the whole model). ``precision``: ``fp32``, ``bf16``
    or ``fp16`` (:mod:`.precision`). Stages run with activation recomputation where the plan
    says so. ``tp_size`` > 1: the plan's ``device`` is a unit of that many cards, this process
    is card ``tp_rank`` of it, and the layers are sharded by the model's ``tp_plan``
    (:mod:`.tensor_parallel`). ``prefetch``: read the next step's micro-batches in the
    background while a step computes (:mod:`.feed`), with ``data_workers`` readers: threads,
    or worker processes with ``data_processes`` (the dataset must then be picklable).
    ``layer_state`` (name -> ``factory(layer, module)``) and ``job_state`` (name -> object):
    the script's own state (an EMA of the weights, a counter), objects with ``state_dict`` /
    ``load_state_dict`` and optionally ``after_step(step)``, carried through plan changes,
    recoveries and checkpoints (:mod:`.user_state`); a layer's objects are
    ``trainer.extras[layer]``. ``snapshot_every``: every that many committed steps, copy this
    device's state into host memory, its own and its partner's (:mod:`.snapshots`), so that
    layers whose every holder is lost come back from memory (0: none; chameleon-run sets it
    through ``CHAMELEON_SNAPSHOT_EVERY``); ``devices_per_node``: the plan's devices per node,
    for the choice of partners (None: one node).
    """

    def __init__(self, model: PipelineModel, plan: ExecutionPlan, device: int, *,
                 micro_batch_size: int = 1, sync_mode: SyncMode = "rounds",
                 torch_device: torch.device | None = None, timeouts: Timeouts | None = None,
                 checkpoint_dir: str | Path | None = None, link: WorkerLink | None = None,
                 on_phase: PhaseHook | None = None, max_grad_norm: float | None = None,
                 precision: Precision | str = "fp32", tp_rank: int = 0,
                 tp_size: int = 1, prefetch: bool = True, data_workers: int = 1,
                 data_processes: bool = False,
                 layer_state: Mapping[str, LayerStateFactory] | None = None,
                 job_state: Mapping[str, Stateful] | None = None, snapshot_every: int = 0,
                 devices_per_node: int | None = None) -> None:
        if not dist.is_initialized():
            raise PipelineRuntimeError(
                "torch.distributed is not initialised; call "
                "chameleon_elastic.runtime.init_distributed() (or init_process_group) first."
            )
        _check_arguments(max_grad_norm, tp_rank, tp_size)
        self.model = model
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.sync_mode = sync_mode
        self.torch_device = torch_device
        self.timeouts = timeouts or Timeouts.resolve()
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.phases = Phases(on_phase)
        self.max_grad_norm = max_grad_norm
        self.precision = check_precision(precision)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tp_groups: GroupTable | None = None   # one per unit, rebuilt with every plan
        self.mesh = None                            # this unit's DeviceMesh (tp_size > 1)
        self.boundaries: dict[int, BoundarySpec] = {}   # layer -> what enters it (per model)
        self.feed = Feed(model, micro_batch_size, torch_device, prefetch=prefetch,
                         workers=data_workers, processes=data_processes)
        self.evaluated: tuple[int, int] | None = None   # (generation, step) last evaluated
        # training state: survives plan changes
        self.layers: dict[int, nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.layer_state = dict(layer_state or {})   # the script's objects (.user_state)
        self.extras: dict[int, dict[str, Stateful]] = {}   # layer -> name -> object
        self.job_state = dict(job_state or {})
        self.job_state_initial = copy_state(self.job_state)
        self.loss_scale = LossScale.for_precision(self.precision)
        self.committed: int | None = None   # steps applied here; None: no state yet
        #: where this process's state came from when it started: "peers", "none" (nothing to
        #: move), "checkpoint" or "init" (entering.Entry.source), for the script's first line
        self.started_from = "init"
        self.synced: int | None = None      # the step whose summed gradients sit in .grad
        self.grad_buffers: dict = {}        # chunk -> flat gradients, summed in place (.grad_sync)
        self.results: dict[int, StepResult] = {}
        self.reported = -1                  # last step handed to a report callback (job-wide)
        self.redo_below = 0                 # steps below this are trained again (rollback)
        self._no_plan_yet(plan)
        self.recovery: Recovery | None = None
        #: the watchdog's: set when the agents publish a newer generation (runtime/world/abort.py)
        self.superseded: threading.Event | None = None
        self.save_group = None                      # background saves' own group, per plan
        self.saving: BackgroundSave | None = None   # the checkpoint being written
        # in-memory snapshots, here and on a partner (runtime/state/snapshots.py; not yet under
        # tensor parallelism)
        self.snapshots = Snapshots(snapshot_every if tp_size == 1 else 0, devices_per_node)
        self.preemption = Preemption(link)   # a stop at a step boundary (runtime/preemption)
        self._start(plan, link)

    def _no_plan_yet(self, plan: ExecutionPlan) -> None:
        """What one plan needs, empty until :func:`.entering.enter` builds it for ``plan``."""
        self.plan = plan
        self.ranks: RankMap = RankMap(())
        self.groups: GroupTable | None = None
        self.group_sockets: Sockets = frozenset()   # see runtime/world/abort.py
        self.unit_sockets: Sockets = frozenset()
        self.executor: PipelineExecutor | None = None
        self.orders: tuple = ()
        self.rounds: tuple[tuple[AllReduceGroup, ...], ...] = ()
        self.holders: dict[int, tuple[int, ...]] = {}
        self.ties: tuple[TiedCopies, ...] = ()
        self.sums: GradientSums | None = None    # this device's gradient sums, per plan

    def _start(self, plan: ExecutionPlan, link: WorkerLink | None) -> None:
        """Enter the first plan; under chameleon-run, linked to the agent, recovering in place
        when a peer is lost meanwhile."""
        if link is not None:
            from chameleon_elastic.plugins import get_backend

            backend = get_backend(os.environ.get("CHAMELEON_BACKEND") or dist.get_backend())
            self.recovery = Recovery(self, link, backend)
        with keep_message_only(self.recovery is not None) as lost:
            entry = self.enter(plan, None if link is None else link.current().reported)
        if lost.message is not None:
            assert self.recovery is not None   # caught only when recovering
            self.recovery.recover(lost.message)
        else:
            self.started_from = entry.source
            if self.recovery is not None:
                self.recovery.first_entry(entry)

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
        mbs = _job_micro_batch_size(micro_batch_size)
        kwargs.setdefault("link", WorkerLink.from_env(kwargs.get("timeouts")))
        if kwargs.get("precision") is None:   # None, or not given: the job's
            kwargs["precision"] = os.environ.get("CHAMELEON_PRECISION", "fp32")
        tp_rank, tp_size = tp_from_env()
        kwargs.setdefault("tp_rank", tp_rank)
        kwargs.setdefault("tp_size", tp_size)
        every, per_node = snapshots_from_env(kwargs["tp_size"])
        kwargs.setdefault("snapshot_every", every)
        kwargs.setdefault("devices_per_node", per_node)
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

    # ------------------------------------------------------------------ plans and steps

    def enter(self, plan: ExecutionPlan, reported: int | None) -> Entry:
        """Agree, restore, move and rebuild for ``plan`` (collective over its world; see
        :mod:`.entering`). ``reported``: the last step the agents know was reported (None:
        unknown)."""
        return enter(self, plan, reported)

    def release_groups(self) -> None:
        """Drop this plan's bucket and unit groups (the default group stays; see
        recovery.abort)."""
        release_groups(self)

    def step(self, step: int, record: bool = False) -> StepResult:
        """Train global step ``step``, which must be the next one (collective; see
        :mod:`.step`). A broken transfer or collective raises :class:`~.errors.PeerLost`; use
        :meth:`run` for a loop that recovers instead."""
        return train_step(self, step, record)

    # ------------------------------------------------------------------ the loop

    def run(self, steps: int, report: Report | None = None, *,
            checkpoint_every: int = 0, evaluate: Every | None = None,
            on_step: Report | None = None) -> None:
        """Train until ``steps`` steps are committed, recovering in place from lost peers.

        ``report(result)`` is called exactly once per committed step, in the process that
        reports for the job (the lowest working device; after a failure another process takes
        over and goes on where the previous one stopped). A step trained again after a rollback
        to a checkpoint comes with ``result.redone``. With ``checkpoint_every`` and a
        ``checkpoint_dir``, a checkpoint is saved after every that many steps and after the last
        one, in the background (:mod:`.background_save`): training goes on while it is written,
        it is committed once every rank's files are, and the last one is committed when ``run``
        returns. ``evaluate=Every(K, dataset)``: the mean loss over ``dataset`` after every K
        steps and after the last one (:mod:`.evaluation`), reported as the step's
        ``result.eval_loss``; a peer lost during it is recovered from like one lost in a step.
        ``on_step(result)`` is called in every process after each step it trains, with this
        device's own times (``compute_s``, ``sync_s``, ``data_s``, ``step_s``); every working
        device also records its step time for ``chameleon-run --profile-out``.
        A preemption (``chameleon-run`` got SIGTERM, or this process SIGUSR1/SIGUSR2 named in
        ``--signals-to-handle``) ends the loop at the step boundary every rank agreed on in a
        vote: a checkpoint of the committed steps is committed (with a ``checkpoint_dir``) and
        the process exits with ``ExitStatus.PREEMPTED`` (75) (:mod:`.preemption`).
        """
        self.preemption.install()
        if self.recovery is not None:
            self.recovery.register()
            self.phases.report_to(self.recovery.link)   # progress for hang detection
            if self.checkpoint_dir is not None and checkpoint_every:
                self.recovery.link.checkpoints()
        self._report(report, evaluate, steps)
        while self.committed < steps or self._evaluation_due(evaluate, steps):
            with keep_message_only(self.recovery is not None) as lost:
                if self.recovery is not None and self.recovery.announced():
                    raise PeerLost("the agent announced a new plan generation")
                if not self._evaluation_due(evaluate, steps):
                    self._train_one(steps, checkpoint_every, on_step)
                if self._evaluation_due(evaluate, steps):
                    self._evaluate(evaluate)
            if lost.message is not None:
                self.recovery.recover(lost.message)
            self._report(report, evaluate, steps)
            if self.preemption.agreed and self.committed < steps:
                stop_here(self)   # a checkpoint at this boundary, then exit PREEMPTED
        self._settle_save()

    def _settle_save(self) -> None:
        """Wait for the checkpoint being written (the last one must be committed when run
        returns, and DCP's group takes one save at a time)."""
        if self.saving is not None:
            self.saving.settle(self.timeouts.collective_s)
            self._tell_saved()

    def _tell_saved(self) -> None:
        """Tell the agent of a checkpoint committed in the background."""
        saving = self.saving
        if (saving is not None and saving.done() and saving.ok and not saving.told
                and self.recovery is not None):
            self.recovery.link.checkpointed(saving.step)
            saving.told = True

    def _train_one(self, steps: int, checkpoint_every: int, on_step: Report | None) -> None:
        """The next step, then its checkpoint when one is due."""
        busy = self.executor.busy_s if self.executor is not None else 0.0
        self.snapshots.before_step(self)   # in the background, when one is due
        result = self.step(self.committed)
        if self.recovery is not None:
            self.recovery.step_committed(result.step_s)
            if self.executor is not None:   # the device's speed, for the agent
                self.recovery.link.paced(self.plan.generation, self.executor.busy_s - busy,
                                         result.compute_s, result.sync_s)
        if self.working:
            record_step(result.step_s)
            if self.recovery is not None:
                self.recovery.link.committed(result.step, result.step_s)
        if on_step is not None:
            on_step(result)
        done = self.committed
        if (self.checkpoint_dir is not None and checkpoint_every
                and (done % checkpoint_every == 0 or done == steps)):
            self._settle_save()   # one save at a time
            self.phases(done, "checkpoint")
            self.saving = BackgroundSave.start(self, self.checkpoint_dir, done)
        self._tell_saved()

    def _evaluation_due(self, every: Every | None, steps: int) -> bool:
        """Whether the committed state still needs its evaluation. The same on every rank of a
        generation: it depends on the committed step and on whether this generation evaluated
        it, so after a recovery an interrupted evaluation is run again by all, a process that
        joins included (it has evaluated nothing)."""
        return (every is not None and every.due(self.committed, steps)
                and self.evaluated != (self.plan.generation, self.committed))

    def _evaluate(self, every: Every) -> None:
        loss = evaluate(self, every.dataset)
        self.evaluated = (self.plan.generation, self.committed)
        last = self.results.get(self.committed - 1)
        if last is not None:
            self.results[self.committed - 1] = replace(last, eval_loss=loss)

    def _report(self, report: Report | None, every: Every | None = None,
                steps: int = 0) -> None:
        """Hand the committed steps to ``report``; a step whose evaluation is still due waits
        for it."""
        if report is None or not self.is_reporter:
            return
        end = self.committed - 1 if self._evaluation_due(every, steps) else self.committed
        for step in range(self.reported + 1, end):
            # said to the agent before the line is printed: a kill that follows the line (a
            # person or a test acting on it) cannot leave the agents believing it unprinted
            # and have the next reporter print it again (entering._settle_reporting)
            self.reported = step
            if self.recovery is not None:
                self.recovery.link.reported(step)
            result = self.results.get(step)
            if result is not None:
                report(result)

    def close(self) -> None:
        """Release this plan's process groups (the default group stays), a save in flight
        ended first."""
        if self.recovery is not None:
            self.recovery.close()
        self.feed.close()
        if self.saving is not None:
            self.saving.settle(self.timeouts.collective_s)
        self.snapshots.close(self.timeouts.collective_s)
        self.release_groups()
