"""Our etcd watch stream (rendezvous/watch_stream.py), against a real etcd: creations sent
without waiting on each other still land on the right callers, and the stream's end and etcd's
own cancellations reach the callbacks as pyetcd's did."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pyetcd import exceptions as etcd_exceptions

from chameleon_elastic.rendezvous.pyetcd_compat import add_watch
from chameleon_elastic.rendezvous.watch_stream import WatchStream

pytestmark = pytest.mark.timeout(60)


def test_many_threads_creating_watches_at_once_each_get_their_own_keys_events(
        etcd_client) -> None:
    """48 threads create a watch each on one client at once (their creations in flight
    together on one stream); every thread's watch id is its own and each callback receives
    only its own key's event, so the created answers were handed to the right callers."""
    client = etcd_client.client()
    got: dict[int, queue.SimpleQueue] = {n: queue.SimpleQueue() for n in range(48)}
    start = threading.Barrier(48, timeout=30)

    def watch(n: int):
        def callback(response) -> None:
            for event in getattr(response, "events", None) or ():
                got[n].put(bytes(event.key).decode())
        start.wait()
        return add_watch(client, f"/ws/key-{n}", callback)

    with ThreadPoolExecutor(48) as pool:
        handles = list(pool.map(watch, range(48)))
    assert len({h.watch_id for h in handles}) == 48
    for n in range(48):
        client.put(f"/ws/key-{n}", b"v")
    for n in range(48):
        assert got[n].get(timeout=20) == f"/ws/key-{n}", f"watch {n} got another key's event"
    for handle in handles:
        handle.cancel()
    client.put("/ws/key-0", b"again")
    client.put("/ws/key-1", b"again")
    assert got[0].empty() and got[1].empty(), "a cancelled watch still received events"


def test_a_watch_from_a_compacted_revision_is_refused(etcd_client) -> None:
    """A start revision etcd compacted away ends that watch with pyetcd's
    RevisionCompactedError (to the caller or its callback), never silently."""
    client = etcd_client.client()
    client.put("/ws/compacted", b"1")
    first = client.put("/ws/compacted", b"2").header.revision
    last = client.put("/ws/compacted", b"3").header.revision
    client.compact(last)
    seen: queue.SimpleQueue = queue.SimpleQueue()
    try:
        add_watch(client, "/ws/compacted", seen.put, start_revision=first)
    except etcd_exceptions.RevisionCompactedError:
        return
    assert isinstance(seen.get(timeout=20), etcd_exceptions.RevisionCompactedError)


def test_a_closed_stream_ends_its_watches_and_refuses_new_ones(etcd_client) -> None:
    """Closing the stream hands each watch's callback the end (not events), once; a watch
    asked of a stream that ended raises instead of waiting for an answer that cannot come."""
    client = etcd_client.client()
    stream = WatchStream(client)
    ends: queue.SimpleQueue = queue.SimpleQueue()
    from pyetcd import etcdrpc

    for key in (b"/ws/a", b"/ws/b"):
        stream.add(etcdrpc.WatchCreateRequest(key=key), ends.put)
    stream.close()
    received = [ends.get(timeout=20), ends.get(timeout=20)]
    assert all(getattr(r, "events", None) is None for r in received)
    with pytest.raises(etcd_exceptions.Etcd3Exception, match="closed"):
        stream.add(etcdrpc.WatchCreateRequest(key=b"/ws/c"), ends.put)


def test_a_watch_after_the_stream_ended_opens_a_new_stream(etcd_client) -> None:
    """A stream etcd or the client ended (a member restarted) stays ended; the next watch on
    that client opens a new one and receives its events (pyetcd's watcher restarted too)."""
    client = etcd_client.client()
    ends: queue.SimpleQueue = queue.SimpleQueue()
    first = add_watch(client, "/ws/before", ends.put)
    first._watcher.close()
    assert getattr(ends.get(timeout=20), "events", None) is None
    got: queue.SimpleQueue = queue.SimpleQueue()
    add_watch(client, "/ws/after", lambda r: [got.put(bytes(e.key)) for e in
                                              getattr(r, "events", None) or ()])
    client.put("/ws/after", b"v")
    assert got.get(timeout=20) == b"/ws/after"
