"""The run's state directory (plans, the event log, profiles, workers' stderr): where it is,
whether it outlives the run, and how many of them stay.

A directory given with ``--state-dir`` is the user's: it is kept, always, and never pruned.
Without the flag, a job (or ``--profile-out``) gets a new ``chameleon-run-<date>-<time>-<random>``
directory in the temporary directory, named on the launcher's first line, and chameleon-run
cleans up after itself. What a person reads is the workers' stderr: the recovery lines on the
console already said what the event log holds, for people. So the directory is **removed** at
the end when no worker wrote a byte to its stderr log and

- the run ended before any worker started (a bad job file, Ctrl-C while waiting for nodes);
- or it succeeded, recoveries and all (the recovery lines said what happened);
- or the person running it interrupted it (Ctrl-C, a hang-up): they asked for the end.

It is **kept**, and the last line names it and why, when a worker wrote to its stderr (a
warning, a traceback) or the run failed or was preempted. Kept directories are **bounded**:
as a new one is made, the oldest of those chameleon-run made in the same temporary directory
are removed beyond the newest :data:`KEEP` (``CHAMELEON_KEEP_STATE_DIRS``), except one a live
launcher still uses (each names its launcher in ``.launcher``: pid and start time). Directories
of older versions, which name no launcher, are left alone. (Every run with a recovery used to
keep one: 23 after an afternoon; before that every run did: 78.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import psutil

__all__ = ["KEEP", "Outcome", "StateDir", "kept_at_most", "prune"]

#: kept directories that chameleon-run made in the temporary directory, at most
KEEP = 10
KEEP_ENV = "CHAMELEON_KEEP_STATE_DIRS"
PREFIX = "chameleon-run-"
OWNER = ".launcher"

#: how a run ended, as far as its state directory cares
Outcome = Literal["succeeded", "interrupted", "failed"]


def _owner_alive(path: Path) -> bool | None:
    """Whether the launcher that made ``path`` still runs (None: the directory names none)."""
    try:
        pid, started = (path / OWNER).read_text().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 1.0
    except (OSError, ValueError):
        return None
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:   # not ours to look at: someone else's, maybe running
        return True


def prune(root: Path, keep: int, spare: Path | None = None) -> list[Path]:
    """Remove the oldest state directories chameleon-run made under ``root`` beyond the newest
    ``keep`` (``spare``: one that must stay, the new one), leaving alone any a live launcher
    uses or that names no launcher; returns those removed. Names sort by their time stamp."""
    made = sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p != spare),
                  key=lambda p: p.name, reverse=True)
    removed = []
    for path in made[max(0, keep - (spare is not None)):]:
        if _owner_alive(path) is False:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def kept_at_most() -> int:
    """:data:`KEEP`, or ``CHAMELEON_KEEP_STATE_DIRS`` when set (at least 1)."""
    try:
        return max(1, int(os.environ.get(KEEP_ENV, KEEP)))
    except ValueError:
        return KEEP


class StateDir:
    def __init__(self, path: Path, made: bool) -> None:
        self.path = path
        self.made = made   # by us, in the temporary directory: ours to remove

    @classmethod
    def open(cls, given: str | None, needed: bool) -> StateDir | None:
        """The ``--state-dir`` given, else a new temporary one when ``needed`` (the oldest
        kept ones beyond :data:`KEEP` removed), else None."""
        if given is not None:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, made=False)
        if not needed:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{stamp}-"))
        me = psutil.Process()
        (path / OWNER).write_text(f"{me.pid} {me.create_time()}\n")
        prune(path.parent, kept_at_most(), spare=path)
        return cls(path, made=True)

    def written(self) -> list[str]:
        """The workers' stderr logs that hold something (names, in the logs directory)."""
        logs = self.path / "logs"
        if not logs.is_dir():
            return []
        return sorted(f.name for f in logs.iterdir() if f.is_file() and f.stat().st_size)

    def keep_why(self, outcome: Outcome, records: Iterable[dict[str, Any]]) -> str | None:
        """Why the directory is worth keeping (a phrase for the last line), else None."""
        if not any(r.get("event") == "workers_started" for r in records):
            return None
        written = self.written()
        if written:
            more = f" and {len(written) - 3} more" if len(written) > 3 else ""
            return f"workers wrote to stderr (logs/{', logs/'.join(written[:3])}{more})"
        if outcome == "failed":
            return "the run did not succeed"
        return None

    def close(self, outcome: Outcome, records: Iterable[dict[str, Any]]) -> str | None:
        """Remove the directory if it is ours and holds nothing worth reading; None if it
        went, else why it stays (a directory given with ``--state-dir``: "given")."""
        if not self.made:
            return "given"
        why = self.keep_why(outcome, list(records))
        if why is None:
            shutil.rmtree(self.path, ignore_errors=True)
        return why
