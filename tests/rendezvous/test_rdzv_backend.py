"""RendezvousBackend contract on a real etcd: CAS semantics, fencing, one winner among racers."""

from __future__ import annotations

import threading

import pytest

from chameleon_elastic.rendezvous.backend import EtcdV3RendezvousBackend
from chameleon_elastic.rendezvous.client import EtcdClient

pytestmark = pytest.mark.timeout(60)


def test_empty_state_is_none(etcd_client, run_prefix) -> None:
    assert EtcdV3RendezvousBackend(etcd_client, run_prefix).get_state() is None


def test_first_write_without_token_creates(etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    state, token, ok = backend.set_state(b"one")
    assert ok and state == b"one"
    assert backend.get_state() == (b"one", token)
    # a second token-less write must not overwrite an existing state
    state2, token2, ok2 = backend.set_state(b"two")
    assert not ok2 and (state2, token2) == (b"one", token)


def test_token_is_the_fencing_revision(etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    _, token, _ = backend.set_state(b"v1")
    _, newer, ok = backend.set_state(b"v2", token)
    assert ok and newer > token
    # the stale token is fenced off and the caller learns the current state
    state, current, ok = backend.set_state(b"stale write", token)
    assert not ok and (state, current) == (b"v2", newer)
    assert backend.get_state() == (b"v2", newer)


def test_foreign_token_never_matches(etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    assert backend.set_state(b"x", b"not-a-revision") is None
    _, token, _ = backend.set_state(b"v1")
    assert backend.set_state(b"v2", b"opaque") == (b"v1", token, False)


def test_runs_are_isolated_by_prefix(etcd_client, etcd_settings) -> None:
    a = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-a"))
    b = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-b"))
    a.set_state(b"a-state")
    assert b.get_state() is None
    assert a.key.startswith(etcd_settings.key_prefix + "/job-a/")


@pytest.mark.parametrize("first", [True, False])
def test_concurrent_writers_exactly_one_wins(etcd_settings, run_prefix, first) -> None:
    writers = 6
    clients = [EtcdClient(etcd_settings) for _ in range(writers)]
    try:
        backends = [EtcdV3RendezvousBackend(c, run_prefix) for c in clients]
        token = None
        if not first:
            _, token, _ = backends[0].set_state(b"base")
        barrier = threading.Barrier(writers)
        results: list[tuple[bytes, object, bool] | None] = [None] * writers

        def write(i: int) -> None:
            barrier.wait(timeout=20)
            results[i] = backends[i].set_state(f"writer {i}".encode(), token)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all(r is not None for r in results)
        winners = [i for i, r in enumerate(results) if r[2]]  # type: ignore[index]
        assert len(winners) == 1
        final = backends[0].get_state()
        assert final is not None and final[0] == f"writer {winners[0]}".encode()
        # every loser was told the winner's state and token
        for r in results:
            assert (r[0], r[1]) == final  # type: ignore[index]
    finally:
        for c in clients:
            c.close()


def test_state_survives_etcd_restart(etcd_server, etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    _, token, _ = backend.set_state(b"before")
    etcd_server.restart()
    assert backend.get_state() == (b"before", token)
    _, _, ok = backend.set_state(b"after", token)
    assert ok
