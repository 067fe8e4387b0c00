"""Where this process sits: its plan, its device id, and the device <-> rank map.

Ranks and device ids differ once devices fail. The launcher numbers ranks densely: the rank of a
device is its index in ``plan.working_devices`` (sorted), then spare devices, if they run at
all, after them. The runtime does not rely on that convention silently: :func:`exchange_rank_map`
all-gathers every rank's device id once per plan, so whatever ``RANK`` the launcher chose, each
rank knows which device every other rank is, and a world that does not match the plan fails at
once with a clear error instead of hanging in a collective.

Timeouts for every collective and point-to-point transfer are resolved in one place,
:func:`collective_timeout`: environment variable ``CHAMELEON_COLLECTIVE_TIMEOUT_S`` > argument >
default (120 s).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_elastic.plan import ExecutionPlan, PlanError

from .errors import PipelineRuntimeError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankMap",
    "collective_timeout",
    "dense_rank_map",
    "device_from_env",
    "exchange_rank_map",
    "init_distributed",
    "plan_from_env",
]

DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "CHAMELEON_COLLECTIVE_TIMEOUT_S"


def collective_timeout(timeout_s: float | None = None,
                       env: Mapping[str, str] | None = None) -> timedelta:
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError as exc:
            raise PipelineRuntimeError(
                f"{TIMEOUT_ENV}={raw!r} is not a number; set it to a timeout in seconds."
            ) from exc
    else:
        value = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if value <= 0:
        raise PipelineRuntimeError(f"collective timeout {value} s must be positive.")
    return timedelta(seconds=value)


@dataclass(frozen=True)
class RankMap:
    """Both directions of the device <-> rank numbering of one plan's world."""

    device_of_rank: tuple[int, ...]

    def rank(self, device: int) -> int:
        try:
            return self.device_of_rank.index(device)
        except ValueError:
            raise PipelineRuntimeError(
                f"device {device} has no rank in this world (ranks hold devices "
                f"{list(self.device_of_rank)}); the plan and the started workers disagree."
            ) from None

    def ranks(self, devices: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        return tuple(sorted(self.rank(d) for d in devices))


def dense_rank_map(plan: ExecutionPlan) -> RankMap:
    """The launcher's convention: working devices (sorted) first, then spares (sorted)."""
    return RankMap(tuple(plan.working_devices) + tuple(sorted(plan.spare_devices)))


def exchange_rank_map(plan: ExecutionPlan, device: int, group=None) -> RankMap:
    """All-gather each rank's device id (collective) and check it against the plan."""
    world = dist.get_world_size(group)
    mine = torch.tensor([device], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    devices = tuple(int(t.item()) for t in gathered)
    if len(set(devices)) != len(devices):
        raise PipelineRuntimeError(
            f"two ranks claim the same device (ranks -> devices {list(devices)}); give every "
            "worker a distinct CHAMELEON_DEVICE."
        )
    working = set(plan.working_devices)
    missing = sorted(working - set(devices))
    extra = sorted(set(devices) - working - set(plan.spare_devices))
    if missing or extra:
        raise PipelineRuntimeError(
            f"the world does not match plan generation {plan.generation}: devices "
            f"{missing} have work but no process, devices {extra} run but are not in the plan; "
            "start exactly one worker per working (or spare) device of the plan."
        )
    return RankMap(devices)


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


def device_from_env(plan: ExecutionPlan, env: Mapping[str, str] | None = None) -> int:
    """``CHAMELEON_DEVICE``, else the device that the dense numbering gives ``RANK``."""
    env = os.environ if env is None else env
    raw = env.get("CHAMELEON_DEVICE")
    if raw is None:
        rank = int(env.get("RANK", "0"))
        order = dense_rank_map(plan).device_of_rank
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


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """``init_process_group`` from torchrun's environment, with the back-end of the device
    plugin (gloo on CPU) and the resolved collective timeout. No-op when already initialised."""
    if dist.is_initialized():
        return
    from chameleon_elastic.plugins import get_backend

    name = backend or get_backend(os.environ.get("CHAMELEON_BACKEND")).dist_backend
    try:
        dist.init_process_group(backend=name, timeout=collective_timeout(timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise PipelineRuntimeError(
            f"cannot join the process group with backend {name!r}: {exc}; start the script "
            "with chameleon-run or torchrun so MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE "
            "are set."
        ) from exc
