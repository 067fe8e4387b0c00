"""etcd v3 rendezvous for torch elastic and chameleon-run (see docs/rendezvous.md).

Exports are resolved lazily: torch imports ``registration`` through the ``torchrun.handlers``
entry point every time ``torch.distributed.elastic.rendezvous`` is imported, and that must not
pull gRPC into every process that never uses etcd.
"""

from __future__ import annotations

import importlib
from typing import Any

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
