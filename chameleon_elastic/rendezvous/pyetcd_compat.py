"""Every use of pyetcd (etcd-sdk-python) internals, in one place.

Checked against etcd-sdk-python 0.0.7 (``pip show etcd-sdk-python``). pyetcd has no stable
API beyond its public methods, so whatever this package needs from its insides lives here,
with the reason, and ``tests/rendezvous/test_rdzv_pyetcd_compat.py`` fails at once if an upgrade
removes or changes it. Everything else in this package uses pyetcd's public API only
(``get``/``put``/``transaction``/``lease``/watch methods, the ``kvstub``/``maintenancestub``
properties, the public attributes ``endpoints``/``endpoint_in_use``/``timeout``/``metadata``/
``call_credentials``, ``Endpoint.fail``, the generated ``pyetcd.etcdrpc`` messages).

What is used, and why:

- ``MultiEndpointEtcd3Client._clear_old_stubs()`` (private method): pyetcd caches one gRPC
  stub per service (and the watch stream) bound to the channel of the endpoint it first used,
  and only re-picks an endpoint when its private label changes. After we mark an endpoint
  failed (``Endpoint.fail``, public) the cached stubs would still talk to the dead member, so
  a direct stub call (the connect probe, the store's multi-key read) would never fail over.
  Clearing the cache makes the next stub access evaluate ``client.channel``, which skips
  failed endpoints. There is no public way to do this short of rebuilding the client (which
  would also re-authenticate).
- the text of ``Endpoint.use()``'s ``ValueError`` ("Trying to use a failed node"): pyetcd
  raises a bare ``ValueError`` when every attempt lands on an endpoint still marked failed;
  the text is the only way to tell it (transient: retry) from a genuine ``ValueError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CHECKED_VERSION",
    "FAILED_NODE_TEXT",
    "PRIVATE_CLIENT_METHODS",
    "drop_cached_stubs",
    "is_failed_node_error",
]

#: the etcd-sdk-python release these internals were read from
CHECKED_VERSION = "0.0.7"

#: private methods of ``pyetcd.MultiEndpointEtcd3Client`` this module calls (for the test)
PRIVATE_CLIENT_METHODS: tuple[str, ...] = ("_clear_old_stubs",)

#: part of the message of the ``ValueError`` pyetcd's ``Endpoint.use()`` raises
FAILED_NODE_TEXT = "failed node"


def drop_cached_stubs(client: Any) -> None:
    """Forget ``client``'s cached gRPC stubs and watch stream (see the module docstring), so
    the next request picks a channel again and skips endpoints marked failed."""
    client._clear_old_stubs()


def is_failed_node_error(exc: BaseException) -> bool:
    """True for pyetcd's "Trying to use a failed node" (every tried endpoint marked failed)."""
    return isinstance(exc, ValueError) and FAILED_NODE_TEXT in str(exc)
