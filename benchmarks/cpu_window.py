"""Which processes and threads held the CPU in a window of a benchmark, from ``/proc``.

A thread in the parent samples, every ``period`` seconds, the CPU time of each tracked process
(``/proc/PID/stat``: all its threads) and, for processes tracked with ``threads=True``, each
thread's run time and run-queue wait (``/proc/PID/task/TID/schedstat``, nanoseconds), plus the
whole machine's busy time (``/proc/stat``). ``window(t0, t1)`` interpolates the samples at two
``time.monotonic()`` moments (one clock for every process of the machine), so a window reported
by a child process can be accounted afterwards. Sampling threads costs CPU itself (a few
hundred files per sample): the benchmark asks for it only with ``--cpu-profile``.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Iterable

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def _machine_busy() -> float:
    """CPU seconds every process of the machine has used (all cores), from ``/proc/stat``."""
    with open("/proc/stat", "rb") as f:
        cpu = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in cpu[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _threads(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's (run time, run-queue wait) in seconds."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def _comm(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class CpuSampler:
    """Samples ``/proc`` on its own thread until ``stop``; see the module docstring."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.procs: dict[str, int] = {}        # name -> pid
        self.threaded: set[str] = set()        # names whose threads are sampled too
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []   # key -> cumulative seconds
        self.comms: dict[int, str] = {}        # thread id -> its name (``comm``)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpu-sampler")
        self._lock = threading.Lock()

    def track(self, name: str, pid: int, threads: bool = False) -> None:
        with self._lock:
            self.procs[name] = pid
            if threads:
                self.threaded.add(name)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                procs, threaded = dict(self.procs), set(self.threaded)
            # a process or thread that ended keeps its last value (its CPU stops growing)
            sample = dict(self.samples[-1]) if self.samples else {}
            sample["machine"] = _machine_busy()
            for name, pid in procs.items():
                cpu = _proc_cpu(pid)
                if cpu is not None:
                    sample[name] = cpu
                if name in threaded:
                    for tid, (run, wait) in _threads(pid).items():
                        if tid not in self.comms:
                            self.comms[tid] = _comm(pid, tid)
                        sample[f"{name}/{tid}/run"], sample[f"{name}/{tid}/wait"] = run, wait
            self.times.append(time.monotonic())
            self.samples.append(sample)

    def _at(self, key: str, t: float) -> float:
        """A key's cumulative value at ``t``, linear between the samples around it (a key not
        yet seen counts from 0 at its first sample)."""
        i = bisect.bisect_left(self.times, t)
        i = min(max(i, 1), len(self.times) - 1)
        (ta, a), (tb, b) = ((self.times[j], self.samples[j].get(key)) for j in (i - 1, i))
        if a is None and b is None:
            return 0.0
        a = b if a is None else a
        b = a if b is None else b
        return a + (b - a) * min(1.0, max(0.0, (t - ta) / max(tb - ta, 1e-9)))

    def window(self, t0: float, t1: float,
               group: Callable[[str], str | None] = lambda k: k) -> dict[str, float]:
        """CPU seconds (and, for threads, run-queue wait seconds) in ``[t0, t1]``, summed by
        ``group(key)`` (None: left out)."""
        if len(self.times) < 2:
            return {}
        keys: Iterable[str] = {k for s in self.samples for k in s}
        out: dict[str, float] = {}
        for key in keys:
            name = group(key)
            if name is not None:
                out[name] = out.get(name, 0.0) + self._at(key, t1) - self._at(key, t0)
        return out
