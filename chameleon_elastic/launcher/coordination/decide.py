"""The decider's part of a round, as pure functions of the nodes' reports.

From the reports: which devices are lost or back (:func:`losses`), how each was lost
(:func:`reasons`), the slow ones (:func:`speeds_of`), whether the workers can regroup in place
(:func:`inplace_possible`), whether they need to hear of it at all (:func:`quiet_loss`), and the :class:`~.messages.Decision` for the plan the session chose
(:func:`decide`). No store, no clock: tested with plain reports.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from chameleon_elastic.plan import ExecutionPlan

from ..plan_env import device_id
from .messages import Decision, NodeReport, world_of

__all__ = ["decide", "inplace_possible", "losses", "quiet_loss", "reasons", "speeds_of"]


def losses(reports: Sequence[NodeReport], excluded: Collection[int], devices: int,
           nproc: int) -> tuple[set[int], set[int]]:
    """(lost, joined): devices reported lost or on a node that did not report, and excluded
    devices on a reporting node that no longer reports them lost."""
    present = {r.node for r in reports}
    reported = {d for r in reports for d in r.lost}
    on_present = {device_id(node, lr, nproc) for node in present for lr in range(nproc)}
    everything = set(range(devices))
    lost = (reported | (everything - on_present)) & everything
    joined = (set(excluded) & on_present) - reported
    return lost, joined


def reasons(reports: Sequence[NodeReport], lost: Collection[int],
            nproc: int) -> tuple[tuple[int, str], ...]:
    """How each lost device was lost, for every agent's recovery line: what its own node
    reported (a signal, a hang, the health check), or ``node gone`` when its node did not
    report at all (a node that merely lost a worker is alive and says so)."""
    said = {d: why for r in reports for d, why in r.why}
    present = {r.node for r in reports}
    return tuple((d, said.get(d) or ("lost" if d // nproc in present else "node gone"))
                 for d in sorted(lost))


def speeds_of(reports: Sequence[NodeReport], excluded: Collection[int]) -> dict[int, float]:
    """Every node's slow devices and their factors (excluded devices left out)."""
    return {d: f for r in reports for d, f in r.speeds if d not in set(excluded)}


def inplace_possible(reports: Sequence[NodeReport], inplace_wanted: bool) -> bool:
    """In place when wanted and every node's live workers run on the runtime."""
    return inplace_wanted and all(r.ready for r in reports)


def quiet_loss(lost: Collection[int], joined: Collection[int], excluded: Collection[int],
               standbys: Collection[int]) -> bool:
    """Whether the devices newly lost are all standbys (spares outside the training world:
    no collective includes them) and none came back: then the workers need not hear of it
    (session.JobSession.drop_standbys)."""
    new = set(lost) - set(excluded)
    return bool(new) and not joined and new <= set(standbys)


def decide(plan: ExecutionPlan, excluded: Collection[int], reports: Sequence[NodeReport],
           inplace_wanted: bool, why: tuple[tuple[int, str], ...] = (),
           speeds: tuple[tuple[int, float], ...] = (), launched: int = -1,
           quiet: bool = False) -> Decision:
    """The decision for the plan the session has chosen (a new generation when in place).
    In place, a plan that sources layers from a checkpoint when no worker has one cannot go
    on in place: a job that checkpoints (but lost them before its first checkpoint) is
    relaunched, so every worker starts again from step 0 and says so; a job that never
    checkpoints ends with a sentence and exit 93 (``no_plan``), since a requeue would start
    over from step 0 and redo everything.
    ``launched``: the last decision's ``launches`` (-1: none yet, this is the first launch).
    ``quiet``: only standbys were lost; the workers go on as they are (nothing starts)."""
    live = {d for r in reports for d in r.live}
    inplace = inplace_possible(reports, inplace_wanted) and bool(live)   # someone to keep
    reported = max((r.reported for r in reports if r.reported is not None), default=None)
    runtime = bool(live) and all(r.ready for r in reports)
    lost_layers = plan.checkpoint_layers
    checkpoints = [r.checkpoint for r in reports if r.checkpoint is not None]
    error = None
    if lost_layers and inplace and runtime and not checkpoints and any(
            r.checkpoints for r in reports):
        inplace = False
    elif lost_layers and inplace and runtime and not checkpoints:
        lo, hi = lost_layers[0], lost_layers[-1]
        span = f"layer {lo} was" if lo == hi else f"layers {lo}-{hi} were"
        error = (f"{span} lost with every device that held them (devices "
                 f"{sorted(excluded)} are gone) and the job has no checkpoint to restore them "
                 "from; training cannot go on. Give the script a checkpoint directory (for "
                 "examples/train_gpt.py: --checkpoint-dir) to survive such a loss.")
    starting = (tuple(d for d in plan.working_devices if d not in live)
                if inplace and not quiet else ())
    # a relaunch, or a process started in place (a crashed worker's replacement), counts
    launches = 0 if launched < 0 else launched + (0 if (inplace and not starting) or quiet
                                                  else 1)
    return Decision(plan, tuple(sorted(excluded)), world_of(plan, live, inplace), inplace,
                    reported, error, why, tuple(sorted(r.node for r in reports)), speeds,
                    no_plan=error is not None, starting=starting, launches=launches, quiet=quiet)
