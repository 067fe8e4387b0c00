"""What a node says while it waits for the others to join the job's first rendezvous.

torch's rendezvous blocks silently until ``--nnodes`` (min) nodes have joined or the join timeout
(10 minutes by default) passes, so a node started alone, with a typo in ``--rdzv-id`` or the
endpoint, looked hung. A background thread watches the wait: after a short grace it prints one
line naming the endpoint, the run id and how many nodes are still awaited, and then renews that
figure on the status line as it changes or every ``renew_s``. The thread only reads; the
rendezvous itself is untouched.

Before that wait comes the connection to the rendezvous store, which can block too: a node
started before the node that hosts its c10d store waits inside torch's C++ ``TCPStore``, which
retries until its read timeout (60 s a try, two tries), and a C++ call keeps Python's Ctrl-C
handler from running until it returns. So the connection is made in a helper thread while the
main thread waits in slices, interruptible, and says what it waits for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from chameleon_elastic import torch_compat

from ..observe import StatusLine

__all__ = ["RendezvousWait", "connect_interruptibly"]

T = TypeVar("T")


class RendezvousWait:
    """``with RendezvousWait(handler, params, status): handler.next_rendezvous()``."""

    def __init__(self, handler: Any, params: Any, status: StatusLine, *,
                 grace_s: float = 3.0, renew_s: float = 10.0, poll_s: float = 0.5) -> None:
        self._handler = handler
        self._params = params
        self._status = status
        self._grace_s = grace_s
        self._renew_s = renew_s
        self._poll_s = poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rendezvous-wait", daemon=True)

    def __enter__(self) -> RendezvousWait:  # noqa: PYI034 - a final class
        if self._params.min_nodes > 1:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._poll_s)

    def message(self, joined: int, waited_s: float) -> str:
        """``waiting for 1 more node at 127.0.0.1:2379 (0:30 so far); start the other node
        with the same --rdzv-id job1 and --rdzv-endpoint``."""
        missing = max(self._params.min_nodes - max(joined, 1), 1)
        nodes = "node" if missing == 1 else "nodes"
        minutes, seconds = divmod(int(waited_s), 60)
        other = "the other node" if missing == 1 else f"the other {missing} nodes"
        return (f"waiting for {missing} more {nodes} at {self._params.endpoint or 'the endpoint'}"
                f" ({minutes}:{seconds:02d} so far); start {other} with the same --rdzv-id "
                f"{self._params.run_id} and --rdzv-endpoint")

    def _watch(self) -> None:
        began = time.monotonic()
        if self._done.wait(self._grace_s):
            return
        said: tuple[int, int] | None = None
        while not self._done.is_set():
            waited = time.monotonic() - began
            joined = torch_compat.rendezvous_participants(self._handler) or 0
            now = (joined, int(waited // self._renew_s))
            if said is None:
                self._status.say(f"chameleon-run: {self.message(joined, waited)}")
            elif now != said:
                self._status.update(state=self.message(joined, waited))
            said = now
            self._done.wait(self._poll_s)


def connect_interruptibly(connect: Callable[[], T], endpoint: str, status: StatusLine, *,
                          grace_s: float = 3.0, renew_s: float = 10.0,
                          poll_s: float = 0.25) -> T:
    """``connect()`` in a daemon thread; its result, or its exception raised here. Ctrl-C ends
    the wait at once (the thread is left to the interpreter's exit); after ``grace_s`` one line
    says what the node waits for, renewed on the status line every ``renew_s``."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = connect()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="rendezvous-connect", daemon=True)
    thread.start()
    began, said = time.monotonic(), -1
    while thread.is_alive():
        thread.join(poll_s)
        waited = time.monotonic() - began
        if thread.is_alive() and waited >= grace_s and int(waited // renew_s) != said:
            text = _connecting(endpoint, waited)
            if said < 0:
                status.say(f"chameleon-run: {text}")
            else:
                status.update(state=text)
            said = int(waited // renew_s)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _connecting(endpoint: str, waited_s: float) -> str:
    """``connecting to the rendezvous store at 10.0.0.1:29400 (0:03 so far); ...``."""
    minutes, seconds = divmod(int(waited_s), 60)
    return (f"connecting to the rendezvous store at {endpoint} ({minutes}:{seconds:02d} so "
            "far); the node at that address hosts it: start that node, or check --rdzv-endpoint")
