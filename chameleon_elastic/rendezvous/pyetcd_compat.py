"""Every use of pyetcd (etcd-sdk-python) internals, in one place.

Checked against etcd-sdk-python 0.0.7 (``pip show etcd-sdk-python``). pyetcd has no stable
API beyond its public methods, so whatever this package needs from its insides lives here,
with the reason, and ``tests/rendezvous/test_rdzv_pyetcd_compat.py`` fails at once if an upgrade
removes or changes it. Everything else in this package uses pyetcd's public API only
(``get``/``put``/``transaction``/``lease``/watch methods, the ``kvstub``/``leasestub``/
``maintenancestub`` properties, the public attributes ``channel``/``endpoints``/
``endpoint_in_use``/``timeout``/``metadata``/``call_credentials``, ``Endpoint.fail``/
``is_failed``, ``pyetcd.utils``, the generated ``pyetcd.etcdrpc`` messages, and for the watch
callbacks' contract ``pyetcd.watch.WatchResponse`` and ``pyetcd.events.new_event``).
Watches do not use pyetcd's ``Watcher``: it creates one watch at a time per stream and wakes
every waiting caller on each creation (``watch_stream.py`` says why that mattered).

What is used, and why:

- ``MultiEndpointEtcd3Client._manage_grpc_errors(exc)`` (private method, overridden by
  :class:`Etcd3Client`): pyetcd's wrapped methods mark the endpoint in use failed and drop the
  client's stubs on *every* UNAVAILABLE, "etcdserver: leader changed" included, which is the
  whole cluster changing its leader, not that member failing. On a client shared by threads
  (an agent's keep-alive and watch; the scale benchmark's agents) each such error moved the
  client to another healthy member, and with every member marked failed in turn the
  attempts ended in "no endpoint available" without reaching etcd until the retry deadline
  (issue 48). The override re-raises the gRPC error untouched: which failures move to another
  member is decided once, by ``client.classify``.
- ``MultiEndpointEtcd3Client._stubs`` (private dict): pyetcd caches one gRPC stub per
  service bound to the channel of the endpoint it first used, and only re-picks an endpoint
  when its private label changes; our watch stream is cached there beside them. After we mark
  an endpoint failed (``Endpoint.fail``, public) the cached stubs would still talk to the dead
  member. :func:`drop_cached_stubs` empties the cache, so the next stub access evaluates
  ``client.channel``, which skips failed endpoints. Unlike pyetcd's ``_clear_old_stubs`` it
  does not half-close the watch stream: the watches on it go on (a dead member ends them with
  an error, which their callbacks handle) and each is cancelled on its own stream
  (:func:`add_watch`).
- the text of ``Endpoint.use()``'s ``ValueError`` ("Trying to use a failed node"): pyetcd
  raises a bare ``ValueError`` when every attempt lands on an endpoint still marked failed;
  the text is the only way to tell it (transient: retry) from a genuine ``ValueError``.

Why :func:`add_watch` returns its own cancel: etcd numbers watches per stream, from 0. A
cancel sent to the client's *current* stream (pyetcd's ``client.cancel_watch(id)``), after a
fail-over, cancelled whichever watch had the same number on the new one (another waiter's, on
a shared client) and left the old one running (measured: after one fail-over, the cancel of
watch 0 on key A silenced watch 0 on key B).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import utils as etcd_utils

from chameleon_elastic.rendezvous.watch_stream import WatchStream

__all__ = [
    "CHECKED_VERSION",
    "FAILED_NODE_TEXT",
    "OVERRIDDEN_CLIENT_METHODS",
    "PRIVATE_CLIENT_ATTRIBUTES",
    "Etcd3Client",
    "add_watch",
    "drop_cached_stubs",
    "is_failed_node_error",
]

#: the etcd-sdk-python release these internals were read from
CHECKED_VERSION = "0.0.7"

#: private methods of ``pyetcd.MultiEndpointEtcd3Client`` that :class:`Etcd3Client` overrides,
#: with the parameters pyetcd calls them with (for the test)
OVERRIDDEN_CLIENT_METHODS: dict[str, tuple[str, ...]] = {"_manage_grpc_errors": ("self", "exc")}

#: private attributes of a ``pyetcd.MultiEndpointEtcd3Client`` this module reads (for the test)
PRIVATE_CLIENT_ATTRIBUTES: tuple[str, ...] = ("_stubs",)

#: the key of a client's :class:`WatchStream` in its stub cache, dropped with its stubs
_STREAM = "chameleon_watch_stream"

#: part of the message of the ``ValueError`` pyetcd's ``Endpoint.use()`` raises
FAILED_NODE_TEXT = "failed node"


class Etcd3Client(pyetcd.MultiEndpointEtcd3Client):
    """pyetcd's multi-endpoint client without its own fail-over (see the module docstring):
    a gRPC error of a wrapped method reaches the caller as it came, and ``client.call``
    decides whether to move to another member."""

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> None:
        raise exc

    def close(self) -> None:
        """End our watch stream before the channels close (its watches' callbacks get
        ``None``, not a cancelled call's error), as pyetcd closes its own watcher first."""
        stream = self._stubs.get(_STREAM)
        if stream is not None:
            stream.close()
        super().close()


def drop_cached_stubs(client: Any) -> None:
    """Forget ``client``'s cached gRPC stubs and watcher (see the module docstring), so the
    next request picks a channel again and skips endpoints marked failed; the old watch stream
    is left to its watches."""
    client._stubs.clear()


class _WatchHandle:
    """Cancels one watch on the watcher (stream) that holds it."""

    def __init__(self, watcher: Any, watch_id: int) -> None:
        self._watcher, self.watch_id = watcher, watch_id

    def cancel(self) -> None:
        self._watcher.cancel(self.watch_id)


def add_watch(client: Any, key: str, callback: Callable[[Any], None], *, prefix: bool = False,
              start_revision: int | None = None) -> _WatchHandle:
    """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``; ``callback``
    gets each response, or the error that ended the stream. Returns the handle that cancels it
    on its own stream (see the module docstring). Raises pyetcd's ``WatchTimedOut`` when etcd
    did not confirm the watch within the client's timeout, or the stream's gRPC error."""
    extra: dict[str, Any] = {}
    if prefix:
        extra["range_end"] = etcd_utils.prefix_range_end(etcd_utils.to_bytes(key))
    stream = client._stubs.get(_STREAM)
    if stream is None or stream.ended:   # a broken stream's watches were told; start anew
        stream = client._stubs[_STREAM] = WatchStream(client)
    create = etcdrpc.WatchCreateRequest(key=etcd_utils.to_bytes(key),
                                        start_revision=start_revision or 0, **extra)
    return _WatchHandle(stream, stream.add(create, callback))


def is_failed_node_error(exc: BaseException) -> bool:
    """True for pyetcd's "Trying to use a failed node" (every tried endpoint marked failed)."""
    return isinstance(exc, ValueError) and FAILED_NODE_TEXT in str(exc)
