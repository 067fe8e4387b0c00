"""etcd v3 rendezvous for torch elastic and chameleon-run (see docs/rendezvous.md).

Exports are resolved lazily: torch imports ``registration`` through the ``torchrun.handlers``
entry point every time ``torch.distributed.elastic.rendezvous`` is imported, and that must not
pull gRPC into every process that never uses etcd.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# This package only ever forks to exec (workers, etcd servers). gRPC's fork support installs
# pre-fork handlers that wait for gRPC's threads, and a fork() there blocked for good (a test
# fixture starting etcd after other tests' channels; no alarm can interrupt it). Off unless
# the user chose otherwise; it must be set before gRPC is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__ = [
    "EtcdAuthError",
    "EtcdClient",
    "EtcdConfigError",
    "EtcdConnectionError",
    "EtcdRendezvousError",
    "EtcdServerError",
    "EtcdSettings",
    "EtcdStore",
    "EtcdStoreTimeoutError",
    "EtcdV3RendezvousBackend",
    "FreshStoreRendezvousHandler",
    "LocalEtcd",
    "LocalEtcdCluster",
    "LocalEtcdTls",
    "NodeEvent",
    "NodeLiveness",
    "create_etcd_v3_handler",
    "list_nodes",
    "register",
]

_HOMES = {
    "EtcdAuthError": "errors",
    "EtcdConfigError": "errors",
    "EtcdConnectionError": "errors",
    "EtcdRendezvousError": "errors",
    "EtcdServerError": "errors",
    "EtcdStoreTimeoutError": "errors",
    "EtcdClient": "client",
    "EtcdSettings": "config",
    "EtcdStore": "store",
    "EtcdV3RendezvousBackend": "backend",
    "FreshStoreRendezvousHandler": "handler",
    "LocalEtcd": "local_etcd",
    "LocalEtcdCluster": "local_cluster",
    "LocalEtcdTls": "local_etcd",
    "list_nodes": "liveness",
    "NodeEvent": "liveness",
    "NodeLiveness": "liveness",
    "create_etcd_v3_handler": "registration",
    "register": "registration",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
