"""Unblocking a training loop stuck in a transfer when the agents have moved on.

Gloo cannot abort a collective. When a peer dies its sockets reset and every transfer with it
fails at once; but a peer that is *stopped* (SIGSTOP, a frozen node, a partition) keeps its
sockets open, and a survivor blocked on it would wait for the full collective timeout even
after the agents have agreed on a new generation without that peer. So each worker runs a
:class:`Watchdog` thread: its agent wakes it when it publishes a newer generation (the
channel's ``wake/<card>`` queue) and, if the current generation's groups are still in use, the
watchdog makes them fail from the side
(``DeviceBackend.unblock``: for gloo a ``shutdown`` of the groups' connected sockets, after
which the blocked receive returns "Connection closed by peer" at once, exactly as if the peer
had died, and the ordinary recovery follows; NCCL aborts its communicators). Only sockets
created while our groups were being formed are touched, never one the process opened for
other purposes.

Which sockets those are is recorded when the groups are created (:func:`new_sockets` around
``init_process_group`` and ``new_group``), each as its descriptor *and* the socket it named
then (``socket:[inode]``): a descriptor closed with its group is soon handed to another socket
(the next generation's store client, a new group's pair), and a shutdown by number alone would
cut that one instead; it did, and the new generation's store connection hung. So
:func:`shut_down` touches a descriptor only while it still names the recorded socket.

How the cut is made matters, because of a gap in torch 2.13's gloo (transport/tcp/pair.cc):
a collective's send that fails with EPIPE or ECONNRESET is queued on the pair without an
error, and is never failed when the pair then closes (``signalException`` fails the queued
sends of bound buffers only, not of the unbound ones collectives use). The collective then
waits for its own timeout (120 s), and the training thread with it (a sharded layer's
``wait_tensor`` has none). A send fails that way when it is written after our side stopped
writing (``SHUT_WR``) or after the peer's socket was closed, but before gloo's event loop
saw the cut: our side's ``SHUT_WR`` makes our next write fail at once, and a peer's ``close``
(or, Linux, data arriving at a socket shut down both ways) resets the connection under its
writes. Under load, where the loop thread is late, a ``SHUT_RDWR`` cut hit it: a sharded
backward's all-reduce waited out the timeout (py-spy: ``UnboundBuffer::waitSend`` inside gloo's
ring), and so did 17 of 84 simultaneous cuts of a busy all-reduce by two ranks (0 of 152 as
below; tests/runtime/test_abort.py). So :func:`shut_down` cuts the reading half only, on a
duplicate of each socket that it keeps for ``_LINGER_S``: gloo's loop reads end-of-file and
fails the pair (every later send of ours raises, none is queued), our writes still succeed
until then, and gloo's own ``close`` of its descriptor neither ends nor resets the connection
under the peer, whose writes succeed until its own loop fails its pair (its agent published
the same generation). A peer no longer learns of the cut from us, only from its own watchdog:
that cost nothing, since every survivor waits for the published generation anyway.

A peer that *dies* resets its sockets itself, and a send written in the moment before our
loop sees that is still queued for good: only the agent's hang rules reach that worker
(launcher/detection/detectors.py, ``HangWatch``: asleep in the previous plan generation).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch.distributed as dist

__all__ = ["Freeing", "GroupSockets", "Sockets", "Watchdog", "free_later", "new_sockets",
           "open_sockets", "shut_down", "world_sockets"]

log = logging.getLogger("chameleon_elastic.runtime.world.abort")

#: sockets as (descriptor, ``socket:[inode]``) pairs: a number alone may have been reused
Sockets = frozenset[tuple[int, str]]

#: process group -> the sockets this process opened while forming it
GroupSockets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sockets() -> dict[int, str]:
    """This process's open socket descriptors -> their sockets (``socket:[inode]``; Linux
    /proc, empty elsewhere)."""
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    named = {int(entry): _names(int(entry)) for entry in entries}
    return {fd: target for fd, target in named.items() if target and target.startswith("socket:")}


def open_sockets() -> Sockets:
    """Every socket this process has open now, as (descriptor, ``socket:[inode]``) pairs."""
    return frozenset(_sockets().items())


@contextlib.contextmanager
def new_sockets() -> Iterator[set[tuple[int, str]]]:
    """Collect the sockets opened inside the block (groups being formed): by socket, not by
    descriptor number, since an old group freed meanwhile may hand its number to a new one."""
    found: set[tuple[int, str]] = set()
    before = _sockets()
    try:
        yield found
    finally:
        found.update((fd, sock) for fd, sock in _sockets().items() if before.get(fd) != sock)


def world_sockets() -> Sockets:
    """The sockets of this process's default group (none when it has none)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return frozenset() if world is None else GroupSockets.get(world, frozenset())


#: how long a cut keeps its sockets: the peers' loops fail their pairs within milliseconds of
#: their own watchdog's cut; closing ours before could reset a send of theirs
_LINGER_S = 30.0
#: seconds a closing worker waits for the groups being freed in the background
FREE_WAIT_S = 5.0


