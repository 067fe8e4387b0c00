"""Exception types of the etcd rendezvous layer.

Every error raised by this package derives from :class:`EtcdRendezvousError`, itself a
``torch.distributed.elastic`` ``RendezvousError`` so torch's agents treat it like their own
backends' errors. Messages are one paragraph naming the problem and the fix; backend (gRPC,
pyetcd) exceptions are chained with ``raise ... from exc``.
"""

from __future__ import annotations

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
)

__all__ = [
    "EtcdAuthError",
    "EtcdConfigError",
    "EtcdConnectionError",
    "EtcdRendezvousError",
    "EtcdServerError",
    "EtcdStoreTimeoutError",
    "rendezvous_message",
]


class EtcdRendezvousError(RendezvousError):
    """Base class of every error of the etcd v3 rendezvous layer."""


class EtcdConfigError(EtcdRendezvousError, ValueError):
    """A bad ``--rdzv-endpoint`` / ``--rdzv-conf`` value (syntax, missing or unreadable file)."""


class EtcdConnectionError(EtcdRendezvousError, RendezvousConnectionError):
    """No etcd endpoint answered within the retry deadline (or the TLS handshake failed)."""


class EtcdAuthError(EtcdRendezvousError):
    """etcd rejected the user name / password, or the user lacks permission on the prefix."""


class EtcdServerError(EtcdRendezvousError):
    """The local development etcd server could not be started."""


class EtcdStoreTimeoutError(EtcdRendezvousError, DistStoreError):
    """A store ``get``/``wait`` did not see its keys before the store timeout.

    It is a ``torch.distributed.DistStoreError`` like a ``TCPStore`` timeout, so code written
    against torch's stores catches it unchanged.
    """


def rendezvous_message(exc: BaseException) -> str | None:
    """The message of the first error of this package in ``exc``'s chain, else None.

    Command-line tools print it as their one paragraph instead of a traceback. The chain is
    followed because torch may wrap a backend error in its own ``RendezvousError``.
    """
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; a cycle must not loop forever
        if seen is None:
            return None
        if isinstance(seen, EtcdRendezvousError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None
