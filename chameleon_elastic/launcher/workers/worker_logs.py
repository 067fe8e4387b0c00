"""Where workers' stderr goes under ``--job``: one file per worker process, and rank 0's echoed.

Why files: when a device is lost, its peers' collectives fail, and a plain script's survivors
print tracebacks (gloo "Connection reset by peer", torch's SIGTERM warnings) that make a handled
failure look like a crash. The launcher says what happened in one recovery line; the details
stay in the files, which that line and the failure sentence name. stdout, where training
reports progress, still goes to the console untouched (no tee, no prefixes), as with torchrun.

Why an echo: a framework's own messages and progress bars (Lightning, HF Trainer, accelerate
and tqdm write to stderr) vanished from the terminal. So the stderr of global rank 0 is copied
to the launcher's stderr as it grows (:class:`ConsoleEcho`, bytes as written, progress bars'
carriage returns too), but only up to what was written before the agent's last look found
every worker alive: what a worker writes after a peer died, or while a recovery runs, stays in
its file. The copy lags the file by one monitor interval (0.1 s by default). A worker on the
runtime is not echoed once it has registered: it recovers in place, alive, and its complaints
about a lost peer would come while every process lives.

Why not torch's ``DefaultLogsSpecs``: it names files by local rank under an attempt directory
that it *empties* on every launch with the same restart count. chameleon-run starts single
replacement workers in place at an unchanged restart count, which would wipe the survivors'
logs. Here every process gets its own files, ``<dir>/device<D>.<n>.stderr.log`` and
``.error.json`` (torch's error file), ``n`` counting that device's processes; nothing is
overwritten.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

__all__ = ["ConsoleEcho", "WorkerLogs", "WorkersFailed", "tail"]

_ERROR = ".error.json"
_STDERR = ".stderr.log"


class ConsoleEcho:
    """One worker's stderr file copied to the console up to what was written while every
    worker was alive. :meth:`look` before the agent polls its workers, :meth:`release` when
    none had failed, :meth:`skip` when one had, or when a transition begins or ends: what was
    written since the look is then never shown."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self._out = out
        self._path: Path | None = None
        self._shown = 0       # bytes of the file copied or skipped
        self._seen = 0        # its size at the last look
        self._silent = False  # its worker runs on the runtime: its stderr stays in the file

    def follow(self, path: str | Path) -> None:
        """Echo this file from now on (a new rank 0's), from its start."""
        self._path, self._shown, self._seen, self._silent = Path(path), 0, 0, False

    def silence(self) -> None:
        """The worker runs on the runtime, which recovers in place and says what it does
        through the agent's recovery line: its stderr (a lost peer's complaints while it
        recovers, while it is alive) stays in its file from now on."""
        self.skip()
        self._silent = True

    def _size(self) -> int:
        try:
            return os.path.getsize(self._path) if self._path is not None else 0
        except OSError:
            return self._shown

    def look(self) -> None:
        self._seen = self._size()

    def release(self, whole: bool = False) -> None:
        """Copy what was written up to the last look (``whole``: up to now: the workers have
        ended)."""
        end = self._size() if whole else self._seen
        if self._path is None or self._silent or end <= self._shown:
            return
        try:
            with open(self._path, "rb") as fh:
                fh.seek(self._shown)
                data = fh.read(end - self._shown)
        except OSError:
            return
        out = self._out if self._out is not None else sys.stderr.buffer
        out.write(data)
        out.flush()
        self._shown += len(data)

    def skip(self) -> None:
        """Never show what was written after the last released look."""
        self._shown = self._seen = max(self._shown, self._size())


class WorkerLogs(LogsSpecs):
    """stderr and torch's error file per worker process, in one flat directory; rank 0's
    echoed to the console (``echo``)."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir=str(log_dir))
        self._dir = log_dir
        self.echo = ConsoleEcho()

    @property
    def root_log_dir(self) -> str:
        return str(self._dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self._dir.mkdir(parents=True, exist_ok=True)
        stderrs, error_files = {}, {}
        for index, env in envs.items():
            device = env.get("CHAMELEON_DEVICE", env.get("RANK", str(index)))
            n = 0
            while (self._dir / f"device{device}.{n}{_STDERR}").exists():
                n += 1
            stem = self._dir / f"device{device}.{n}"
            stderr = Path(f"{stem}{_STDERR}")
            stderr.touch()   # claimed now: the next worker of this device takes n + 1
            stderrs[index] = str(stderr)
            if env.get("RANK") == "0":
                self.echo.follow(stderr)
            error_files[index] = f"{stem}{_ERROR}"
            env["TORCHELASTIC_ERROR_FILE"] = error_files[index]
        console = dict.fromkeys(envs, "")
        return LogsDest(stdouts=console, stderrs=stderrs, tee_stdouts={}, tee_stderrs={},
                        error_files=error_files)


class WorkersFailed(ChildFailedError):
    """torch's ``ChildFailedError`` (what ``torch.distributed.run.main`` raises), plus the file
    each failed worker's stderr went to, by global rank (None: the console), so that the one
    sentence chameleon-run prints can say where the traceback is."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure],
                 stderr_logs: dict[int, str | None]) -> None:
        super().__init__(name=name, failures=failures)
        self.stderr_logs = stderr_logs


def tail(path: str | Path, lines: int = 5, limit: int = 16384) -> list[str]:
    """Why a worker ended, from the end of its stderr file (its last ``limit`` bytes): the
    exception line(s) of its last Python traceback, or else its last non-blank ``lines`` (a
    script's own usage error). A person should not have to open the file to see why the job
    ended, nor read a traceback on the console. Empty when the file cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - limit))
            text = fh.read().decode(errors="replace")
    except OSError:
        return []
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(kept) if line.startswith("Traceback (most recent call")]
    if starts:
        after = kept[starts[-1] + 1:]
        last_frame = max((i for i, line in enumerate(after) if line.startswith(" ")), default=-1)
        raised = [line for line in after[last_frame + 1:] if not line.startswith(" ")]
        if raised:
            return raised[:lines]
    return kept[-lines:]
