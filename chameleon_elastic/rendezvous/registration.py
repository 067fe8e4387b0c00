"""``etcd-v3`` in torch's rendezvous handler registry (torchrun and chameleon-run).

Two ways in, one creator:

- the ``torchrun.handlers`` entry point (declared in pyproject.toml) names
  :func:`create_etcd_v3_handler`. torch's registry calls an entry point with *no argument* and
  registers what it returns, so called without ``params`` the function returns itself; called
  with ``params`` it builds the handler. ``torchrun --rdzv-backend etcd-v3`` works with no code.
- :func:`register` adds the same creator explicitly (idempotent), for programs such as
  chameleon-run that want it regardless of entry-point discovery.

This module is imported by torch whenever ``torch.distributed.elastic.rendezvous`` is imported,
so it imports nothing heavy (gRPC, pyetcd) until a handler is actually created.

``--rdzv-conf`` keys understood here (besides torch's ``join_timeout``, ``last_call_timeout``,
``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``):
``cacert``, ``cert``, ``key``, ``user``, ``password``, ``key_prefix``, ``lease_ttl``,
``rpc_timeout``, ``retry_timeout``, ``connect_timeout`` (see ``config.EtcdSettings``) and
``read_timeout`` (store get/wait timeout in seconds, default 60, as for c10d).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )

__all__ = ["BACKEND_NAME", "create_etcd_v3_handler", "register"]

BACKEND_NAME = "etcd-v3"
_DEFAULT_READ_TIMEOUT_S = 60


@overload
def create_etcd_v3_handler(params: None = None) -> Callable[..., RendezvousHandler]: ...
@overload
def create_etcd_v3_handler(params: RendezvousParameters) -> RendezvousHandler: ...
def create_etcd_v3_handler(
    params: RendezvousParameters | None = None,
) -> RendezvousHandler | Callable[..., RendezvousHandler]:
    """Build the rendezvous handler (torch's dynamic one, see ``handler.py``) for ``params``.

    Without ``params`` (torch's entry-point protocol) return this creator itself.
    """
    if params is None:
        return create_etcd_v3_handler

    from chameleon_elastic.rendezvous.backend import EtcdV3RendezvousBackend
    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings
    from chameleon_elastic.rendezvous.errors import EtcdConfigError
    from chameleon_elastic.rendezvous.handler import build_handler
    from chameleon_elastic.rendezvous.store import EtcdStore

    settings = EtcdSettings.from_config(params.endpoint, params.config)
    run_prefix = settings.run_prefix(params.run_id)
    read_timeout = params.get_as_int("read_timeout", _DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise EtcdConfigError(
            f"--rdzv-conf read_timeout={read_timeout} must be a positive whole number of "
            "seconds (how long store reads wait for a key)."
        )
    client = EtcdClient(settings)
    try:
        backend = EtcdV3RendezvousBackend(client, run_prefix)
        store = EtcdStore(client, run_prefix, timeout=timedelta(seconds=read_timeout))
        return build_handler(store, backend, params)
    except BaseException:
        client.close()
        raise


def register() -> None:
    """Add ``etcd-v3`` to torch's rendezvous handler registry (safe to call many times)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, create_etcd_v3_handler)
