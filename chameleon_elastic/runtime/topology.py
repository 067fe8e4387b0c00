"""Where this process sits: its plan, its device id, and the device <-> rank map.

Ranks and device ids differ once devices fail. The launcher numbers ranks densely: the rank of a
device is its index in ``plan.working_devices`` (sorted), then spare devices, if they run at
all, after them. The runtime does not rely on that convention silently: entering a plan
all-gathers every rank's device id (with its state, see ``commit.Row``), so whatever ``RANK``
the launcher chose, each rank knows which device every other rank is, and :func:`check_world`
fails at once with a clear error when the world does not match the plan.

Timeouts come from :class:`chameleon_elastic.timeouts.Timeouts` (environment > argument >
default), the one place both the launcher and the runtime resolve them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from chameleon_elastic.plan import ExecutionPlan, PlanError
from chameleon_elastic.timeouts import Timeouts

from .errors import PipelineRuntimeError

__all__ = [
    "RankMap",
    "check_world",
    "dense_rank_map",
    "device_from_env",
    "init_distributed",
    "plan_from_env",
]

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


def check_world(plan: ExecutionPlan, devices: tuple[int, ...]) -> None:
    """The world's devices (one per rank, all-gathered) must run every working device of the
    plan and nothing outside it (spares may keep a process)."""
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
    """Join the job's process group with the back-end of the device plugin (gloo on CPU) and the
    resolved collective timeout. Under ``chameleon-run --job`` the group is the newest plan
    generation's, taken from this node's agent (so a process started to join a running job
    meets the survivors); otherwise ``init_process_group`` from torchrun's environment. No-op
    when already initialised."""
    if dist.is_initialized():
        return
    from chameleon_elastic.plugins import get_backend

    from .recovery import WorkerLink, join_generation, preload_before_groups

    timeouts = Timeouts.resolve(collective_s=timeout_s)
    name = backend or get_backend(os.environ.get("CHAMELEON_BACKEND")).dist_backend
    link = WorkerLink.from_env(timeouts)
    try:
        if link is not None:
            join_generation(link.current(), link.device, name, timeouts)
        else:
            preload_before_groups()
            dist.init_process_group(backend=name, timeout=timeouts.delta("collective_s"))
    except (RuntimeError, ValueError) as exc:
        raise PipelineRuntimeError(
            f"cannot join the process group with backend {name!r}: {exc}; start the script "
            "with chameleon-run or torchrun so MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE "
            "are set."
        ) from exc
