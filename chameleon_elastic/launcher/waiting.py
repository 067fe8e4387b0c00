"""What a node says while it waits for the others to join the job's first rendezvous.

torch's rendezvous blocks silently until ``--nnodes`` (min) nodes have joined or the join timeout
(10 minutes by default) passes, so a node started alone, with a typo in ``--rdzv-id`` or the
endpoint, looked hung. A background thread watches the wait: after a short grace it prints one
line naming the endpoint, the run id and how many nodes are still awaited, and then renews that
figure on the status line as it changes or every ``renew_s``. The thread only reads; the
rendezvous itself is untouched.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

from chameleon_elastic import torch_compat

from .observe import StatusLine

__all__ = ["RendezvousWait"]


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
