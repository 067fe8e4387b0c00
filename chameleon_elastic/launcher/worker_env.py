"""The environment a worker starts with: torchrun's variables, and with a job the plan's.

torch builds the same block inside ``LocalElasticAgent._start_workers``, which starts every
local worker at once; the agent starts workers one device at a time (a replacement in place),
so it builds the block itself, variable for variable as torch 2.13 does
(tests/launcher/test_conformance.py compares the two launchers' workers).
"""

from __future__ import annotations

import os
from typing import Any

from chameleon_elastic import channel

__all__ = ["chameleon_vars", "torchrun_vars"]


def torchrun_vars(spec: Any, wg: Any, worker: Any, restarts_used: int) -> dict[str, str]:
    """torchrun's per-worker variables (``LOCAL_RANK`` and the rest of the per-rank ones come
    from the agent's ``_set_local_rank_env``, torch's own hook)."""
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
        "TORCHELASTIC_RESTART_COUNT": str(restarts_used),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def chameleon_vars(session: Any, assignment: Any, channel_address: str) -> dict[str, str]:
    """The plan (``CHAMELEON_*``), the job's training settings and the agent's channel."""
    env = channel.chameleon_env(session.plan, assignment.role, session.plan_file,
                                assignment.unit_ranks, assignment.tp_rank)
    env.update(channel.job_env(session.spec))
    env[channel.AGENT_STORE_ENV] = channel_address
    return env
