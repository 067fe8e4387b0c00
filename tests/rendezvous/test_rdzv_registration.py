"""etcd-v3 in torch's registry: entry point, register(), two handlers forming a group."""

from __future__ import annotations

import threading

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.errors import EtcdConfigError
from chameleon_elastic.rendezvous.registration import create_etcd_v3_handler, register
from chameleon_elastic.rendezvous.store import EtcdStore

pytestmark = pytest.mark.timeout(60)

CONF = {"join_timeout": "30", "last_call_timeout": "1", "close_timeout": "5",
        "retry_timeout": "20", "read_timeout": "20"}


def test_entry_point_protocol_and_idempotent_register() -> None:
    assert create_etcd_v3_handler() is create_etcd_v3_handler  # torch calls it with no args
    register()
    register()
    assert rendezvous_handler_registry._registry["etcd-v3"] is create_etcd_v3_handler


def test_two_handlers_form_a_group(etcd_server) -> None:
    register()
    params = [
        RendezvousParameters("etcd-v3", etcd_server.endpoint, "reg-job", 2, 2, **CONF)
        for _ in range(2)
    ]
    handlers = [get_rendezvous_handler(p) for p in params]
    assert all(isinstance(h, DynamicRendezvousHandler) for h in handlers)
    assert handlers[0].get_backend() == "etcd-v3"
    # workers bootstrap from a per-round store, not torch's reused agent store (see handler.py)
    assert not handlers[0].use_agent_store
    results: list[object] = [None, None]

    def join(i: int) -> None:
        results[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert all(r is not None for r in results)
    assert sorted(r.rank for r in results) == [0, 1]  # type: ignore[attr-defined]
    assert {r.world_size for r in results} == {2}  # type: ignore[attr-defined]
    infos = {(r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port)
             for r in results}  # type: ignore[attr-defined]
    assert len(infos) == 1  # both agents learnt rank 0's store address through etcd
    # a second round: rank 0 publishes the address again under that round's keys
    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    again = {(r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port)
             for r in results}  # type: ignore[attr-defined]
    assert len(again) == 1
    settings = EtcdSettings.from_config(etcd_server.endpoint)
    with EtcdClient(settings) as client:
        store = EtcdStore(client, settings.run_prefix("reg-job"))
        round_ = handlers[0]._state_holder.state.round
        assert round_ >= 1
        published = store.get(f"torch.rendezvous.reg-job.{round_}/MASTER_PORT")
        assert int(published) == next(iter(again))[1]
    for h in handlers:
        h.shutdown()
    assert handlers[0].is_closed()


def test_bad_conf_is_reported_before_connecting() -> None:
    params = RendezvousParameters("etcd-v3", "127.0.0.1:1", "job", 1, 1, lease_ttl="x")
    with pytest.raises(EtcdConfigError, match="lease_ttl"):
        create_etcd_v3_handler(params)
