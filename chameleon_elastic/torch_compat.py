"""Every private member of torch that chameleon-elastic touches, in one place.

torch.distributed.elastic has no public extension API for an agent that keeps some workers
while replacing others, so ``ChameleonAgent`` subclasses ``LocalElasticAgent`` and overrides
or calls some of its underscored methods, and the launcher reuses two private helpers of
``torch.distributed.launcher.api``. Each of them can change in any torch release; this module
names them all, so that a torch upgrade is one file to check, and
tests/test_torch_compat.py fails when one disappears or changes its signature.

Checked against torch 2.13, 2.14 and 2.15, the range pyproject.toml declares
(``>=2.13,<2.16``; CI runs the suite on 2.13.0 and a subset on 2.15.0): the launcher also passes
``WorkerSpec`` arguments that only recent torch has (``numa_options``,
``duplicate_stdout_filters``, ``duplicate_stderr_filters``, ``virtual_local_rank``). None of the
members below changed its signature within that range, so there are no per-version branches;
what differs between the releases is what their process-group backends can do, and that is
answered here too, by release (:func:`torch_release`), for runtime/world/groups.py to decide with.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "AGENT_HOOKS",
    "PRIVATE_ATTRIBUTES",
    "RECONFIGURE_API",
    "RENDEZVOUS_SETTINGS_HOLDERS",
    "WorkerProcess",
    "abort_process_group",
    "addr_and_port",
    "entrypoint_name",
    "fake_tensor_mode",
    "forget_failed_group_names",
    "nccl_means_nccl2",
    "rendezvous_participants",
    "set_min_nodes",
    "split_group_on_cpu",
    "stop_heartbeats",
    "supports_reconfigure",
    "torch_release",
    "worker_process",
]

# LocalElasticAgent / SimpleElasticAgent methods ChameleonAgent overrides (O) or calls (C),
# with the parameters (after self) that our code relies on.
AGENT_HOOKS: dict[str, tuple[str, ...]] = {
    "_invoke_run": ("role",),                              # O: the monitor loop
    "_initialize_workers": ("worker_group",),              # O: rendezvous + start
    "_stop_workers": ("worker_group",),                    # O
    "_monitor_workers": ("worker_group",),                 # O
    "_shutdown": ("death_sig", "timeout"),                 # O and C (super)
    "_exit_barrier": (),                                   # C
    "_set_local_rank_env": ("worker_env", "local_rank", "spec"),  # C: torch's per-rank vars
    "_setup_local_watchdog": ("envs",),                    # C
    "_setup_healthcheck": (),                              # C
}

# Attributes set by torch's constructors that ChameleonAgent reads or writes.
PRIVATE_ATTRIBUTES: tuple[str, ...] = (
    "_worker_group", "_store", "_rdzv_handler", "_logs_specs",
    "_start_method", "_log_line_prefix_template",
)


def addr_and_port(params: Any) -> tuple[str | None, int | None]:
    """The master address and port torchrun derives from the rendezvous parameters."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(params)


def entrypoint_name(entrypoint: Any, args: list[Any]) -> str:
    """The name torchrun gives the job in ``ChildFailedError`` (the script, or ``-m`` module)."""
    from torch.distributed.launcher.api import _get_entrypoint_name

    return _get_entrypoint_name(entrypoint, args)


def stop_heartbeats(handler: Any) -> None:
    """Stop a dynamic rendezvous handler's keep-alive thread (its store is gone: it would only
    ping a dead endpoint). Handlers without one are left alone."""
    stop: Callable[[], None] | None = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stop()


# The parts of a DynamicRendezvousHandler that each keep their own reference to its frozen
# RendezvousSettings (the handler, its state holder, its operation executor).
RENDEZVOUS_SETTINGS_HOLDERS: tuple[str, ...] = ("", "_state_holder", "_op_executor")


def set_min_nodes(handler: Any, min_nodes: int) -> None:
    """Let a dynamic rendezvous handler's next rounds close with ``min_nodes`` nodes. torch
    fixes the minimum for the handler's life; a planned job needs it for its first round only
    (see ChameleonAgent). Handlers without settings (static) are left alone."""
    import dataclasses

    settings = getattr(handler, "_settings", None)
    if settings is None or settings.min_nodes == min_nodes:
        return
    lowered = dataclasses.replace(settings, min_nodes=min_nodes)
    for path in RENDEZVOUS_SETTINGS_HOLDERS:
        owner = getattr(handler, path) if path else handler
        owner._settings = lowered


