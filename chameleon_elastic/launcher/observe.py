"""Observability: a JSONL event log for machines and a one-line live status for people.

Event log: one JSON object per line, appended and flushed as it happens, so a crashed launcher
still leaves everything up to the crash and ``tail -f`` works. Every record has ``ts`` (Unix
seconds), ``event`` (name), ``attempt`` (worker-group launch counter, 0 = first launch) and
``generation`` (plan generation); the rest depends on the event. The names and fields are listed
in docs/launcher.md.

Status line: rendered with ``rich`` in place on a terminal; when stderr is not a terminal (CI,
tests, ``2> file``) a plain line is written each time the status changes, never more often.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EventLog", "StatusLine"]


class EventLog:
    """Append-only JSONL log; ``path=None`` keeps records in memory only (``records``)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        with self._lock:
            self.records.append(record)
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()
        return record

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class StatusLine:
    """``gen 2 | policy replan | live 3/4 | restarts 1/3 | running``."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.fields: dict[str, Any] = {}
        self._last = ""
        self._live = None
        if enabled and self.stream.isatty():
            try:
                from rich.console import Console
                from rich.live import Live

                self._live = Live("", console=Console(file=self.stream), transient=False,
                                  auto_refresh=False)
                self._live.start()
            except (ImportError, OSError):  # rich missing or no usable terminal
                self._live = None

    def render(self) -> str:
        f = self.fields
        parts = [f"chameleon-run gen {f.get('generation', 0)}"]
        if "policy" in f:
            parts.append(f"policy {f['policy']}")
        if "live" in f:
            parts.append(f"live {f['live']}/{f.get('devices', '?')}")
        parts.append(f"restarts {f.get('restarts', 0)}/{f.get('max_restarts', 0)}")
        if "state" in f:
            parts.append(str(f["state"]))
        return " | ".join(parts)

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)
        if not self.enabled:
            return
        text = self.render()
        if text == self._last:
            return
        self._last = text
        if self._live is not None:
            self._live.update(text, refresh=True)
        else:
            self.stream.write(f"[{text}]\n")
            self.stream.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
