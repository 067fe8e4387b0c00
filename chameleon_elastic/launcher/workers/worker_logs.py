"""Where workers' stderr goes under ``--job``: one file per worker process, not the console.

Why: when a device is lost, its peers' collectives fail, and a plain script's survivors print
tracebacks (gloo "Connection reset by peer", torch's SIGTERM warnings) that make a handled
failure look like a crash. The launcher says what happened in one recovery line; the details
stay in the files, which that line and the failure sentence name. stdout, where training
reports progress, still goes to the console untouched (no tee, no prefixes), as with torchrun.

Why not torch's ``DefaultLogsSpecs``: it names files by local rank under an attempt directory
that it *empties* on every launch with the same restart count. chameleon-run starts single
replacement workers in place at an unchanged restart count, which would wipe the survivors'
logs. Here every process gets its own files, ``<dir>/device<D>.<n>.stderr.log`` and
``.error.json`` (torch's error file), ``n`` counting that device's processes; nothing is
overwritten.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

__all__ = ["WorkerLogs", "WorkersFailed", "tail"]

_ERROR = ".error.json"
_STDERR = ".stderr.log"


class WorkerLogs(LogsSpecs):
    """stderr and torch's error file per worker process, in one flat directory."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir=str(log_dir))
        self._dir = log_dir

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
