"""Entering a plan: one chain, collective over the plan's world, for every case.

A fresh start, a resume from a checkpoint, a process that joins a running job and a survivor
after a failure all enter a plan the same way (:func:`enter`):

1. all-gather one :class:`~.commit.Row` per rank (what it holds and has committed), check the
   world against the plan, form the tensor-parallel units' groups;
2. agree (:func:`~.commit.agree`): the step to resume at; a rank one step behind rolls forward
   by applying the summed gradients its peers applied (:func:`~.step.apply_step`);
3. restore this device's layers (:mod:`.restore`: peers, checkpoint or seed);
4. settle where reporting resumes, so every committed step is reported once;
5. build what the plan needs: bucket groups, the 1F1B executor and its order.

Why a module of its own: the recovery chain (:mod:`.recovery`) and the trainer's constructor
both enter plans, and the chain must call down into this, never back into the trainer. The
functions take the trainer's state (its fields) and call only downward.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import ExecutionPlan

from ..errors import PeerLost, PipelineRuntimeError
from ..execution.executor import BoundarySpec, PipelineExecutor, boundary_spec
from ..execution.grad_sync import bucket_rank_sets, layer_holder_rank_sets, plan_sums, tied_copies
from ..execution.layout import fifo_matching, layer_holders, links_into, plan_rounds
from ..execution.step import StepResult, apply_step, learning_rate
from ..state.checkpoint import latest_step
from ..state.commit import Agreement, Row, agree
from ..state.restore import restore
from ..tensor_parallel import make_mesh
from ..topology import RankMap, check_world, node_of
from ..world.abort import new_sockets, world_sockets
from ..world.groups import GroupTable

__all__ = ["Entry", "enter", "release_groups"]

#: a PipelineTrainer, read and updated through its fields (never its methods)
TrainerState = Any


@dataclass(frozen=True)
class Entry:
    """How the trainer entered a plan: where state came from and what moved."""

    resume: int
    source: str            # "peers", "none" (nothing to move), "checkpoint" or "init"
    rolled_forward: bool
    moved_layers: int
    moved_bytes: float
    transfer_s: float
    redone_steps: int
    agree_s: float = 0.0   # the all-gather, the agreement and a roll forward
    rebuild_s: float = 0.0   # the plan's groups, executor and orders


def enter(t: TrainerState, plan: ExecutionPlan, reported: int | None) -> Entry:
    """Agree, restore, move and rebuild for ``plan`` (collective over its world).
    ``reported``: the last step the agents know was reported (None: unknown)."""
    agreeing = time.perf_counter()
    t.phases(-1 if t.committed is None else t.committed, "enter")
    if t.saving is not None:   # ended (committed or not) before rows say which one is latest
        t.saving.settle(t.timeouts.collective_s)
    t.snapshots.settle(t.timeouts.collective_s)   # ended before anything changes the state
    plan.validate()
    if plan.num_layers != t.model.num_layers:
        raise PipelineRuntimeError(
            f"plan generation {plan.generation} splits {plan.num_layers} layers but the "
            f"model has {t.model.num_layers}; make the job's model.layers match the model."
        )
    rows = _gather(t.device, _row(t))
    ranks = RankMap(tuple(r.device for r in rows), tuple(r.tp_rank for r in rows))
    check_world(plan, ranks)
    if ranks.tp_size != t.tp_size:
        raise PipelineRuntimeError(
            f"this card runs units of {t.tp_size} cards but the world's units have "
            f"{ranks.tp_size}; give every worker the same CHAMELEON_TP_SIZE (training.tp).")
    _form_units(t, ranks)
    agreement = agree(rows)
    rolled = (t.device, t.tp_rank) in agreement.roll_forward
    if rolled:   # the interrupted step was committed elsewhere: apply its summed gradients
        _roll_forward(t, agreement)
    began = time.perf_counter()
    source, moved_layers, moved_bytes = restore(t, plan, rows, agreement, ranks)
    moved = time.perf_counter()
    t.synced = None
    redone = _settle_reporting(t, source, agreement, reported, _reporter_unheard(t, rows, ranks))
    _build(t, plan, ranks)
    return Entry(t.committed, source, rolled, moved_layers, moved_bytes, moved - began, redone,
                 agree_s=began - agreeing, rebuild_s=time.perf_counter() - moved)


def release_groups(t: TrainerState) -> list[object]:
    """Take the plan's bucket, unit and save groups out of torch's books (the default group
    stays; see :meth:`.recovery.Recovery.abort`) and return them, for the caller to free. A
    save in flight keeps using its group (its thread holds it; the abort shut its sockets
    down, so it ends soon if a peer is gone) and is settled when the next plan is entered:
    that wait (its thread runs at the lowest priority: 0.14-0.22 s on a busy host) is then
    spent beside the wait for the generation rather than before it."""
    groups = [g for table in (t.groups, t.tp_groups) if table is not None
              for g in table.destroy()]
    if t.save_group is not None:
        try:
            dist.destroy_process_group(t.save_group)
        except (RuntimeError, ValueError):
            pass
        groups.append(t.save_group)
        t.save_group = None
    t.group_sockets = t.unit_sockets = frozenset()   # closed with their groups
    return groups


def _roll_forward(t: TrainerState, agreement: Agreement) -> None:
    lr = learning_rate(t)
    skipped = apply_step(t, agreement.last_norm)
    step = t.committed - 1
    t.results[step] = StepResult(step, agreement.last_loss, 0.0, 0.0, 0.0, 0,
                                 grad_norm=agreement.last_norm, lr=lr, skipped=skipped)


def _settle_reporting(t: TrainerState, source: str, agreement: Agreement,
                      reported: int | None, unheard: bool) -> int:
    """Where reporting resumes after entering a plan, so that a step is printed once by the
    job whoever dies when; returns the steps to be redone.

    Resuming at R from peers, whoever reported had handed step R - 2 to its callback before
    it took part in step R - 1's vote, which completed. Step R - 1 it hands over (telling its
    agent first, trainer._report) after applying it. Its agent's word says which, unless it
    is ``unheard`` (its node is gone); then step R - 1 counts as printed: the reporter is far
    likelier to have died in step R (the whole step) than between the vote of R - 1 and its
    line (its optimizer step), and a step printed twice reads as a step trained twice."""
    assert t.committed is not None
    start = t.committed
    known = max(agreement.reported, t.reported, -1 if reported is None else reported)
    if source in ("snapshot", "checkpoint", "init"):
        # a fresh world or a rollback: steps reported already are trained (and said) again
        t.reported = start - 1
        if start <= known:
            t.redo_below = known + 1
            return known + 1 - start
        return 0
    known = max(known, start - 1 if unheard else start - 2)
    t.reported = min(known, start - 1)
    return 0


def _reporter_unheard(t: TrainerState, rows: list[Row], ranks: RankMap) -> bool:
    """Whether the last generation's reporter is gone with its word: it enters with no state,
    and it ran on another node than the new reporter's, so its agent (which holds the last
    step it handed over) may be gone too. A process new to the job knows no last generation."""
    if not t.ranks.device_of_rank or not ranks.device_of_rank:
        return False
    old, new = t.ranks.device_of_rank[0], ranks.device_of_rank[0]
    if any(r.device == old and r.committed is not None for r in rows):
        return False   # still here: its row carries what it reported
    return node_of(old, t.tp_size) != node_of(new, t.tp_size)


def _row(t: TrainerState) -> Row:
    held = (min(t.layers), max(t.layers) + 1) if t.layers else (0, 0)
    last = t.results.get(t.committed - 1) if t.committed else None
    return Row(t.device, t.committed, t.synced, held,
               math.nan if last is None else last.loss, t.reported,
               None if t.checkpoint_dir is None else latest_step(t.checkpoint_dir),
               math.nan if last is None else last.grad_norm,
               t.loss_scale.scale, t.loss_scale.good, t.tp_rank)


def _gather(device: int, row: Row) -> list[Row]:
    mine = row.to_tensor()
    out = [torch.zeros(Row.width(), dtype=torch.float64) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(out, mine)
    except RuntimeError as exc:
        raise PeerLost(f"device {device} lost a peer while agreeing on the resume "
                       f"step: {exc}") from exc
    return [Row.from_tensor(r) for r in out]


def _form_units(t: TrainerState, ranks: RankMap) -> None:
    """The units' process groups for this world (every rank creates every unit's group),
    and this unit's mesh; nothing without tensor parallelism."""
    if t.tp_groups is not None:
        t.tp_groups.destroy()
    with new_sockets() as sockets:
        t.tp_groups = GroupTable((ranks.unit(d) for d in set(ranks.device_of_rank)),
                                 timeout=t.timeouts.delta("collective_s"))
    t.unit_sockets = frozenset(sockets)
    t.mesh = None
    if t.tp_size > 1:
        device_type = (t.torch_device or torch.device("cpu")).type
        t.mesh = make_mesh(t.tp_groups.get(ranks.unit(t.device)), device_type)


