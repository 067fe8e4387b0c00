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
agent's members changed its signature within that range. What differs between the releases is
what their process-group backends can do, answered here by release (:func:`torch_release`) for
runtime/world/groups.py to decide with, and how torch groups the aborts of a world's NCCL
communicators, the one per-version branch (:func:`abort_communicators`; plugins/cuda.py leaves a
world that lost a peer with it and :func:`forget_process_groups`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "AGENT_HOOKS",
    "PRIVATE_ATTRIBUTES",
    "RECONFIGURE_API",
    "RENDEZVOUS_SETTINGS_HOLDERS",
    "WorkerProcess",
    "abort_communicators",
    "addr_and_port",
    "entrypoint_name",
    "fake_tensor_mode",
    "forget_failed_group_names",
    "forget_process_groups",
    "has_nccl",
    "nccl_means_nccl2",
    "nccl_options",
    "process_groups",
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


# ---------------------------------------------------------------- leaving a broken NCCL world

def process_groups() -> list[Any]:
    """Every process group in torch's books, the default one included, in the order torch
    aborts and shuts them down in (by name, the newest first). Read from any thread: the books
    are copied first (one C-level copy), since the training thread may be adding a group."""
    from torch.distributed import distributed_c10d

    names = dict(distributed_c10d._world.pg_names)
    return sorted(names, key=lambda group: names[group], reverse=True)


def has_nccl(group: Any) -> bool:
    """Whether ``group`` (in torch's books) has an NCCL part: ``nccl``, ``nccl2`` or
    ``nccl-legacy``, alone or in a compound backend such as ``cpu:gloo,cuda:nccl``."""
    import torch.distributed as dist

    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):   # not in torch's books (any more)
        return False


def abort_communicators(groups: list[Any]) -> list[str]:
    """Abort the communicators of ``groups`` all at once, as torch's ``_abort_process_group``
    aborts a whole world: the newest group first, inside one NCCL group call (2.13, 2.14: the
    leading group's ``_group_start`` / ``_group_end``) or one coalescing region (2.15:
    ``_coalescing_manager``), because communicators aborted one by one can deadlock each other
    (pytorch#119797). Unlike torch's, it leaves the groups in torch's books: a side thread
    calls it while the training thread may still be inside a step, and that thread must meet
    an aborted communicator (a ``DistBackendError``: a lost peer, recovered in place), not a
    group torch no longer knows (a ``ValueError``: a crash). :func:`forget_process_groups`
    takes them out afterwards, on the training thread. Returns one line per group whose abort
    failed (it raised; nccl2 raises when the abort itself times out); never raises."""
    failed: list[str] = []
    if not groups:
        return failed
    with _abort_region(groups):
        for group in groups:
            try:
                group.abort()
            except RuntimeError as exc:
                failed.append(f"{getattr(group, 'group_name', group)}: {exc}")
    return failed


@contextlib.contextmanager
def _abort_region(groups: list[Any]) -> Iterator[None]:
    """The region torch aborts a world's communicators in, led by the default group when it is
    among ``groups`` (else the last of them): a coalescing region from torch 2.15, the classic
    backend's NCCL group call before (the leader's ``_group_start`` / ``_group_end``). The 2.14
    form is taken to be 2.13's (not verified: no 2.14 source here)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    leader = dist.group.WORLD if dist.group.WORLD in groups else groups[-1]
    if torch_release() >= (2, 15):
        device = torch.accelerator.current_accelerator() or torch.device("cpu")
        try:
            backend = leader._get_backend(device)
        except RuntimeError:
            backend = None
        distributed_c10d._world.pg_coalesce_state.pop(leader, None)
        coalescing = device if getattr(backend, "supports_coalescing", False) else None
        with distributed_c10d._coalescing_manager(leader, coalescing):
            yield
        return
    try:
        backend = leader._get_backend(torch.device("cuda"))
    except RuntimeError:
        backend = None
    grouped = dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL)
    if grouped:
        backend._group_start()
    try:
        yield
    finally:
        if grouped:
            backend._group_end()


def forget_process_groups() -> list[Any]:
    """Take every process group out of torch's books without shutting any down, and return
    them for the caller to free (a group's destructor can wait: the classic backend's joins its
    watchdog thread). After an abort, ``destroy_process_group`` would shut communicators down
    that cannot finish (nccl2's shutdown waits for the pending work; after an abortive shrink,
    NCCL >= 2.31 hangs destroying the parent), and torch's ``_abort_process_group`` would abort
    them a second time. Leaves what ``_abort_process_group`` leaves: no default group, and
    torch's group counter at 0."""
    from torch.distributed import distributed_c10d

    groups = process_groups()
    for group in groups:
        distributed_c10d._cleanup_process_group_global_state(group)
    distributed_c10d._update_default_pg(None)
    distributed_c10d._world.group_count = 0
    return groups


def nccl_options(nonblocking: bool) -> Any | None:
    """Options for the NCCL part of a group (``ProcessGroupNCCL.Options``, which nccl2 takes
    too in 2.15; 2.14's nccl2 not verified): a fresh object each call, since torch writes the
    group's name, ranks and timeout into the one it is given. ``nonblocking``: NCCL's
    non-blocking communicators (``config.blocking = 0``; both implementations read it before
    ``TORCH_NCCL_USE_COMM_NONBLOCKING``), else torch's default. None on a torch without NCCL."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    if nonblocking:
        options.config.blocking = 0
    return options


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
