"""The run's state directory (plans, the event log, profiles, workers' stderr): where it is,
and whether it outlives the run.

A directory given with ``--state-dir`` is the user's: it is kept, always. Without the flag, a
job (or ``--profile-out``) gets a new ``chameleon-run-<date>-<time>-<random>`` directory in the
temporary directory, named on the launcher's first line, and chameleon-run cleans up after
itself: the directory is removed when the run leaves nothing in it that a person would read,

- the run ended before any worker started (a bad job file, Ctrl-C while waiting for nodes);
- or the run succeeded, its event log records no failure, recovery, membership change or
  rendezvous failover, and every worker's stderr log is empty.

Anything else keeps it, and the last line names what is there: a failed or preempted run, a
recovery, a warning a worker printed. (Every run used to leave one: 78 of them on a machine
tried for an afternoon.)
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["StateDir"]

#: events that make a successful run's directory worth reading
_NOTEWORTHY = frozenset({"failure_seen", "recovered", "planning_failed", "membership_change",
                         "rendezvous_failover"})


class StateDir:
    def __init__(self, path: Path, made: bool) -> None:
        self.path = path
        self.made = made   # by us, in the temporary directory: ours to remove

    @classmethod
    def open(cls, given: str | None, needed: bool) -> StateDir | None:
        """The ``--state-dir`` given, else a new temporary one when ``needed``, else None."""
        if given is not None:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, made=False)
        if not needed:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(Path(tempfile.mkdtemp(prefix=f"chameleon-run-{stamp}-")), made=True)

    def worth_keeping(self, succeeded: bool, records: Iterable[dict[str, Any]]) -> bool:
        records = list(records)
        started = any(r.get("event") == "workers_started" for r in records)
        if not started:
            return False
        if not succeeded or any(r.get("event") in _NOTEWORTHY for r in records):
            return True
        logs = self.path / "logs"
        return logs.is_dir() and any(f.stat().st_size for f in logs.iterdir() if f.is_file())

    def close(self, succeeded: bool, records: Iterable[dict[str, Any]]) -> bool:
        """Remove the directory if it is ours and holds nothing worth reading; True if it went."""
        if not self.made or self.worth_keeping(succeeded, records):
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        return True
