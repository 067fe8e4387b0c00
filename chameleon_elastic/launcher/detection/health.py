"""Device health checks: the second way (besides a signal death) a device is declared lost.

The agent asks its health check about each local device once per monitor interval. A device that
fails the check is lost: its worker is stopped and the planner re-plans without it. A device
excluded *by the health check* rejoins once the check passes again (the planner is told it
joined). A device lost to a signal death stays excluded for the rest of the run: on CPU there is
no hardware to probe, so nothing could vouch for it.

``FileHealthCheck`` is a FAKE for CPU machines and tests, labelled as such: a text file lists the
device ids that are "marked bad", one per line (``#`` starts a comment). A missing file means
every device is healthy. Real back-ends (cuda / npu) would query the device instead.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Protocol

__all__ = ["AlwaysHealthy", "FileHealthCheck", "HealthCheck"]


class HealthCheck(Protocol):
    def unhealthy(self, devices: Collection[int]) -> frozenset[int]:
        """The subset of ``devices`` that fails the check now."""
        ...


class AlwaysHealthy:
    """The default: only signal deaths mark a device as lost."""

    def unhealthy(self, devices: Collection[int]) -> frozenset[int]:
        return frozenset()


class FileHealthCheck:
    """FAKE health check (CPU / tests): devices listed in ``path`` are marked bad."""

    label = "fake: file-based device-marked-bad hook"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def marked_bad(self) -> frozenset[int]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return frozenset()
        bad: set[int] = set()
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    bad.add(int(line))
                except ValueError:
                    continue  # a half-written line; read again next interval
        return frozenset(bad)

    def unhealthy(self, devices: Collection[int]) -> frozenset[int]:
        return self.marked_bad() & frozenset(devices)
