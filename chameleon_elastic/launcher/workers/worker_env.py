"""The environment a worker starts with: torchrun's variables, and with a job the plan's.

torch builds the same block inside ``LocalElasticAgent._start_workers``, which starts every
local worker at once; the agent starts workers one device at a time (a replacement in place),
so it builds the block itself, variable for variable as torch 2.13 does
(tests/launcher/test_conformance.py compares the two launchers' workers).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from string import Template
from typing import Any

from torch.distributed.elastic.utils import macros

from chameleon_elastic import channel

__all__ = ["chameleon_vars", "launch_inputs", "standby_args", "torchrun_vars"]


def torchrun_vars(spec: Any, wg: Any, worker: Any, restart_count: int) -> dict[str, str]:
    """torchrun's per-worker variables (``LOCAL_RANK`` and the rest of the per-rank ones come
    from the agent's ``_set_local_rank_env``, torch's own hook); ``restart_count``: the
    launch's TORCHELASTIC_RESTART_COUNT (0 at the first launch, more after each relaunch)."""
    env = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(wg.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(wg.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(wg.master_addr),
        "MASTER_PORT": str(wg.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def standby_args(spec: Any) -> tuple[str, ...] | None:
    """The arguments that start the worker's script as a standby (runtime/recovery/standby.py: it
    waits, warm, for a place in a generation), or None when the entry point is not a Python
    script or module that the standby can run (``--no-python``, ``--run-path``)."""
    args = tuple(spec.args)
    python = os.getenv("PYTHON_EXEC", sys.executable)
    if spec.entrypoint != python or args[:1] != ("-u",) or len(args) < 2:
        return None
    return ("-u", "-m", "chameleon_elastic.runtime.recovery.standby", *args[1:])


def chameleon_vars(session: Any, assignment: Any, channel_address: str) -> dict[str, str]:
    """The plan (``CHAMELEON_*``), the job's training settings and the agent's channel; a
    standby (no role) gets the plan's generation-wide variables and its device."""
    if assignment.role is None:
        env = channel.spare_env(session.plan, assignment.device // session.tp,
                                session.plan_file, (), assignment.tp_rank, session.tp)
    else:
        env = channel.chameleon_env(session.plan, assignment.role, session.plan_file,
                                    assignment.unit_ranks, assignment.tp_rank)
    env.update(channel.job_env(session.spec))
    env[channel.AGENT_STORE_ENV] = channel_address
    return env


def launch_inputs(todo: list[tuple[Any, Any]], spec: Any, wg: Any, restart_count: int,
                  session: Any, channel_address: str, extra_env: dict[str, str],
                  set_local_rank_env: Callable[[dict, int, Any], None],
                  prefix_template: str | None) -> tuple[dict, dict, dict | None]:
    """(envs, args, log line prefixes) by index for torch's ``start_processes``: each
    ``(Worker, LocalAssignment or None)`` of ``todo`` gets torchrun's variables, torch's
    per-rank ones (``set_local_rank_env``, the agent's hook), with a job the plan's, and
    ``extra_env`` (the profiler's)."""
    envs: dict[int, dict[str, str]] = {}
    args: dict[int, tuple] = {}
    prefixes: dict[int, str] | None = {} if prefix_template else None
    for index, (worker, assignment) in enumerate(todo):
        env = torchrun_vars(spec, wg, worker, restart_count)
        set_local_rank_env(env, worker.local_rank, spec)
        if session is not None and assignment is not None:
            env.update(chameleon_vars(session, assignment, channel_address))
        env.update(extra_env)
        if prefixes is not None:
            prefixes[index] = Template(prefix_template).safe_substitute(
                role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank)
        envs[index] = env
        standby = assignment is not None and assignment.role is None
        args[index] = tuple(macros.substitute(list(standby_args(spec) if standby else spec.args),
                                              str(worker.local_rank)))
    return envs, args, prefixes