def rendezvous_participants(handler: Any) -> int | None:
    """How many nodes have joined a dynamic rendezvous handler's current round, as its last
    sync with the backend saw it (read-only, from any thread); None for other handlers."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    participants = getattr(state, "participants", None)
    return None if participants is None else len(participants)


class WorkerProcess:
    """One worker process of a torch process context, whichever kind started it: a
    ``SubprocessContext`` (a script: ``subprocess.Popen`` handlers) or a
    ``MultiprocessContext`` (a function entry point such as ``--run-path``: multiprocessing
    processes). The agent polls, signals and reaps workers one by one through this.

    A function's process does not exit when the function returns: it puts the return value in
    a queue and waits until the parent has read every rank's value (``_worker_finished_event``),
    so that the queue's feeder is not cut off. Here a returned value counts as exit code 0, and
    the event is set once every rank of the context has returned."""

    def __init__(self, context: Any, local_rank: int) -> None:
        handlers = getattr(context, "subprocess_handlers", None)
        self._context = context
        self._rank = local_rank
        self._popen: Any = handlers[local_rank].proc if handlers is not None else None
        self._mp: Any = None if handlers is not None else context._pc.processes[local_rank]

    @property
    def pid(self) -> int:
        return int(self._popen.pid if self._popen is not None else self._mp.pid)

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        if self._popen is not None:
            return self._popen.poll()
        if self._mp.exitcode is not None:
            return int(self._mp.exitcode)
        context = self._context
        returned = context._return_values
        queue = context._ret_vals[self._rank]
        if self._rank not in returned and not queue.empty():
            returned[self._rank] = queue.get()
        if self._rank not in returned:
            return None
        if len(returned) == context.nprocs:
            context._worker_finished_event.set()   # every rank returned: let them all exit
        return 0

    def wait(self) -> int:
        if self._popen is not None:
            return int(self._popen.wait())
        self._mp.join()
        return int(self._mp.exitcode)


def worker_process(context: Any, local_rank: int) -> WorkerProcess:
    return WorkerProcess(context, local_rank)


def abort_process_group(group: Any = None) -> None:
    """Abort a process group's pending work (NCCL), which ``destroy_process_group`` does not."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)


def forget_failed_group_names() -> None:
    """Let the next default group be named as on a fresh process. torch names groups from a
    counter that it resets when the default group is destroyed; an ``init_process_group`` that
    failed (its store closed under it) has advanced it without creating a group, so this
    process would name its next world "1" where its peers say "0" and wait on other store
    keys than theirs until the collective timeout. Only while no default group exists."""
    from torch.distributed import distributed_c10d

    if not distributed_c10d.is_initialized():
        distributed_c10d._world.group_count = 0


def fake_tensor_mode() -> Any:
    """A mode in which tensors have shapes, dtypes, devices and autograd flags but no data:
    the runtime sizes stage boundaries with it. Unlike the meta device, fake tensors keep their
    device, so autocast applies to them and the dtypes come out as in training."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# ---------------------------------------------------------------- what each release can do

def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch imported here: 2.15.0+cu132 -> (2, 15)."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def nccl_means_nccl2() -> bool:
    """Whether the backend name ``nccl`` builds torch's nccl2 (``ProcessGroupNCCL2``, on the
    torchcomms engine) rather than the classic ``ProcessGroupNCCL``: the default from 2.15
    (``TORCH_DIST_USE_NCCL2=0`` goes back), opt-in in 2.14 (``TORCH_DIST_USE_NCCL2=1``), absent
    before. torch reads the variable once, when a process first makes a group named ``nccl``
    (it registers the backend then); set it before that, as torch requires."""
    release = torch_release()
    flag = os.environ.get("TORCH_DIST_USE_NCCL2")
    if release >= (2, 15):
        return flag != "0"
    return release >= (2, 14) and flag == "1"


def split_group_on_cpu() -> bool:
    """Whether ``dist.split_group`` can split a gloo world with no accelerator bound: from
    2.15 (2.14.1 raises "No device associated with the default pg" on CPU)."""
    return torch_release() >= (2, 15)



#: the private, experimental reconfiguration API of torch.distributed (2.14+)
RECONFIGURE_API: tuple[str, ...] = ("_supports_reconfigure", "_get_reconfigure_handle",
                                    "_reconfigure")


@functools.cache
def supports_reconfigure() -> bool:
    """Whether this torch can re-form a gloo process group over new members in place
    (``init_process_group(..., enable_reconfigure=True)``, then ``dist._reconfigure``): 2.14+,
    absent in 2.13. Asked of torch itself, not of the release number, since the names are
    private and experimental: the functions exist and a gloo group made in that regime (one
    rank, an in-memory store, nothing connected) says it supports them.
    benchmarks/reconfigure.py measures what it does after a lost peer (docs/runtime.md,
    *Reconfiguration*): the runtime does not use it."""
    from datetime import timedelta

    import torch.distributed as dist

    if not all(hasattr(dist, name) for name in RECONFIGURE_API):
        return False
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5),
                                      enable_reconfigure=True)
        return bool(group.supports_reconfigure)
    except (AttributeError, RuntimeError, TypeError):
        return False
