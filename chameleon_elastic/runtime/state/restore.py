"""Where a device's layers come from when it enters a plan: peers, a snapshot, the checkpoint,
or the seed.

Every rank sees the same agreement (:mod:`.commit`), so every rank takes the same branch:

- **peers** (the normal case): the layers every rank holds at the agreed step; what a device
  lacks is moved point to point from a live holder (:mod:`.migrate`), with its optimizer state;
- **snapshot**: some layer has no live holder, and an in-memory snapshot of every layer
  survives (:mod:`.snapshots`; all-gathered inventories): every rank goes back to the newest
  one every layer shares, unless a newer checkpoint exists; the steps since are trained again;
- **checkpoint**: some layer has no live holder and no snapshot (then one sentence says so),
  or nobody holds state (a fresh world), and a checkpoint exists: every rank loads the last
  committed one under the new plan;
- **init**: nobody holds state past step 0, or a checkpointing job lost some layer before its
  first checkpoint: layers are built from their seeds, step 0.

A layer held nowhere with no snapshot or checkpoint to restore it from ends training
(:class:`~.commit.StateLost`); a plan that counted on a holder that died while it was being
made raises :class:`~.errors.PeerLost`, and the next generation knows better. Why a module of
its own: the choice of source is the one decision of entering a plan that can lose work, and it
reads best in one place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from chameleon_elastic.plan import ExecutionPlan

from ..errors import PeerLost, PipelineRuntimeError
from ..precision import LossScale
from ..topology import RankMap
from .carry_over import hold_layers
from .checkpoint import load_job_states, load_layers, load_loss_scale
from .commit import Agreement, Row, StateLost
from .layer_state import LayerState
from .migrate import move_layers, plan_moves, stage_layers
from .snapshots import Found, gather_inventories, newest_common, restore_snapshot
from .user_state import load_states, share_job_state

__all__ = ["restore"]

#: a PipelineTrainer, read and updated through its fields (never its methods)
TrainerState = Any


def restore(t: TrainerState, plan: ExecutionPlan, rows: list[Row], agreement: Agreement,
            ranks: RankMap) -> tuple[str, int, float]:
    """Hold this device's layers of ``plan`` at one step every rank agrees on, and set
    ``t.committed`` to it. Returns the source (``peers``, ``none``: nothing to move,
    ``snapshot``, ``checkpoint`` or ``init``), the layers moved in the job and the bytes
    received here."""
    wanted = stage_layers(plan, t.device)
    resume = agreement.resume
    orphans = [] if resume is None else agreement.orphans(plan.num_layers)
    if resume is not None and not orphans:
        return _from_peers(t, plan, rows, agreement, ranks, wanted)
    if resume is not None:   # some layers have no live holder: a snapshot may keep them
        found = newest_common(gather_inventories(t.snapshots, t.device, plan.num_layers,
                                                 ranks), plan.num_layers)
        if found is not None and (agreement.checkpoint is None
                                  or found.step >= agreement.checkpoint):
            return _from_snapshot(t, plan, ranks, found, wanted)
        if found is None and agreement.checkpoint is not None and t.snapshots.every \
                and dist.get_rank() == 0:
            print(f"chameleon: layers {_ranges(tuple(orphans))} were lost with every device "
                  "that held them and no in-memory snapshot of them survived: restoring the "
                  f"checkpoint of step {agreement.checkpoint} from disk.", flush=True)
    if agreement.checkpoint is not None:
        return _from_checkpoint(t, agreement.checkpoint, wanted)
    if not resume:   # nobody holds state, or only step 0's: the seeded start
        return _afresh(t, wanted)
    present = {r.device for r in rows}
    if any(not tr.from_checkpoint and tr.src not in present and set(tr.layers) & set(orphans)
           for tr in plan.transfers):
        # the plan counted on a holder that died while it was being made: its agent will
        # see the exit and publish the next generation, which knows
        raise PeerLost(f"device {t.device}: a holder of layers {_ranges(tuple(orphans))} "
                       f"left before plan generation {plan.generation} could use it")
    # Every replica of some layers is gone (the plan may not know it: it was made from a
    # layout whose own transition a second loss cut short). Every rank sees the same rows,
    # so all take the same branch.
    if t.checkpoint_dir is not None:   # a checkpointing job before its first one
        return _afresh(t, wanted)
    snapshots = ", no in-memory snapshot of them survived" if t.snapshots.every else ""
    raise StateLost(
        f"layers {_ranges(tuple(orphans))} were lost with every device that held them"
        f"{snapshots} and the job has no checkpoint to restore them from (step {resume} was "
        "committed); training cannot go on. Give the script a checkpoint directory to survive "
        "such a loss."
    )


def _from_peers(t: TrainerState, plan: ExecutionPlan, rows: list[Row], agreement: Agreement,
                ranks: RankMap, wanted: tuple[int, ...]) -> tuple[str, int, float]:
    held = {r.device: r.held for r in rows if r.committed is not None}
    moves, _ = plan_moves(plan, agreement, held)
    device = t.torch_device or torch.device("cpu")
    received = move_layers(moves, t.device, ranks, t.layers, t.optimizer, device, t.tp_rank,
                           extras=t.extras)
    _hold(t, wanted, received, step=agreement.resume)
    share_job_state(t.job_state, ranks, [r.committed is not None for r in rows],
                    tag=plan.num_layers, device=device)
    t.committed = agreement.resume
    t.loss_scale = LossScale(*agreement.scale, fixed=t.loss_scale.fixed)
    return ("peers" if moves else "none", sum(len(m.layers) for m in moves),
            float(sum(s.nbytes for s in received.values())))


def _from_snapshot(t: TrainerState, plan: ExecutionPlan, ranks: RankMap, found: Found,
                   wanted: tuple[int, ...]) -> tuple[str, int, float]:
    """Every layer back to snapshot ``found.step``: this device's own copies, the others
    moved from the devices that keep them; the job's state from whoever holds it."""
    device = t.torch_device or torch.device("cpu")
    states, moved_layers, moved_bytes = restore_snapshot(t.snapshots, found, plan, t.device,
                                                         ranks, device)
    _hold(t, wanted, states, fresh=True, step=found.step)
    job = t.snapshots.job_state(found.step)
    if job is not None:
        load_states(t.job_state, job, f"the snapshot of step {found.step}")
    share_job_state(t.job_state, ranks, [d in found.job for d in ranks.device_of_rank],
                    tag=plan.num_layers, device=device)
    t.committed = found.step
    t.loss_scale = LossScale(*found.scale, fixed=t.loss_scale.fixed)
    return "snapshot", moved_layers, moved_bytes


