"""Where this process sits: its plan, its device id, and the device <-> rank map.

Ranks and device ids differ once devices fail. The launcher numbers ranks densely: the rank of a
device is its index in ``plan.working_devices`` (sorted), then spare devices, if they run at
all, after them. The runtime does not rely on that convention silently: entering a plan
all-gathers every rank's device id (with its state, see ``commit.Row``), so whatever ``RANK``
the launcher chose, each rank knows which device every other rank is, and :func:`check_world`
fails at once with a clear error when the world does not match the plan.

Joining the process group itself is :mod:`.join`'s (``init_distributed``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chameleon_elastic.plan import ExecutionPlan, PlanError

from .errors import PipelineRuntimeError

__all__ = [
    "RankMap",
    "check_world",
    "dense_rank_map",
    "device_from_env",
    "node_of",
    "plan_from_env",
    "tp_from_env",
]

@dataclass(frozen=True)
class RankMap:
    """Both directions of the (device, tensor-parallel rank) <-> rank numbering of one world.

    A plan's device is a unit of ``tp`` cards (``training.tp``; one card when 1), and each
    card is a process with a rank: ``device_of_rank[r]`` is rank r's device and
    ``tp_rank_of_rank[r]`` its place inside the unit (all 0 without tensor parallelism).
    Point-to-point transfers and data-parallel groups join cards of the same tensor-parallel
    rank, so most lookups take one.
    """

    device_of_rank: tuple[int, ...]
    tp_rank_of_rank: tuple[int, ...] = ()
    _index: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tp_rank_of_rank:
            object.__setattr__(self, "tp_rank_of_rank", (0,) * len(self.device_of_rank))
        cards = zip(self.device_of_rank, self.tp_rank_of_rank)
        object.__setattr__(self, "_index", {c: r for r, c in enumerate(cards)})

    @property
    def tp_size(self) -> int:
        return max(self.tp_rank_of_rank, default=0) + 1

    def rank(self, device: int, tp_rank: int = 0) -> int:
        r = self._index.get((device, tp_rank))
        if r is not None:
            return r
        which = f"device {device}" + (f" (tensor-parallel rank {tp_rank})" if tp_rank else "")
        raise PipelineRuntimeError(
            f"{which} has no rank in this world (ranks hold devices "
            f"{list(self.device_of_rank)}); the plan and the started workers disagree."
        )

    def ranks(self, devices: tuple[int, ...] | list[int], tp_rank: int = 0) -> tuple[int, ...]:
        return tuple(sorted(self.rank(d, tp_rank) for d in devices))

    def every_tp_rank(self, devices: tuple[int, ...] | list[int]) -> list[tuple[int, ...]]:
        """``ranks(devices, t)`` for every tensor-parallel rank t: one group's members each."""
        return [self.ranks(devices, t) for t in range(self.tp_size)]

    def unit(self, device: int) -> tuple[int, ...]:
        """The ranks of ``device``'s cards, in tensor-parallel order."""
        return tuple(self.rank(device, t) for t in range(self.tp_size))


def dense_rank_map(plan: ExecutionPlan, tp: int = 1) -> RankMap:
    """The launcher's convention: working devices (sorted) first, then spares (sorted), each
    device's ``tp`` cards on consecutive ranks."""
    devices = tuple(plan.working_devices) + tuple(sorted(plan.spare_devices))
    return RankMap(tuple(d for d in devices for _ in range(tp)),
                   tuple(t for _ in devices for t in range(tp)))


