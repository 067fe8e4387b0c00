"""A gloo world formed with lazy pairs (runtime/world/regroup.py): four real processes on a real
TCPStore. Forming it connects no pair; the pairs a rank names are open (and recorded for the
watchdog) when ``connect_peers`` returns, the others are not; and the recorded sockets still
unblock a survivor waiting on a peer frozen by SIGSTOP, as the full mesh's do. Then the
survivors' regroup (join.py ``join_generation``) with lazy pairs, and the peers it connects."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest

from chameleon_elastic.channel import Generation
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime.world import regroup

pytestmark = pytest.mark.timeout(60)

_RANK = textwrap.dedent("""
    import json, os, socket, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from chameleon_elastic.runtime.world import regroup
    from chameleon_elastic.runtime.world.abort import new_sockets, shut_down

    rank, port, world = int(sys.argv[1]), int(sys.argv[2]), 4
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    with regroup.lazy_pairs("gloo"), new_sockets() as formed:
        dist.init_process_group("gloo", store=dist.PrefixStore("gen/1/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
    # every rank's formation window closes before any pair connects (a pair a fast rank
    # opened while a slow one was still forming would land in the slow one's first count), and
    # its second window opens before then and closes once every rank connected its pairs: the
    # side that accepts a pair gets its socket whenever the other side connects
    with new_sockets() as connected:
        if store.add("formed", 1) == world:
            store.set("all formed", "1")
        store.wait(["all formed"])
        regroup.connect_peers(regroup.ring_peers(rank, world))
        if store.add("connected", 1) == world:
            store.set("all connected", "1")
        store.wait(["all connected"])

    def peers(sockets):   # connected TCP sockets (not listening), by their remote ports
        out = 0
        for fd, _ in sockets:
            s = socket.socket(fileno=fd)
            try:
                out += not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            finally:
                s.detach()
        return out

    print(json.dumps({"formed": peers(formed), "connected": peers(connected)}), flush=True)
    if rank == 0:   # wait on rank 1, which the test freezes; then cut the recorded sockets
        store.wait(["frozen"])
        threading.Timer(0.5, shut_down, args=(frozenset(connected),)).start()
        start = time.monotonic()
        try:
            dist.recv(torch.zeros(1), 1)
            print(json.dumps({"recv": "returned"}), flush=True)
        except RuntimeError as exc:
            print(json.dumps({"recv": "failed", "after_s": time.monotonic() - start}),
                  flush=True)
        os._exit(0)
    store.wait(["done"])
    os._exit(0)
""")


def test_lazy_pairs_connect_only_the_named_peers_and_stay_unblockable(ranks):
    server, start = ranks
    procs = start(_RANK, 4, drop_env=("TORCH_GLOO_LAZY_INIT",))
    try:
        said = [json.loads(p.stdout.readline() or "{}") for p in procs]
        assert all(s.get("formed") == 0 for s in said), said   # no pair at formation
        # the ring of four: two peers each (a full mesh would have opened three)
        assert [s["connected"] for s in said] == [2, 2, 2, 2], said
        os.kill(procs[1].pid, signal.SIGSTOP)   # frozen: its sockets stay open, silent
        server.set("frozen", "1")
        line = procs[0].stdout.readline()
        assert line, f"rank 0 said nothing: {procs[0].stderr.read()[-2000:]}"
        result = json.loads(line)
        assert result["recv"] == "failed" and result["after_s"] < 10, result
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        server.set("done", "1")


def _plan(generation: int, spares: tuple[int, ...] = ()) -> ExecutionPlan:
    """Two pipelines of two stages: devices (0, 1) and (2, 3)."""
    return ExecutionPlan("initial" if generation == 1 else "replan", generation,
                         (Pipeline((0, 1), ((0, 4), (4, 8)), 4),
                          Pipeline((2, 3), ((0, 4), (4, 8)), 4)), spare_devices=spares)


def test_join_peers_are_the_ring_and_the_pipeline_neighbours_reroutes_included(monkeypatch):
    """Device 1 is lost and its stage of pipeline 0 is rerouted to device 3: device 0 then
    sends its activations to 3, and 3 serves two pipelines; the relation stays symmetric."""
    plan = ExecutionPlan("reroute", 2, _plan(1).pipelines, failed_devices=(1,),
                         reroute=(Reroute(1, 0, 1, (PeerShare(3, 4),)),))
    assert regroup.pipeline_peers(plan, 0) == {3}
    assert regroup.pipeline_peers(plan, 3) == {0, 2}
    assert regroup.pipeline_peers(plan, 2) == {3}
    gen = Generation(2, "", "127.0.0.1", 0, (0, 2, 3))   # ranks 0, 1, 2
    assert [regroup.join_peers(plan, gen, d) for d in gen.world] == [{1, 2}, {0, 2}, {0, 1}]
    wide = Generation(1, "", "127.0.0.1", 0, tuple(range(64)))   # 64 ranks of (0, 1), (2, 3)
    assert regroup.join_peers(_plan(1), wide, 0) == {1, 63}   # its ring; 1 is its neighbour too
    assert regroup.join_peers(_plan(1), wide, 2) == {1, 3}
    monkeypatch.delenv(regroup.LAZY_FROM_ENV, raising=False)
    assert not regroup.lazy_wins("gloo", regroup.LAZY_FROM - 1)
    assert regroup.lazy_wins("gloo", regroup.LAZY_FROM) and not regroup.lazy_wins("nccl", 1024)


def test_lazy_from_can_be_lowered_from_the_environment(monkeypatch):
    monkeypatch.setenv(regroup.LAZY_FROM_ENV, "2")
    assert regroup.lazy_wins("gloo", 2) and not regroup.lazy_wins("gloo", 1)


_SURVIVOR = textwrap.dedent("""
    import json, os, socket, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from chameleon_elastic.channel import Generation
    from chameleon_elastic.runtime.world import join, regroup
    from chameleon_elastic.runtime.world.abort import GroupSockets
    from chameleon_elastic.runtime.world.link import WorkerLink
    from chameleon_elastic.timeouts import Timeouts

    device, port, plan1, plan2 = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    timeouts = Timeouts(hang_s=20.0, store_s=30.0, collective_s=30.0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    link = WorkerLink(store, device, timeouts, f"127.0.0.1:{port}")
    join.preload_before_groups = lambda: None   # torch._dynamo's import: seconds, beside the point

    def pairs():   # the world's recorded sockets that are connected pairs (not its listener)
        out = 0
        for fd, _ in GroupSockets[dist.group.WORLD]:
            s = socket.socket(fileno=fd)
            try:
                out += s.type == socket.SOCK_STREAM and not s.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and s.getpeername()[1] != port
            finally:
                s.detach()
        return out

    def gathered():
        out = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([float(device)]))
        return [int(t.item()) for t in out]

    gen1 = Generation(1, plan1, "127.0.0.1", port, (0, 1, 2, 3, 4))
    join.join_generation(gen1, link, "gloo", timeouts)   # 5 ranks: below LAZY_FROM, full mesh
    said = {"gen1_pairs": pairs(), "gen1": gathered()}
    if device == 4:   # the lost device
        print(json.dumps(said), flush=True)
        os._exit(0)
    dist.destroy_process_group()   # the survivors' abort, as in_place.py's, minus the cut
    os.environ[regroup.LAZY_FROM_ENV] = "2"   # this small world regroups as a large one would
    gen2 = Generation(2, plan2, "127.0.0.1", port, (0, 1, 2, 3))
    join.join_generation(gen2, link, "gloo", timeouts)
    said.update(gen2_pairs=pairs(), gen2=gathered(), world_size=os.environ["WORLD_SIZE"])
    partner = {0: 1, 1: 0, 2: 3, 3: 2}[device]   # its pipeline neighbour, on a connected pair
    got = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(device)]), partner),
           dist.P2POp(dist.irecv, got, partner)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    said.update(neighbour=int(got.item()), gen2_pairs_after=pairs())
    # no survivor exits before every survivor counted: an exited peer's pair fails, and gloo
    # closes its end of it at once (CI: a recorded descriptor gone under the count, EBADF)
    if store.add("counted", 1) == 4:
        store.set("all counted", "1")
    store.wait(["all counted"])
    print(json.dumps(said), flush=True)
    os._exit(0)
