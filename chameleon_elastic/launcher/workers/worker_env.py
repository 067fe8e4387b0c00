"""The environment a worker starts with: torchrun's variables, and with a job the plan's.

torch builds the same block inside ``LocalElasticAgent._start_workers``, which starts every
local worker at once; the agent starts workers one device at a time (a replacement in place),
so it builds the block itself, variable for variable as torch 2.13 does
(tests/launcher/test_conformance.py compares the two launchers' workers).

One of torchrun's variables changes with a job: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, what
NCCL's watchdog does when it sees a communicator fail or time out. torchrun gives 1 (abort the
communicator, then tear the process down; torch's own default, 3, tears it down too), so a
survivor whose collective broke because a peer died would die itself, and an in-place recovery
would become a relaunch. A job's workers get 0 (the watchdog only reports): the survivor
leaves the collective by aborting every communicator at once itself, which torch asks to do
with the watchdog's handling off (``_abort_process_group``'s note; docs/runtime.md, *NCCL:
leaving a collective blocked on a lost peer*). A value the user set is kept, and one that
tears workers down is named once at start (:func:`nccl_watchdog_warning`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from string import Template
from typing import Any

from torch.distributed.elastic.utils import macros

from chameleon_elastic import channel

__all__ = ["ASYNC_ERROR_HANDLING", "PLANNED_ERROR_HANDLING", "TEAR_DOWN_MODES", "chameleon_vars",
           "launch_inputs", "nccl_watchdog_warning", "standby_args", "torchrun_vars"]

#: what NCCL's watchdog does on a communicator's error or timeout (torch's ErrorHandlingMode:
#: 0 nothing, 1 abort and tear down, 2 abort only, 3 tear down without abort; torch's default 3)
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: torchrun's value, kept without a job
TORCHRUN_ERROR_HANDLING = "1"
#: a job's workers': the watchdog reports, the runtime aborts (plugins/cuda.py)
PLANNED_ERROR_HANDLING = "0"
#: the values with which the watchdog kills a survivor that in-place recovery would keep
TEAR_DOWN_MODES = frozenset({"1", "3"})


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
        ASYNC_ERROR_HANDLING: os.getenv(ASYNC_ERROR_HANDLING, TORCHRUN_ERROR_HANDLING),
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
    env[ASYNC_ERROR_HANDLING] = os.getenv(ASYNC_ERROR_HANDLING, PLANNED_ERROR_HANDLING)
    return env


def nccl_watchdog_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """The one line a job's launcher says at start when the user's
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` would have NCCL's watchdog kill a survivor (1 or 3),
    None otherwise (unset: the job's 0; 0 or 2: nothing torn down)."""
    value = (os.environ if environ is None else environ).get(ASYNC_ERROR_HANDLING)
    if value is None or value.strip() not in TEAR_DOWN_MODES:
        return None
    return (f"{ASYNC_ERROR_HANDLING}={value.strip()} is kept, but with it NCCL's watchdog tears "
            "down a worker whose collective broke because a peer died, so its recovery in "
            f"place becomes a restart; unset it (workers then get "
            f"{PLANNED_ERROR_HANDLING}) or set it to {PLANNED_ERROR_HANDLING}.")


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
