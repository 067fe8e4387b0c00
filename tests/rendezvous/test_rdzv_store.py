"""c10d Store contract of EtcdStore on a real etcd (also through torch's PrefixStore)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from pyetcd import exceptions as etcd_exceptions

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.errors import EtcdStoreTimeoutError
from chameleon_elastic.rendezvous.store import MAX_TXN_OPS, EtcdStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(etcd_client, run_prefix) -> EtcdStore:
    return EtcdStore(etcd_client, run_prefix, timeout=timedelta(seconds=10))


def test_set_get_bytes_and_str(store) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffraw")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffraw"
    assert store.multi_get(["a", "b"]) == [b"text", b"\x00\xffraw"]


def test_more_keys_than_one_etcd_transaction_takes(store) -> None:
    """etcd refuses a txn of more than 128 operations: a thousand nodes' reports still read."""
    keys = [f"node/{i}" for i in range(MAX_TXN_OPS * 2 + 5)]
    assert not store.check(keys)
    store.multi_set(keys[:-1], [str(i) for i in range(len(keys) - 1)])
    assert not store.check(keys)
    store.set(keys[-1], "last")
    assert store.check(keys)
    values = store.multi_get(keys)
    assert values[:-1] == [str(i).encode() for i in range(len(keys) - 1)]
    assert values[-1] == b"last"


def test_add_counts(store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.get("n") == b"3"


class _ReplyLost:
    """The pyetcd client, except that its first transaction that writes is applied by etcd and
    then fails as a leader killed mid-call makes it fail (a transient error): its reply lost."""

    def __init__(self, client) -> None:
        self._client, self.lost = client, 0

    def transaction(self, compare, success, failure):
        result = self._client.transaction(compare, success, failure)
        if success and not self.lost:
            self.lost += 1
            raise etcd_exceptions.ConnectionFailedError("injected: the reply was lost")
        return result

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("operation", ["add", "append"])
def test_a_write_whose_reply_was_lost_is_not_applied_twice(store, monkeypatch, operation) -> None:
    """The client retries a call that failed transiently; had etcd applied it already, a
    second add counted one agent twice in torch's exit barrier (which then waited out its
    timeout on every node)."""
    store.add("n", 1) if operation == "add" else store.append("s", "a")
    lossy = _ReplyLost(store._client.client())
    monkeypatch.setattr(store._client, "client", lambda: lossy)
    if operation == "add":
        assert store.add("n", 1) == 2
        assert store.get("n") == b"2"
    else:
        store.append("s", "b")
        assert store.get("s") == b"ab"
    assert lossy.lost == 1   # the reply was lost once, and the call retried
    assert store.num_keys() == 1   # no marker among the store's keys


def test_concurrent_adds_are_exact(etcd_settings, run_prefix) -> None:
    clients = [EtcdClient(etcd_settings) for _ in range(4)]
    try:
        stores = [EtcdStore(c, run_prefix) for c in clients]

        def bump(s: EtcdStore) -> None:
            for _ in range(10):
                s.add("counter", 1)

        threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=40)
        assert stores[0].get("counter") == b"40"
    finally:
        for c in clients:
            c.close()


def test_compare_set_follows_tcpstore(store) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # absent + empty expectation: set
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("k", "wrong", "third") == b"second"  # mismatch: current value
    assert store.get("k") == b"second"
    assert store.compare_set("absent", "x", "y") == b"x"  # absent + expectation: expected
    assert not store.check(["absent"])


