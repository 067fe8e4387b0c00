"""torch's ``DynamicRendezvousHandler``, with a workers' bootstrap store that is new every round;
chameleon-run uses it for ``etcd-v3`` and for torch's own ``c10d`` backend alike.

Why a subclass: torch 2.13's default (``use_agent_store``) lets the group-rank-0 *agent* host
one ``TCPStore`` server for the workers, reused across rounds, and publishes its address only in
the first round it hosts. Workers scope their keys in it by ``TORCHELASTIC_RESTART_COUNT``,
which each agent counts on its own (a worker failure counts, a membership change does not).
In elastic runs that breaks in three ways:

- a node that joins a running group reads the address from the current round's keys, which
  rank 0 never wrote again: it waits until the store timeout (seen with real agents);
- a re-joined node has a different restart count from the survivors: its workers read stale
  gloo addresses of an old attempt from the reused server (``connectFullMesh ... Connection
  refused``; seen with real agents once the address was republished);
- the rank-0 agent dies: agents that cached its address would hand a dead address to their
  workers (from reading torch's code; the test that kills group rank 0 passes with this class).

This handler uses torch's other, supported mode instead (what the environment switch
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` selects, but per handler, so that the launcher need not
set it in an environment its workers inherit): ``use_agent_store`` is False, group rank 0
picks a free port in *every* round and publishes ``MASTER_ADDR``/``MASTER_PORT`` in that
round's keys of the etcd store, every agent reads them again, and the rank-0 worker hosts a
fresh ``TCPStore`` for that round only. No store outlives its round, so no key of an old
attempt can be read. Everything the *agents* share (rendezvous state, rank assignment, exit
barrier) is in etcd.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from chameleon_elastic.rendezvous.errors import EtcdConfigError

__all__ = ["FreshStoreRendezvousHandler", "build_handler", "handler_for"]


@dataclass(frozen=True)
class _ReservedPort:
    """Stands in for torch's agent-hosted TCPStore server: only its ``port`` is read."""

    port: int


class FreshStoreRendezvousHandler(DynamicRendezvousHandler):
    """``DynamicRendezvousHandler`` whose workers bootstrap from a fresh store every round."""

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        # Forget last round's address so rank 0 publishes a new one and the others read it.
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()

    def _create_tcp_store_server(self, master_addr: str | None, master_port: int) -> Any:
        # torch calls this on group rank 0 only; the rank-0 worker will listen on the port.
        return _ReservedPort(get_free_port())


def _seconds(params: RendezvousParameters, key: str) -> timedelta | None:
    try:
        value = params.get_as_int(key)
    except ValueError as exc:
        raise EtcdConfigError(
            f"--rdzv-conf {key} must be a whole number of seconds, e.g. {key}=30."
        ) from exc
    if value is None:
        return None
    if value <= 0:
        raise EtcdConfigError(f"--rdzv-conf {key}={value} must be a positive number of seconds.")
    return timedelta(seconds=value)


def build_handler(
    store: Store, backend: RendezvousBackend, params: RendezvousParameters
) -> FreshStoreRendezvousHandler:
    """Like torch's ``dynamic_rendezvous.create_handler``, same ``--rdzv-conf`` keys."""
    timeout = RendezvousTimeout(
        _seconds(params, "join_timeout"),
        _seconds(params, "last_call_timeout"),
        _seconds(params, "close_timeout"),
        _seconds(params, "heartbeat_timeout"),
    )
    interval = _seconds(params, "keep_alive_interval") or timedelta(seconds=5)
    attempts = params.get_as_int("keep_alive_max_attempt", 3)
    if attempts is None or attempts < 1:
        raise EtcdConfigError(
            f"--rdzv-conf keep_alive_max_attempt={attempts} must be a whole number >= 1."
        )
    return FreshStoreRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=int(interval.total_seconds()),
        keep_alive_max_attempt=attempts,
    )


def handler_for(params: RendezvousParameters) -> RendezvousHandler:
    """The handler chameleon-run's agent uses: torch's registry, except that ``c10d`` gets this
    module's handler on torch's c10d backend (the same store, a fresh bootstrap per round)."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if params.backend != "c10d":
        return get_rendezvous_handler(params)
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    return build_handler(store, backend, params)
