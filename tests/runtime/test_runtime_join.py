"""Joining a plan generation (runtime/world/join.py) and the sockets recovery shuts down
(runtime/world/abort.py), on real TCPStores and real sockets, in one process."""

from __future__ import annotations

import os
import queue
import socket
import threading

import pytest
import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.channel import Generation
from chameleon_elastic.hang import WORKER_MARGIN, RecoveryDeadlines
from chameleon_elastic.runtime.errors import PeerLost
from chameleon_elastic.runtime.recovery.deadlines import RecoveryClock
from chameleon_elastic.runtime.world.abort import Watchdog, new_sockets, shut_down
from chameleon_elastic.runtime.world.join import join_generation
from chameleon_elastic.runtime.world.link import WorkerLink
from chameleon_elastic.timeouts import Timeouts


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_a_generation_superseded_before_the_worker_reached_it_is_given_up_at_once():
    """Generation 1's store is closed (generation 2 replaced it 10 ms after it was published,
    while this worker was still on its way): joining it fails with PeerLost as soon as the
    newer generation is seen, instead of retrying the refused connection for the whole store
    timeout (60 s here; the test's limit is 30 s)."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeouts = Timeouts(store_s=60.0)
    link = WorkerLink(dist.TCPStore("127.0.0.1", agent.port, is_master=False), 0, timeouts,
                      f"127.0.0.1:{agent.port}")
    stale = Generation(1, "plan-gen1.json", "127.0.0.1", _closed_port(), (0, 1))
    channel.write(agent, channel.generation_key(2),
                  Generation(2, "plan-gen2.json", "127.0.0.1", agent.port, (0,)))
    with pytest.raises(PeerLost, match="generation 1 was superseded"):
        join_generation(stale, link, "gloo", timeouts)
    assert not dist.is_initialized()


def test_shut_down_cuts_recorded_sockets_but_not_a_socket_that_reused_a_descriptor():
    """A group's sockets close with the group and their descriptor numbers go to the next
    sockets opened (the next generation's store client, say): shutting the recorded sockets
    down must cut those still open and leave the one that took over a number working."""
    with new_sockets() as recorded:
        gone, gone_peer = socket.socketpair()
        live, live_peer = socket.socketpair()
    reused_fd = gone.fileno()
    gone.close()
    gone_peer.close()
    new, new_peer = socket.socketpair()
    extra = None
    if reused_fd not in (new.fileno(), new_peer.fileno()):   # make the number name it
        extra = os.dup2(new.fileno(), reused_fd)
    try:
        shut_down(frozenset(recorded))
        assert live_peer.recv(1) == b""   # cut: the peer sees the connection closed
        new.sendall(b"ok")
        assert new_peer.recv(2) == b"ok"
    finally:
        if extra is not None:
            os.close(extra)
        for s in (live, live_peer, new, new_peer):
            s.close()


@pytest.mark.timeout(30)
def test_the_watchdog_flags_a_superseded_generation_and_arming_clears_the_flag():
    """The agent's bell wakes the watchdog: for the generation it is armed with, once a newer
    one exists, it sets ``superseded`` (what a computing loop looks at between operations)
    and unblocks the groups' sockets once; arming with the next generation clears the flag."""
    bells: queue.Queue[None] = queue.Queue()
    published = {0}
    unblocked: list[frozenset] = []
    done = threading.Event()

    def unblock(sockets: frozenset) -> None:
        unblocked.append(sockets)
        done.set()

    watchdog = Watchdog(lambda: bells.get(timeout=20), lambda: bells.put(None),
                        lambda g: g + 1 in published, unblock)
    try:
        watchdog.arm(0, frozenset({(99, "socket:[1]")}))
        assert not watchdog.superseded.is_set()
        published.add(1)
        bells.put(None)   # the agent rings after publishing generation 1
        assert done.wait(20), "the watchdog did not act on the bell within 20 s"
        assert watchdog.superseded.is_set()
        assert unblocked == [frozenset({(99, "socket:[1]")})]
        watchdog.arm(1, frozenset())
        assert not watchdog.superseded.is_set()
    finally:
        watchdog.stop()


@pytest.mark.timeout(30)
def test_a_regroup_that_cannot_complete_is_given_up_at_its_deadline():
    """Generation 1 expects two workers and only this one comes: ``init_process_group`` would
    wait for the missing peer for the store timeout (60 s here; the test's limit is 30 s).
    The recovery clock gives the regroup up at its deadline instead: it shuts the sockets
    opened since the phase began (the generation's store client) down, the join fails with
    PeerLost, and the clock names the missed phase as the generation's cause. The agent
    channel's own connection is spared."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeouts = Timeouts(store_s=60.0)
    link = WorkerLink(dist.TCPStore("127.0.0.1", agent.port, is_master=False), 0, timeouts,
                      f"127.0.0.1:{agent.port}")
    world = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gen = Generation(1, "plan-gen1.json", "127.0.0.1", world.port, (0, 1))
    clock = RecoveryClock(shut_down, frozenset, lambda seconds: None, spare_port=link.port)
    clock.begin(0.0, world_size=2)
    clock.deadlines = RecoveryDeadlines(0.2, 0.2, 0.2)   # tiny, for the test
    clock.enter_phase("regroup")
    with pytest.raises(PeerLost, match="could not join generation 1"):
        join_generation(gen, link, "gloo", timeouts)
    assert clock.missed == ("regroup", WORKER_MARGIN * 0.2)
    assert clock.explain("device 0 could not join").startswith(
        "regroup missed its deadline of 0.4 s")
    assert not dist.is_initialized()
    channel.write(link.store, "still", 1)   # the channel's connection was not cut
    assert channel.read(agent, "still") == 1