def test_compare_set_of_a_large_value_it_read_fits_etcds_request_limit(
        store, etcd_client, run_prefix) -> None:
    """The plan record is 1.1 MB at 131072 devices: compared by value it crosses the wire
    twice in one request, over etcd's default 1.5 MiB limit (the commit failed). A large
    value this store read is compared by its revision instead, with the value semantics kept:
    a change by another store since the read is seen, a rewrite of the same bytes is not."""
    old, new, other = (bytes([n]) * (900 * 1024) for n in (1, 2, 3))
    store.set("record", old)
    with pytest.raises(Exception, match="too large"):   # a value compare: 1.8 MB in one request
        store.compare_set("record", old, new)
    assert store.get("record") == old
    assert store.compare_set("record", old, new) == new
    elsewhere = EtcdStore(etcd_client, run_prefix, timeout=timedelta(seconds=10))
    assert store.get("record") == new
    elsewhere.set("record", other)   # changed after this store's read
    assert store.compare_set("record", new, old) == other
    assert store.get("record") == other
    elsewhere.set("record", other)   # the same bytes again, at a newer revision
    assert store.compare_set("record", other, new) == new


def test_check_delete_num_keys(store) -> None:
    store.multi_set(["x", "y"], ["1", "2"])
    assert store.check(["x", "y"]) and not store.check(["x", "z"])
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.num_keys() == 1


def test_append(store) -> None:
    store.append("log", "a")
    store.append("log", b"b")
    assert store.get("log") == b"ab"


def test_wait_times_out_as_dist_store_error(store) -> None:
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(milliseconds=300))
    store.set_timeout(timedelta(milliseconds=300))
    with pytest.raises(EtcdStoreTimeoutError):
        store.get("never")


def test_wait_wakes_when_another_client_sets(etcd_settings, run_prefix) -> None:
    with EtcdClient(etcd_settings) as waiter_client, EtcdClient(etcd_settings) as setter_client:
        waiter = EtcdStore(waiter_client, run_prefix, timeout=timedelta(seconds=20))
        setter = EtcdStore(setter_client, run_prefix)
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: got.append(waiter.get("late")))
        thread.start()
        setter.set("other", "noise")
        setter.set("late", "here")
        thread.join(timeout=25)
        assert got == [b"here"]


def test_through_prefix_store(store) -> None:
    prefixed = dist.PrefixStore("torch.rendezvous.run.0", store)
    prefixed.set("MASTER_ADDR", "127.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"127.0.0.1"
    assert prefixed.add("count", 2) == 2
    assert prefixed.compare_set("c", "", "v") == b"v"
    prefixed.wait(["MASTER_ADDR"], timedelta(seconds=1))
    assert prefixed.check(["MASTER_ADDR"])
    assert prefixed.multi_get(["MASTER_ADDR", "c"]) == [b"127.0.0.1", b"v"]
    assert store.get("torch.rendezvous.run.0/MASTER_ADDR") == b"127.0.0.1"


def test_torch_elastic_barrier_on_etcd_store(etcd_settings, run_prefix) -> None:
    from torch.distributed.elastic.utils.store import barrier

    clients = [EtcdClient(etcd_settings) for _ in range(3)]
    try:
        stores = [EtcdStore(c, run_prefix, timeout=timedelta(seconds=20)) for c in clients]
        errors: list[BaseException] = []

        def enter(s: EtcdStore) -> None:
            try:
                barrier(s, 3, key_prefix="exit/", barrier_timeout=20)
            except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=enter, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors and not any(t.is_alive() for t in threads)
    finally:
        for c in clients:
            c.close()


def test_store_rides_out_etcd_restart(etcd_server, store) -> None:
    store.set("before", "1")
    etcd_server.stop()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(store.add("during", 1)))
    thread.start()
    etcd_server.start()
    thread.join(timeout=30)
    assert result == [1]
    assert store.get("before") == b"1"


_KV = "etcdserverpb.KV"   # reads and writes, apart from the watch stream


def _requests(etcd_server, service: str = "") -> float:
    """gRPC messages etcd has received so far (unary calls and each watch create/cancel), of
    one service where named. Reads are counted as ``etcdserverpb.KV`` apart from the watch
    stream: a wait's cancel goes out on that stream from its own thread and may reach etcd
    after the wait returned, inside a window that means to count reads only."""
    import urllib.request

    with urllib.request.urlopen(f"http://{etcd_server.endpoint}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("grpc_server_msg_received_total")
               and f'grpc_service="{service}' in line)


