"""Lease-based node liveness on a real etcd: joins, expiry, revoke, etcd restart."""

from __future__ import annotations

import json
import queue

import pytest

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.liveness import NodeEvent, NodeLiveness, list_nodes

pytestmark = pytest.mark.timeout(60)

TTL = 2
WAIT = 20.0  # generous deadline for events on a loaded machine (not a timing claim)


def _next(events: queue.Queue[NodeEvent], kind: str, node_id: str) -> NodeEvent:
    while True:
        event = events.get(timeout=WAIT)
        if event.kind == kind and event.node_id == node_id:
            return event


def test_join_is_seen_and_value_is_json(etcd_client, run_prefix) -> None:
    observer = NodeLiveness(etcd_client, run_prefix, "observer", register_self=False)
    node = NodeLiveness(etcd_client, run_prefix, "n1", {"node_rank": 1}, ttl=TTL)
    with observer, node:
        event = _next(observer.events, "joined", "n1")
        assert event.info == {"node_id": "n1", "node_rank": 1}
        value, _ = etcd_client.call("get", lambda c: c.get(node.key))
        assert json.loads(value) == {"node_id": "n1", "node_rank": 1}
        assert set(observer.members()) == {"n1"}


def test_silent_node_vanishes_by_lease_expiry(etcd_settings, etcd_client, run_prefix) -> None:
    seen: list[NodeEvent] = []
    with NodeLiveness(
        etcd_client, run_prefix, "survivor", ttl=TTL, on_event=seen.append
    ) as survivor, EtcdClient(etcd_settings) as other_client:
        doomed = NodeLiveness(other_client, run_prefix, "doomed", ttl=TTL).start()
        _next(survivor.events, "joined", "doomed")
        lease = doomed.lease_id
        doomed.stop(revoke=False)  # keep-alives stop as if the process had been SIGKILLed
        left = _next(survivor.events, "left", "doomed")
        assert left.info["node_id"] == "doomed"
        info = etcd_client.call("lease", lambda c: c.get_lease_info(lease))
        assert info.TTL == -1  # etcd expired the lease itself
        assert "doomed" not in survivor.members()
        assert [e.kind for e in seen if e.node_id == "doomed"] == ["joined", "left"]


def test_clean_stop_revokes_at_once(etcd_client, run_prefix) -> None:
    with NodeLiveness(etcd_client, run_prefix, "watcher", register_self=False) as watcher:
        node = NodeLiveness(etcd_client, run_prefix, "leaver", ttl=60).start()
        _next(watcher.events, "joined", "leaver")
        node.stop()  # ttl is 60 s: only the revoke can make this event arrive within WAIT
        _next(watcher.events, "left", "leaver")
    assert list_nodes(etcd_client, run_prefix)[0] == {}


def test_etcd_restart_keeps_live_nodes(etcd_server, etcd_client, run_prefix) -> None:
    with NodeLiveness(etcd_client, run_prefix, "a", ttl=TTL) as a, NodeLiveness(
        etcd_client, run_prefix, "b", ttl=TTL
    ) as b:
        _next(a.events, "joined", "b")
        etcd_server.restart()
        # a node joining after the restart is seen through the re-established watch
        with NodeLiveness(etcd_client, run_prefix, "c", ttl=TTL):
            _next(a.events, "joined", "c")
            assert set(b.members()) >= {"a", "b"}
        _next(a.events, "left", "c")
        drained = []
        while not a.events.empty():
            drained.append(a.events.get_nowait())
        assert not [e for e in drained if e.node_id in ("a", "b")]
        assert set(list_nodes(etcd_client, run_prefix)[0]) == {"a", "b"}


def test_bad_node_id(etcd_client, run_prefix) -> None:
    from chameleon_elastic.rendezvous.errors import EtcdConfigError

    with pytest.raises(EtcdConfigError, match="node id"):
        NodeLiveness(etcd_client, run_prefix, "a/b")