def shut_down(sockets: Sockets) -> None:
    """Fail every connected socket of ``sockets`` that its descriptor still names, so a
    transfer blocked on it returns "Connection closed by peer" now, as if the peer had died:
    ``SHUT_RD`` on a duplicate kept ``_LINGER_S`` (the module's docstring says why). The
    descriptors stay open for gloo to close; a listening socket is left alone (gloo's event
    loop aborts the process if it is shut down under it)."""
    kept = []
    for fd, recorded in sockets:
        try:
            copy = os.dup(fd)
        except OSError:
            continue   # closed since
        if _names(copy) != recorded:   # closed, and the number given to another file since
            os.close(copy)
            continue
        sock = socket.socket(fileno=copy)
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RD)
                kept.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    if kept:
        closer = threading.Timer(_LINGER_S, _close_all, args=(kept,))
        closer.daemon = True
        closer.start()


def _names(fd: int) -> str | None:
    """What descriptor ``fd`` names now (``socket:[inode]``), None when it cannot be read."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def free_later(groups: list[object]) -> threading.Thread:
    """Free process groups on a thread of their own: it empties ``groups``, which must hold
    their last references (take them out of torch's books first). A gloo group's destructor
    waits for its device loop, which wakes every 10 ms, twice: 20-30 ms per group with the
    GIL released, measured, and a survivor's recovery (bucket groups, the world) need not
    wait for it. Their sockets are cut already, so nothing of ours waits for it either. The
    thread must be joined before the process ends (:class:`Freeing`): a daemon thread still
    inside a group's destructor as the interpreter finalises cannot take the GIL back, and
    the process dies by SIGABRT ("terminate called without an active exception")."""
    thread = threading.Thread(target=groups.clear, name="chameleon-free-groups", daemon=True)
    thread.start()
    return thread


class Freeing:
    """The threads freeing this process's groups in the background (:func:`free_later`),
    joined when the trainer closes, or at exit when a script ends without closing it, so
    that none is left inside a destructor as the interpreter finalises (40 groups freed so at
    exit: both ranks died by SIGABRT in 6 runs of 6; joined: none)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def later(self, groups: list[object]) -> None:
        if not self._threads:
            atexit.register(self.join)   # once while frees are under way; join unregisters
        self._threads = [t for t in self._threads if t.is_alive()] + [free_later(groups)]

    def join(self, timeout_s: float = FREE_WAIT_S) -> None:
        """Wait for the frees under way, at most ``timeout_s`` in all."""
        until = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, until - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        if not self._threads:
            atexit.unregister(self.join)


class Watchdog:
    """Waits on its own thread for its bell (``bell()``: blocks until rung, then clears it;
    ``ring()``); at each ring, while armed with a generation that ``newer(generation)`` says
    is superseded, sets :attr:`superseded` and calls ``unblock()`` once, and disarms. The
    agent rings the bell when it publishes a generation, so the survivors that were not
    blocked on the lost peer learn of it at once (a poll every 0.2 s cost them 0.1 s on
    average, up to 0.2 s, on every recovery). ``unblock`` reaches a loop that is waiting on
    a peer; :attr:`superseded` reaches one that is computing: the executor looks at it
    between operations, so a survivor of a data-parallel plan (whose only transfers are the
    step's gradient sums) gives the step up after its current operation rather than at the
    end of its backward, up to a whole step later. Arming rings the bell too, and clears
    :attr:`superseded`: a generation published while the watchdog was disarmed is caught
    then. Stopped before the process ends: a daemon thread caught inside a store call as the
    interpreter exits can hang it."""

    def __init__(self, bell: Callable[[], None], ring: Callable[[], None],
                 newer: Callable[[int], bool], unblock: Callable[[Sockets], None],
                 join_s: float = 5.0) -> None:
        self._bell = bell
        self._ring = ring
        self._newer = newer
        self._unblock = unblock
        self._join_s = join_s
        self._lock = threading.Lock()
        self._armed: tuple[int, Sockets | Callable[[], Sockets]] | None = None
        self._stopped = False
        #: set while the generation it was armed with is superseded (read without the lock)
        self.superseded = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chameleon-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)   # also when the script ends without closing its trainer

    def arm(self, generation: int, sockets: Sockets | Callable[[], Sockets]) -> None:
        """Watch for a generation newer than ``generation``; ``sockets``: what to unblock then
        (or what gives them then: a generation being entered still opens sockets)."""
        with self._lock:
            self._armed = (generation, sockets)
            self.superseded.clear()
        self._ring()

    def disarm(self) -> None:
        """Before the groups are destroyed: from now on their fds may be reused."""
        with self._lock:
            self._armed = None

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self.disarm()
        if self._stopped:
            return
        self._stopped = True
        try:
            self._ring()
        except RuntimeError as exc:   # the agent is gone, and the wait with it
            log.debug("watchdog cannot be woken to stop: %s", exc)
        self._thread.join(self._join_s)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self._bell()
            except dist.DistStoreError:   # a long wait's timeout: wait again
                continue
            except RuntimeError as exc:   # the agent is gone: PDEATHSIG follows
                log.debug("watchdog cannot read the channel: %s", exc)
                return
            with self._lock:
                armed = self._armed
                if armed is None or self._stopped:
                    continue
                try:
                    newer = self._newer(armed[0])
                except RuntimeError as exc:
                    log.debug("watchdog cannot read the channel: %s", exc)
                    return
                if newer:
                    log.info("generation %d is superseded: unblocking its groups", armed[0])
                    self.superseded.set()
                    self._unblock(armed[1]() if callable(armed[1]) else armed[1])
                    self._armed = None