def _slice(waiter, key: str, seconds: float = 0.2) -> None:
    with pytest.raises(dist.DistStoreError, match=key):
        waiter.wait([key], timedelta(seconds=seconds))


def test_waiting_in_slices_keeps_one_watch(etcd_server, store) -> None:
    """A follower waiting for the decision in slices (checking a lease in between) must not
    cost etcd a read and a watch per slice: the first slice reads and watches, the others
    reuse that watch; a put between two slices still ends the wait at once."""
    waiter = dist.PrefixStore("torch.rendezvous.run.0", store)   # as the agents hold it
    before = _requests(etcd_server)
    _slice(waiter, "q1/decided")
    first = _requests(etcd_server) - before
    for _ in range(4):
        _slice(waiter, "q1/decided")
    later = _requests(etcd_server) - before - first
    assert first >= 2 and later < 4, (first, later)   # read + watch, then nothing per slice
    store.set("torch.rendezvous.run.0/q1/decided", "1")   # between two slices
    waiter.wait(["q1/decided"], timedelta(seconds=20))     # the kept watch saw it
    assert waiter.get("q1/decided") == b"1"


def test_a_watched_put_ends_the_wait_without_a_read(etcd_server, store) -> None:
    """The watch's event says the key was put: reading it back to be sure cost etcd one
    transaction per waiting follower (4096 per quick round at 4096 nodes). A key put and
    deleted again before a wait does not end it. (Put and deleted between two slices of one
    wait, it may: etcd can deliver the put and the delete in separate watch responses, and a
    wait that saw only the put returns; no caller deletes a key it waits for.)"""
    _slice(store, "decided")
    store.set("decided", "1")
    before = _requests(etcd_server, _KV)
    store.wait(["decided"], timedelta(seconds=20))
    assert _requests(etcd_server, _KV) == before, "a read after the put was seen"
    store.set("flicker", "1")
    store.delete_key("flicker")
    _slice(store, "flicker")   # put, then deleted: still missing
    _slice(store, "flicker")   # and the kept watch saw nothing since


def test_a_get_right_after_a_wait_takes_the_watched_value(etcd_server, store) -> None:
    """A quick round's followers wait for the agreement and read it: the watch event that
    ended the wait carried the value, and the read right after takes it without a request
    (one transaction per follower, 4096 per round at 4096 nodes). Only the next call may:
    a get after any other call reads etcd."""
    _slice(store, "agreement")
    store.set("agreement", "first")
    store.wait(["agreement"], timedelta(seconds=20))
    before = _requests(etcd_server, _KV)
    assert store.get("agreement") == b"first"
    assert _requests(etcd_server, _KV) == before, "the get read etcd"
    _slice(store, "next")
    store.set("next", "1")
    store.wait(["next"], timedelta(seconds=20))
    store.set("next", "2")   # another call between the wait and the get
    assert store.get("next") == b"2"


def test_kept_watch_wakes_on_a_put_during_a_slice(etcd_settings, run_prefix, store) -> None:
    _slice(store, "late")
    with EtcdClient(etcd_settings) as setter_client:
        setter = EtcdStore(setter_client, run_prefix)
        done: list[bool] = []
        thread = threading.Thread(target=lambda: done.append(
            store.wait(["late"], timedelta(seconds=20)) is None))
        thread.start()
        setter.set("late", "here")
        thread.join(timeout=25)
    assert done == [True]


def test_kept_watch_gives_way_to_a_wait_for_other_keys(store) -> None:
    _slice(store, "a")
    store.set("b", "1")
    store.wait(["b"], timedelta(seconds=5))       # another key: the kept watch is dropped
    _slice(store, "a")                             # a fresh read and watch: still missing
    store.set("a", "2")
    assert store.multi_get(["a", "b"]) == [b"2", b"1"]
    with pytest.raises(dist.DistStoreError, match="'c'"):
        store.wait(["a", "c"], timedelta(milliseconds=200))   # names only what is missing