def _from_checkpoint(t: TrainerState, step: int,
                     wanted: tuple[int, ...]) -> tuple[str, int, float]:
    if t.checkpoint_dir is None:
        raise PipelineRuntimeError(
            f"device {t.device} has no checkpoint directory while its peers restore "
            f"the checkpoint of step {step}; give every worker the same checkpoint directory."
        )
    _hold(t, wanted, load_layers(t.checkpoint_dir, step, wanted), fresh=True, step=step)
    load_states(t.job_state, load_job_states(t.checkpoint_dir, step),
                   f"checkpoint step {step}")
    t.committed = step
    t.loss_scale = load_loss_scale(t.checkpoint_dir, step, t.precision)
    return "checkpoint", 0, 0.0


def _afresh(t: TrainerState, wanted: tuple[int, ...]) -> tuple[str, int, float]:
    """Step 0's state: layers from their seeds, a new schedule and loss scale."""
    _hold(t, wanted, {}, fresh=True, step=0)
    load_states(t.job_state, t.job_state_initial, "the registered objects' first state")
    t.committed = 0
    t.loss_scale = LossScale.for_precision(t.precision)
    return "init", 0, 0.0


def _hold(t: TrainerState, wanted: tuple[int, ...], received: dict[int, LayerState], *,
          step: int, fresh: bool = False) -> None:
    t.layers, t.optimizer, t.scheduler, t.extras = hold_layers(
        t.model, wanted, received, (t.layers, t.optimizer, t.scheduler, t.extras), step=step,
        device=t.device, torch_device=t.torch_device, mesh=t.mesh, fresh=fresh,
        layer_state=t.layer_state)


def _ranges(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
