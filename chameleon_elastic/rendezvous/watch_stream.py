"""One etcd watch stream per client, its watches created without waiting on each other.

pyetcd's ``Watcher`` creates one watch at a time per stream: a caller waits for the previous
creation's answer before sending its own, and every answer wakes every waiting caller
(``Condition.notify_all``). With one agent per client that is a round trip per watch. With
many threads on one client (an agent's node watch and store waits; the scale benchmark's
thousands of simulated agents, 256 per client at 16384 nodes) the creations queue one round
trip apart and each answer wakes them all: n^2 / 2 wake-ups per n creations, each one taking
the interpreter lock (issue 48: the hosts spent their round in the kernel, waking threads).

etcd answers a stream's create requests in the order it received them (its server handles a
stream's requests one after the other and queues the "created" answers in that order; etcd's
own Go client relies on it), so the creations here are pipelined: each caller queues its
request and a waiting slot in one step under the lock, the stream's thread hands each
"created" answer to the oldest slot, and only that caller wakes.

The callbacks' contract is pyetcd's, so that the watchers above (``NodeLiveness``,
``EtcdStore.wait``) are unchanged: a callback gets a ``pyetcd.watch.WatchResponse`` (its
``header`` and pyetcd's ``PutEvent``/``DeleteEvent``s) per answer, and the error that ended
the stream (a ``grpc.RpcError``, or ``None`` when it was closed) once, at its end.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exceptions
from pyetcd.watch import WatchResponse

__all__ = ["WatchStream"]

log = logging.getLogger("chameleon_elastic.rendezvous.watch_stream")

Callback = Callable[[Any], None]


class _Creation:
    """One caller waiting for its watch's "created" answer."""

    __slots__ = ("abandoned", "callback", "done", "error", "watch_id")

    def __init__(self, callback: Callback) -> None:
        self.callback = callback
        self.done = threading.Event()
        self.watch_id: int | None = None
        self.error: BaseException | None = None
        self.abandoned = False   # its caller timed out: cancel the watch once created


class WatchStream:
    """The watches of one client on one gRPC Watch stream, opened on the first watch."""

    def __init__(self, client: Any) -> None:
        self._stub = etcdrpc.WatchStub(client.channel)
        self._credentials, self._metadata = client.call_credentials, client.metadata
        self._timeout = client.timeout
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._creations: deque[_Creation] = deque()
        self._callbacks: dict[int, Callback] = {}
        self._ended: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._call: Any = None      # the gRPC call, to cancel at close
        self._closing = False

    @property
    def ended(self) -> bool:
        """The stream ended (closed, or etcd broke it): a new watch needs a new stream."""
        return self._ended is not None

    def add(self, create: Any, callback: Callback) -> int:
        """Send ``create`` (a ``WatchCreateRequest``) and return the new watch's id once etcd
        confirms it. Raises pyetcd's ``WatchTimedOut`` past the client's timeout, the
        ``RevisionCompactedError`` of a start revision etcd no longer has, or the error that
        ended the stream."""
        creation = _Creation(callback)
        with self._lock:
            if self._ended is not None:
                raise self._ended
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"etcd-watch-{id(self):x}")
                self._thread.start()
            self._creations.append(creation)   # in the order etcd receives the requests
            self._requests.put(etcdrpc.WatchRequest(create_request=create))
        if not creation.done.wait(self._timeout):
            with self._lock:
                if not creation.done.is_set():
                    creation.abandoned = True
                    raise etcd_exceptions.WatchTimedOut()
        if creation.error is not None:
            raise creation.error
        assert creation.watch_id is not None
        return creation.watch_id

    def cancel(self, watch_id: int) -> None:
        """Stop ``watch_id``'s events (a watch cancelled twice, or after the stream ended, is
        left as it is)."""
        with self._lock:
            if self._callbacks.pop(watch_id, None) is not None:
                self._cancel(watch_id)

    def close(self) -> None:
        """End the stream (its watches' callbacks get ``None``). etcd keeps a stream the
        client half-closed open while it holds watches, so the call is cancelled."""
        with self._lock:
            self._closing = True
            call = self._call
        self._requests.put(None)
        if call is not None:
            call.cancel()

    def _cancel(self, watch_id: int) -> None:
        cancel = etcdrpc.WatchCancelRequest(watch_id=watch_id)
        self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            answers = self._stub.Watch(iter(self._requests.get, None),
                                       credentials=self._credentials, metadata=self._metadata)
            with self._lock:
                self._call = answers
                closing = self._closing
            if closing:
                answers.cancel()
            for answer in answers:
                self._answer(answer)
        except grpc.RpcError as exc:
            error = None if self._closing else exc
        finally:
            self._end(error)

    def _answer(self, answer: Any) -> None:
        with self._lock:
            if answer.created:
                self._created(answer)
                if answer.compact_revision or answer.canceled:
                    return
            callback = self._callbacks.get(answer.watch_id)
            if callback is not None and (answer.canceled or answer.compact_revision):
                del self._callbacks[answer.watch_id]   # etcd ended this watch itself
        if callback is None:
            return
        if answer.compact_revision:
            _call(callback, etcd_exceptions.RevisionCompactedError(answer.compact_revision))
        elif answer.events or not (answer.created or answer.canceled):   # progress notices
            _call(callback, WatchResponse(answer.header,
                                          [etcd_events.new_event(e) for e in answer.events]))

    def _created(self, answer: Any) -> None:
        """Hand a "created" answer to the oldest creation (under the lock)."""
        if not self._creations:   # not ours: nothing was asked
            self._cancel(answer.watch_id)
            return
        creation = self._creations.popleft()
        if answer.compact_revision:
            creation.error = etcd_exceptions.RevisionCompactedError(answer.compact_revision)
        elif answer.canceled:
            creation.error = etcd_exceptions.Etcd3Exception(
                f"etcd refused the watch: {answer.cancel_reason or 'no reason given'}")
        elif creation.abandoned:
            self._cancel(answer.watch_id)
        else:
            creation.watch_id = answer.watch_id
            self._callbacks[answer.watch_id] = creation.callback
        creation.done.set()

    def _end(self, error: BaseException | None) -> None:
        with self._lock:
            self._ended = error if error is not None else etcd_exceptions.Etcd3Exception(
                "the etcd watch stream was closed")
            creations, self._creations = list(self._creations), deque()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for creation in creations:
            creation.error = self._ended
            creation.done.set()
        for callback in callbacks:
            _call(callback, error)


def _call(callback: Callback, what: Any) -> None:
    """A callback's failure is logged, never the stream's end (as pyetcd does)."""
    try:
        callback(what)
    except Exception:
        log.exception("an etcd watch callback failed")
