"""Unblocking a training loop stuck in a transfer when the agents have moved on.

Gloo cannot abort a collective. When a peer dies its sockets reset and every transfer with it
fails at once; but a peer that is *stopped* (SIGSTOP, a frozen node, a partition) keeps its
sockets open, and a survivor blocked on it would wait for the full collective timeout even
after the agents have agreed on a new generation without that peer. So each worker runs a
:class:`Watchdog` thread: it polls the node's channel for a newer generation and, when one
appears while the current generation's groups are still in use, makes them fail from the side
(``DeviceBackend.unblock``: for gloo a ``shutdown`` of the groups' connected sockets, after
which the blocked receive returns "Connection closed by peer" at once, exactly as if the peer
had died, and the ordinary recovery follows; NCCL aborts its communicators). Only sockets
created while our groups were being formed are touched, never one the process opened for
other purposes.

Which sockets those are is recorded when the groups are created (:func:`new_sockets` around
``init_process_group`` and ``new_group``) and kept per group in a weak table, so the record
disappears with the group. The watchdog is disarmed before the groups are destroyed, so it can
never touch a file descriptor that was closed and reused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator

__all__ = ["GroupSockets", "Watchdog", "new_sockets", "socket_fds"]

log = logging.getLogger("chameleon_elastic.runtime.abort")

#: process group -> the sockets this process opened while forming it
GroupSockets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def socket_fds() -> frozenset[int]:
    """This process's open socket file descriptors (Linux /proc; empty elsewhere)."""
    out = set()
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for entry in entries:
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith("socket:"):
                out.add(int(entry))
        except OSError:
            continue
    return frozenset(out)


@contextlib.contextmanager
def new_sockets() -> Iterator[set[int]]:
    """Collect the sockets opened inside the block (groups being formed)."""
    found: set[int] = set()
    before = socket_fds()
    try:
        yield found
    finally:
        found.update(socket_fds() - before)


class Watchdog:
    """Polls ``newer()`` every ``interval_s``; while armed, a newer generation calls
    ``unblock()`` once and disarms."""

    def __init__(self, newer: Callable[[int], bool], unblock: Callable[[frozenset[int]], None],
                 interval_s: float = 0.2) -> None:
        self._newer = newer
        self._unblock = unblock
        self._interval = interval_s
        self._lock = threading.Lock()
        self._armed: tuple[int, frozenset[int]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chameleon-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, generation: int, sockets: frozenset[int]) -> None:
        with self._lock:
            self._armed = (generation, sockets)

    def disarm(self) -> None:
        """Before the groups are destroyed: from now on their fds may be reused."""
        with self._lock:
            self._armed = None

    def stop(self) -> None:
        self._stop.set()
        self.disarm()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                armed = self._armed
                if armed is None:
                    continue
                try:
                    newer = self._newer(armed[0])
                except Exception as exc:  # noqa: BLE001 - the agent is gone: PDEATHSIG follows
                    log.debug("watchdog cannot read the channel: %s", exc)
                    continue
                if newer:
                    log.info("generation %d is superseded: unblocking its groups", armed[0])
                    self._unblock(armed[1])
                    self._armed = None