""")


def test_survivors_regroup_with_lazy_pairs_and_their_collectives_work(ranks, tmp_path):
    """Five real processes join generation 1 (a full mesh: four pairs each); device 4 leaves,
    and the four survivors join generation 2 through ``join_generation`` with lazy pairs:
    each connects its ring (two pairs, where a full mesh has three) and holds them recorded
    for the watchdog; an all-gather and a pipeline transfer work, on those pairs alone."""
    plan1, plan2 = tmp_path / "plan1.json", tmp_path / "plan2.json"
    plan1.write_text(_plan(1, spares=(4,)).to_json())
    plan2.write_text(_plan(2).to_json())
    _, start = ranks
    procs = start(_SURVIVOR, 5, str(plan1), str(plan2),
                  drop_env=("TORCH_GLOO_LAZY_INIT", regroup.LAZY_FROM_ENV))
    said = []
    for proc in procs:
        line = proc.stdout.readline()
        assert line, f"a rank said nothing: {proc.stderr.read()[-3000:]}"
        said.append(json.loads(line))
    assert [s["gen1_pairs"] for s in said] == [4] * 5, said
    assert all(s["gen1"] == [0, 1, 2, 3, 4] for s in said), said
    survivors = said[:4]
    assert [s["gen2_pairs"] for s in survivors] == [2] * 4, survivors
    assert all(s["gen2"] == [0, 1, 2, 3] and s["world_size"] == "4" for s in survivors)
    assert [s["neighbour"] for s in survivors] == [1, 0, 3, 2]
    assert [s["gen2_pairs_after"] for s in survivors] == [2] * 4   # nothing new connected
