"""From an execution plan to what each worker process is told: ranks and ``CHAMELEON_*``.

Card ids are fixed by the initial world: ``card = node * nproc_per_node + local_rank``. With
``training.tp`` > 1 a plan's device is a unit of ``tp`` consecutive cards (``unit = card // tp``);
otherwise a card is a device. A plan names the devices that work; only their cards get a worker.
``RANK`` / ``WORLD_SIZE`` are renumbered densely over the working devices in device order, each
device's cards on consecutive ranks, so every agent computes the same numbering from the same
plan without talking to the others, and an unmodified script sees an ordinary world.

Everything here is a pure function of its arguments (tested without processes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from chameleon_elastic.channel import CHAMELEON_VARS, chameleon_env
from chameleon_elastic.plan import DeviceRole, ExecutionPlan

__all__ = [
    "CHAMELEON_VARS",
    "LocalAssignment",
    "NodeCards",
    "chameleon_env",
    "device_id",
    "local_assignments",
    "write_plan_file",
]


@dataclass(frozen=True)
class LocalAssignment:
    """One worker this node starts: its card (process slot), its dense global rank, and its
    plan device's role (``role.device``: the unit; ``tp_rank``: its place in it). No role: a
    standby, which waits outside the world for one (runtime/recovery/standby.py; its rank is only a
    label beyond the world's)."""

    local_rank: int
    device: int                     # the card
    global_rank: int
    world_size: int
    role: DeviceRole | None
    tp_rank: int = 0
    unit_ranks: tuple[int, ...] = ()   # global ranks of the unit's cards


def device_id(node: int, local_rank: int, nproc_per_node: int) -> int:
    return node * nproc_per_node + local_rank


def local_assignments(plan: ExecutionPlan, node: int, nproc_per_node: int,
                      world: tuple[int, ...] | None = None,
                      tp: int = 1) -> tuple[LocalAssignment, ...]:
    """Cards of ``node`` whose unit works under ``plan``, in local-rank order (spare / dead
    slots skipped), ranked by their unit's place in ``world`` (default: the working devices,
    sorted; an in-place generation appends the spares that keep a live worker)."""
    roles = {r.device: r for r in plan.roles()}
    world = tuple(sorted(roles)) if world is None else world
    rank_of = {d: i for i, d in enumerate(world)}
    out = []
    for local_rank in range(nproc_per_node):
        card = device_id(node, local_rank, nproc_per_node)
        unit, tp_rank = divmod(card, tp)
        if unit in roles:
            first = rank_of[unit] * tp
            out.append(LocalAssignment(local_rank, card, first + tp_rank, len(world) * tp,
                                       roles[unit], tp_rank, tuple(range(first, first + tp))))
    return tuple(out)


@dataclass(frozen=True)
class NodeCards:
    """This node's cards and the plan devices (units of ``tp`` cards) they make up."""

    node: int
    nproc: int
    tp: int = 1

    @property
    def cards(self) -> list[int]:
        return [device_id(self.node, lr, self.nproc) for lr in range(self.nproc)]

    @property
    def units_per_node(self) -> int:
        return self.nproc // self.tp

    def units(self, cards: Iterable[int]) -> set[int]:
        return {c // self.tp for c in cards}

    def cards_of(self, units: Iterable[int]) -> set[int]:
        """The cards of ``units`` that run here."""
        wanted = set(units)
        return {c for c in self.cards if c // self.tp in wanted}

    def ranks(self, card: int, world: tuple[int, ...]) -> tuple[int, int, int]:
        """(local rank, global rank, world size) of a card kept into a generation whose units
        are ``world`` in rank order."""
        unit, tp_rank = divmod(card, self.tp)
        return (card - self.node * self.nproc, world.index(unit) * self.tp + tp_rank,
                len(world) * self.tp)


def write_plan_file(plan: ExecutionPlan, directory: str | Path, text: str | None = None) -> str:
    """Write ``plan-gen<N>.json`` atomically (temp file + rename); returns its path. ``text``:
    the plan's one-line JSON when the caller has it already."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"plan-gen{plan.generation}.json"
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            # one line: json's C encoder (indent falls back to the Python one: 0.4 s of the
            # decider's 0.58 s of CPU at 8192 devices, on the recovery's critical path)
            fh.write(plan.to_json(indent=None) if text is None else text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(target)
