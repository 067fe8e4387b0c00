"""The worker processes an agent runs, by device, across launches.

torch's process context stops every worker as soon as one fails (``PContext.wait`` closes the
whole group): right for a relaunch, wrong for in-place recovery, where the survivors must keep
running while the dead one is replaced. So the agent starts workers with torch's
``start_processes`` (log redirection, tee, error files and the exec guard all unchanged), one
context per launch, and polls each process itself: a dead worker is only *forgotten*, the others
run on, and a later launch can add workers for devices that have none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerState
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from chameleon_elastic import channel
from chameleon_elastic.channel import Registration
from chameleon_elastic.torch_compat import worker_process

from .orphan_guard import guarded_command
from .worker_logs import ConsoleEcho, WorkerLogs

__all__ = ["Exit", "ExitBell", "WorkerProcesses", "stop_signal"]

#: what a person sends to end a run: the agent stops the workers, it does not pass it on
_INTERRUPTIONS = (signal.SIGINT, signal.SIGHUP)


def stop_signal(received: signal.Signals, planned: bool) -> signal.Signals:
    """The signal that stops the workers when the agent received ``received``. torch's agent
    passes a Ctrl-C (SIGINT) or a hang-up on to its workers, so every worker of a job wrote a
    ``KeyboardInterrupt`` traceback into its stderr log, and gloo's threads, torn down by an
    unwinding interpreter, ``terminate called without an active exception``: a whole
    directory of tracebacks for an end the person asked for. With a job (``planned``) the
    workers are stopped as every other stop stops them, with SIGTERM: Python's default ends the
    process at once, silently; a script that wants a last word catches SIGTERM (a preemption
    is chameleon-run's way to stop with a checkpoint). Without a job, torchrun's behaviour."""
    if planned and received in _INTERRUPTIONS:
        return signal.SIGTERM
    return received


class ExitBell:
    """Rings when a child process ends (SIGCHLD), so that the monitor loop polls a killed
    worker at once instead of at its next tick (up to ``--monitor-interval``, 0.1 s, later).
    Installed only in the main thread, where Python runs signal handlers; elsewhere the loop
    simply ticks. System calls interrupted by the signal restart (``siginterrupt``), so no
    library in the agent sees an EINTR it did not expect.

    The handler only writes a byte to a non-blocking pipe that ``wait`` selects on. It must
    take no lock: Python runs a handler between two bytecodes of the main thread, and when an
    ``Event.set`` in the handler met the main thread inside that same Event's ``wait`` or
    ``clear`` (which hold its non-reentrant lock), the agent deadlocked with a zombie worker
    (seen once in CI: a two-node job whose agent never noticed its worker succeed)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous: Any = None

    def __enter__(self) -> ExitBell:  # noqa: PYI034 (Self: Python 3.11)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGCHLD, self._ring)
            signal.siginterrupt(signal.SIGCHLD, False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGCHLD, self._previous)
            self._previous = None
        os.close(self._read)
        os.close(self._write)

    def _ring(self, signum: int, frame: Any) -> None:
        with contextlib.suppress(BlockingIOError):   # full: it has rung already
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> None:
        """Until a child ends or ``timeout`` passes."""
        if select.select([self._read], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 4096):
                    pass


@dataclass(frozen=True)
class Exit:
    device: int
    local_rank: int
    exitcode: int
    failure: ProcessFailure | None  # torch's record (error file) for a non-zero exit
    worker: Any                     # torch's Worker: its ranks when it ended
    stderr: str = ""                # the file its stderr went to ("": the console)


@dataclass
class _Live:
    context: PContext
    local_rank: int
    worker: Any  # torch's Worker (ranks as started)


class WorkerProcesses:
    def __init__(self) -> None:
        self._contexts: list[PContext] = []
        self._live: dict[int, _Live] = {}
        self.succeeded: set[int] = set()   # devices whose worker exited 0
        self._echo: ConsoleEcho | None = None   # rank 0's stderr on the console (--job)

    def start(self, spec: Any, todo: list[tuple[int, Any]], envs: dict, args: dict,
              prefixes: dict | None, logs_specs: Any, start_method: str) -> None:
        """Start one process per ``(device, torch Worker)`` of ``todo`` with torch's
        ``start_processes`` (log redirection, tee, error files unchanged); a script is started
        through ``orphan_guard``, so that it dies with the agent, even on SIGKILL."""
        entrypoint = spec.entrypoint
        if isinstance(entrypoint, str):
            wrapped = {i: guarded_command(entrypoint, a) for i, a in args.items()}
            entrypoint = next(iter(wrapped.values()))[0] if wrapped else entrypoint
            args = {i: w[1] for i, w in wrapped.items()}
        if isinstance(logs_specs, WorkerLogs):
            self._echo = logs_specs.echo
        context = start_processes(
            name=spec.role, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
            log_line_prefixes=prefixes, start_method=start_method,
            numa_options=spec.numa_options,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
        )
        pids = context.pids()
        for index, (_, worker) in enumerate(todo):
            worker.id = pids[index]
        self.add(context, dict(enumerate(todo)))

    def add(self, context: PContext, started: dict[int, tuple[int, Any]]) -> None:
        """``started``: local rank in ``context`` -> (device, torch Worker)."""
        self._contexts.append(context)
        for local_rank, (device, worker) in started.items():
            self._live[device] = _Live(context, local_rank, worker)

    @property
    def devices(self) -> set[int]:
        return set(self._live)

    def pid(self, device: int) -> int:
        live = self._live[device]
        return live.context.pids()[live.local_rank]

    def pids(self) -> dict[int, int]:
        return {d: self.pid(d) for d in self._live}

    def registered(self, store: Any) -> bool:
        """Every live worker has told the agent's channel it runs on the runtime (so it can
        recover in place); False with no worker or no channel."""
        if store is None or not self._live:
            return False
        for device in self._live:
            record = channel.read(store, channel.worker_key(device))
            if record is None or Registration.from_dict(record).pid != self.pid(device):
                return False
        if self._echo is not None:   # runtime workers speak through the recovery line
            self._echo.silence()
        return True

    def renumber(self, ranks: Callable[[int], tuple[int, int, int] | None]) -> None:
        """Kept workers' places in a new generation: ``ranks(card)`` gives (local rank,
        global rank, world size), or None for a worker outside it (a standby keeps its
        label)."""
        for device, live in self._live.items():
            place = ranks(device)
            if place is None:
                continue
            local, rank, size = place
            worker = Worker(local_rank=local, global_rank=rank, role_rank=rank,
                            world_size=size, role_world_size=size)
            worker.id = self.pid(device)
            live.worker = worker
        if self._echo is not None:   # what was written while the generation changed
            self._echo.skip()

    def workers(self) -> list[Any]:
        return [live.worker for _, live in sorted(self._live.items())]

    def poll(self) -> list[Exit]:
        """Workers that ended since the last poll (now forgotten), in device order. Rank 0's
        stderr, looked at first, reaches the console unless a worker failed meanwhile."""
        if self._echo is not None:
            self._echo.look()
        ended = []
        for device, live in sorted(self._live.items()):
            proc = worker_process(live.context, live.local_rank)
            code = proc.poll()
            if code is None:
                continue
            failure = None
            if code != 0:
                failure = ProcessFailure(local_rank=live.local_rank, pid=proc.pid,
                                         exitcode=code,
                                         error_file=live.context.error_files[live.local_rank])
            else:
                self.succeeded.add(device)
            ended.append(Exit(device, live.local_rank, code, failure, live.worker,
                              live.context.stderrs.get(live.local_rank, "")))
        for e in ended:
            del self._live[e.device]
        if self._echo is not None:
            if any(e.exitcode != 0 for e in ended):
                self._echo.skip()
            else:
                self._echo.release(whole=not self._live)
        return ended

    def run_result(self, group_workers: list[Worker]) -> tuple[RunResult, dict[int, Exit]]:
        """One poll as torch's agent sees it: every worker polled on its own, so a failure stops
        nobody (torch's process context would stop them all). Returns the result and the
        failed workers by global rank (``group_workers``: torch's, for a success's keys)."""
        failed = {e.worker.global_rank: e for e in self.poll() if e.failure is not None}
        if failed:
            return RunResult(state=WorkerState.FAILED, failures={
                rank: e.failure for rank, e in failed.items()}), failed
        if not self.devices:
            return RunResult(state=WorkerState.SUCCEEDED, return_values={
                w.global_rank: None for w in group_workers}), failed
        return RunResult(state=WorkerState.HEALTHY), failed

    def signal_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every live worker; safe from another thread (nothing is forgotten:
        the monitor loop reaps them)."""
        for live in list(self._live.values()):
            proc = worker_process(live.context, live.local_rank)
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, devices: set[int]) -> None:
        """SIGKILL and forget the workers of ``devices`` (devices that failed a health check:
        lost already, so their exits are not news)."""
        for device in sorted(devices & self.devices):
            live = self._live.pop(device)
            proc = worker_process(live.context, live.local_rank)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop every worker (torch's SIGTERM, then SIGKILL after ``timeout``). A stop we
        decided is no warning: torch's per-process "Sending process ... closing signal" lines
        are silenced (its report of a worker that ignored SIGTERM is an error and still shows)."""
        api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        level = api_log.level
        api_log.setLevel(logging.ERROR)
        try:
            for context in self._contexts:
                context.close(death_sig, int(timeout))
        finally:
            api_log.setLevel(level)
        self._contexts.clear()
        self._live.clear()
        self.succeeded.clear()
        if self._echo is not None:   # the stopped workers' last words stay in their files
            self._echo.skip()