def _build(t: TrainerState, plan: ExecutionPlan, ranks: RankMap) -> None:
    """The plan's bucket groups (their sockets recorded for the watchdog), executor and
    1F1B order."""
    from chameleon_elastic.planning.schedule import device_orders

    t.plan, t.ranks = plan, ranks
    t.rounds = plan_rounds(plan)
    t.holders = layer_holders(plan)
    t.ties = tied_copies(t.model, t.holders)
    rank_sets = (bucket_rank_sets(t.rounds, ranks) if t.sync_mode == "rounds"
                 else layer_holder_rank_sets(t.holders, ranks))
    rank_sets += [rs for tie in t.ties for rs in ranks.every_tp_rank(tie.devices)]
    with new_sockets() as sockets:
        t.groups = GroupTable(rank_sets, timeout=t.timeouts.delta("collective_s"))
    t.group_sockets = frozenset(sockets) | t.unit_sockets | world_sockets()
    # this device's gradient sums change only with the plan (set up every step, they cost
    # 0.6-0.7 ms of the tiny GPT's ~0.19 s step)
    t.sums = (plan_sums(t.layers, t.device, ranks, t.rounds, t.groups, t.grad_buffers,
                        t.ties, t.tp_rank) if t.sync_mode == "rounds" else None)
    t.executor, t.orders = None, ()
    if t.device not in plan.working_devices:
        return
    pipeline, stage = plan.locate(t.device)
    pipe = plan.pipelines[pipeline]
    start = pipe.layers[stage][0]
    stack = nn.ModuleList([t.layers[x] for x in sorted(t.layers)])
    orders = device_orders(plan)
    t.executor = PipelineExecutor(
        plan, t.device, t.model, stack, t.micro_batch_size, ranks,
        input_spec=_boundary(t, start) if start > 0 else None,
        torch_device=t.torch_device, precision=t.precision,
        recompute=pipe.recompute[stage], tp_rank=t.tp_rank, feed=t.feed,
        fifo_links=links_into(orders, t.device) if fifo_matching() else None)
    t.orders = tuple(orders[t.device])


def _boundary(t: TrainerState, layer: int) -> BoundarySpec:
    """What enters ``layer`` (sized once per layer for the whole run: plans change, the model
    does not)."""
    if layer not in t.boundaries:
        t.boundaries[layer] = boundary_spec(t.model, layer, t.micro_batch_size, t.precision,
                                            t.torch_device)
    return t.boundaries[layer]