def check_world(plan: ExecutionPlan, ranks: RankMap) -> None:
    """The world's cards (one per rank, all-gathered) must run every working device of the
    plan, each with all its tensor-parallel ranks once, and nothing outside it (spares may
    keep processes)."""
    cards = list(zip(ranks.device_of_rank, ranks.tp_rank_of_rank))
    if len(set(cards)) != len(cards):
        raise PipelineRuntimeError(
            f"two ranks claim the same device and tensor-parallel rank (ranks -> devices "
            f"{list(ranks.device_of_rank)}); give every worker a distinct CHAMELEON_DEVICE / "
            "CHAMELEON_TP_RANK."
        )
    devices = set(ranks.device_of_rank)
    working = set(plan.working_devices)
    missing = sorted(working - devices)
    extra = sorted(devices - working - set(plan.spare_devices))
    if missing or extra:
        raise PipelineRuntimeError(
            f"the world does not match plan generation {plan.generation}: devices "
            f"{missing} have work but no process, devices {extra} run but are not in the plan; "
            "start exactly one worker per working (or spare) device of the plan."
        )
    partial = sorted(d for d in devices
                     if sorted(t for dd, t in cards if dd == d) != list(range(ranks.tp_size)))
    if partial:
        raise PipelineRuntimeError(
            f"devices {partial} do not have all {ranks.tp_size} tensor-parallel ranks in this "
            "world; start one worker per card of every unit (CHAMELEON_TP_RANK 0 .. tp - 1)."
        )


def plan_from_env(env: Mapping[str, str] | None = None) -> ExecutionPlan | None:
    """The plan named by ``CHAMELEON_PLAN_FILE``, or None when the variable is unset."""
    env = os.environ if env is None else env
    path = env.get("CHAMELEON_PLAN_FILE")
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PipelineRuntimeError(
            f"CHAMELEON_PLAN_FILE={path!r} cannot be read ({exc.strerror}); start the script "
            "with chameleon-run --job, or unset the variable to train data-parallel only."
        ) from exc
    try:
        return ExecutionPlan.from_json(text)
    except PlanError as exc:
        raise PipelineRuntimeError(
            f"CHAMELEON_PLAN_FILE={path!r} does not hold a valid plan: {exc}"
        ) from exc


def tp_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this card's tensor-parallel rank, the unit size): ``CHAMELEON_TP_RANK`` and
    ``CHAMELEON_TP_SIZE``, else (0, 1)."""
    env = os.environ if env is None else env
    try:
        rank, size = int(env.get("CHAMELEON_TP_RANK", "0")), int(env.get("CHAMELEON_TP_SIZE", "1"))
    except ValueError as exc:
        raise PipelineRuntimeError(
            "CHAMELEON_TP_RANK and CHAMELEON_TP_SIZE must be integers; start the script with "
            "chameleon-run, which sets them."
        ) from exc
    if not 0 <= rank < size:
        raise PipelineRuntimeError(
            f"CHAMELEON_TP_RANK={rank} is not below CHAMELEON_TP_SIZE={size}; start the script "
            "with chameleon-run, which sets them."
        )
    return rank, size


def node_of(device: int, tp_size: int = 1, env: Mapping[str, str] | None = None) -> int:
    """The node ``device`` runs on: chameleon-run numbers devices node by node, ``LOCAL_WORLD_SIZE``
    cards (``LOCAL_WORLD_SIZE / tp_size`` devices) per node."""
    env = os.environ if env is None else env
    return device // max(1, int(env.get("LOCAL_WORLD_SIZE", "1")) // tp_size)


def device_from_env(plan: ExecutionPlan, env: Mapping[str, str] | None = None) -> int:
    """``CHAMELEON_DEVICE``, else the device that the dense numbering gives ``RANK``."""
    env = os.environ if env is None else env
    raw = env.get("CHAMELEON_DEVICE")
    if raw is None:
        rank = int(env.get("RANK", "0"))
        order = dense_rank_map(plan, tp_from_env(env)[1]).device_of_rank
        if rank >= len(order):
            raise PipelineRuntimeError(
                f"RANK={rank} but plan generation {plan.generation} has only {len(order)} "
                "devices with a role; set CHAMELEON_DEVICE or start fewer workers."
            )
        return order[rank]
    try:
        return int(raw)
    except ValueError as exc:
        raise PipelineRuntimeError(
            f"CHAMELEON_DEVICE={raw!r} is not an integer device id."
        ) from exc
