"""The survivors' regroup of a gloo world at 4-1024 ranks: before (gloo's full mesh, what
runtime/world/join.py did at every size) and after (what it does now: lazy pairs and the join
peers from ``regroup.LAZY_FROM`` ranks, the full mesh below), both measured in one run.

A regroup is torch's store-based ``init_process_group`` on the generation's fresh TCPStore
(launcher/coordination/rounds.py ``open_worker_store``, runtime/world/join.py). gloo's default
is a full mesh (mode ``eager``): every rank writes its address (one key of N pair addresses) and
reads every other rank's, then opens a connection per pair: N^2 store reads on the store's
server and N(N-1)/2 connections. With ``TORCH_GLOO_LAZY_INIT=1`` (torch >= 2.7, so 2.13 has
it; mode ``lazy``) a rank writes its address and connects a pair only when it first talks to
that peer: N writes, then two reads per pair used. Mode ``joined`` is join.py's lazy regroup:
lazy formation, then ``regroup.connect_peers`` of each rank's ``regroup.join_peers`` (its ring
and its pipeline neighbours, for a plan of pipelines of ``STAGES`` devices), so the pairs it
will use are open (and recorded for the watchdog) when the regroup returns. The runtime's
first use of the world after a regroup is the agree all-gather (a ring), measured after.

Ranks run as threads, ``--per-proc`` per process (a rank is a ``ProcessGroupGloo`` of its
own: torch allows one default group per process, not one group per rank), against one
TCPStore server in the parent, as the deciding agent hosts it. Every process creates its
store clients first; then all ranks start forming at one moment. Reported per mode and world:
formation (the start -> the last rank ready for its first collective; ``joined``: its peers
connected), the first all-gather (ring), the sockets the world holds (socket descriptors, both
ends of each pair, and each rank's listener), and the store operations the mode makes (counted
at 8 ranks with a counting store, then given as a formula of N); then the before/after table.
The full mesh at 1024 ranks needs about a million sockets (N(N-1) ends) and is not run: its row
says so. Nor is the all-gather above 300 ranks: a ring of N ranks as threads on two cores is
N^2 thread hand-offs (263 s at 1024), which measures the machine, not the regroup.

    python benchmarks/regroup_scale.py [--worlds 4,16,64,256,1024] [--modes eager,lazy,joined]
        [--per-proc 64] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
#: the full mesh opens N(N-1) socket ends: above this many the row is extrapolated, not run
MESH_LIMIT = 300
#: a ring all-gather of N ranks as threads on a few cores is N^2 thread hand-offs (263 s at
#: 1024 ranks on 2 cores, the load average near 1000): above this many it is not run
GATHER_LIMIT = 300
#: the plan ``joined`` connects the peers of: pipelines of this many stages
STAGES = 4
MODES = ("eager", "lazy", "joined")


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _plan_peers(world: int, stages: int) -> list[set[int]]:
    """Each rank's join peers (runtime/world/regroup.py ``join_peers``, what join.py connects
    with lazy pairs) for a plan of pipelines of ``stages`` devices over ``world`` ranks."""
    from chameleon_elastic.channel import Generation
    from chameleon_elastic.plan import ExecutionPlan, Pipeline
    from chameleon_elastic.runtime.world import regroup

    stages = max(1, min(stages, world))
    pipes = tuple(Pipeline(tuple(range(first, min(first + stages, world))),
                           tuple((s, s + 1) for s in range(min(stages, world - first))), 4)
                  for first in range(0, world, stages))
    plan = ExecutionPlan("initial", 1, pipes)
    gen = Generation(1, "", "127.0.0.1", 0, tuple(range(world)))
    return [regroup.join_peers(plan, gen, r) for r in range(world)]


def _connect(group: Any, rank: int, peers: set[int]) -> None:
    """regroup.connect_peers on a bare ProcessGroupGloo: one element each way per peer."""
    import torch

    works = []
    for peer in sorted(peers):
        works.append(group.send([torch.zeros(1)], peer, 0x7E5))
        works.append(group.recv([torch.zeros(1)], peer, 0x7E5))
    for work in works:
        work.wait()


def _ranks(first: int, count: int, world: int, port: int, mode: str, go: Any,
           out: Any) -> None:
    """One process's ranks: store clients first, then (at ``go``) formation (and, ``joined``,
    connecting the join peers: the regroup), then the first all-gather; puts (ready at,
    all-gathered at, sockets held) per process."""
    import torch
    import torch.distributed as dist

    if mode != "eager":
        os.environ[LAZY_ENV] = "1"
    peers = _plan_peers(world, STAGES) if mode == "joined" else None
    timeout = timedelta(seconds=300)
    stores = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
              for _ in range(count)]
    base = _sockets()
    groups: list[Any] = [None] * count
    formed = [0.0] * count
    gathered = [0.0] * count
    errors: list[str] = []

    def rank(i: int) -> None:
        try:
            groups[i] = dist.ProcessGroupGloo(dist.PrefixStore("gen/1/", stores[i]),
                                              first + i, world, timeout)
            if peers is not None:
                _connect(groups[i], first + i, peers[first + i])
            formed[i] = time.monotonic()
            barrier.wait()   # every rank of this process formed: then the all-gather
            if world > GATHER_LIMIT:
                return
            mine = torch.tensor([float(first + i)])
            out_tensors = [torch.zeros(1) for _ in range(world)]
            groups[i].allgather([out_tensors], [mine]).wait()
            gathered[i] = time.monotonic()
            if out_tensors[-1].item() != world - 1:
                errors.append(f"rank {first + i} gathered {out_tensors[-1].item()}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"rank {first + i}: {exc}")
            barrier.abort()

    barrier = threading.Barrier(count)
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(count)]
    out.put(("ready", first))
    start = go.get()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("done", {"formed": max(formed) - start, "gathered": max(gathered) - start,
                      "sockets": _sockets() - base, "errors": errors}))
    out.close()
    out.join_thread()   # the message is sent before the process goes
    os._exit(0)   # gloo's threads need no orderly exit


def form(world: int, mode: str, per_proc: int) -> dict[str, Any]:
    """Form one world of ``world`` ranks in ``mode``; the slowest rank's times (formation:
    until every rank can run its first collective) and the sockets held."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gos = []
    procs = []
    for first in range(0, world, per_proc):
        go = ctx.Queue()
        gos.append(go)
        procs.append(ctx.Process(target=_ranks, args=(first, min(per_proc, world - first),
                                                      world, server.port, mode, go, out)))
    for p in procs:
        p.start()
    for _ in procs:
        kind, _first = out.get(timeout=600)
        assert kind == "ready"
    start = time.monotonic()
    for go in gos:
        go.put(start)
    done = [out.get(timeout=900)[1] for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [e for d in done for e in d["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed, e.g. {errors[0]}")
    out = {"formation_s": max(d["formed"] for d in done),
           "sockets": sum(d["sockets"] for d in done)}
    if world <= GATHER_LIMIT:
        out["first_allgather_s"] = (max(d["gathered"] for d in done)
                                    - max(d["formed"] for d in done))
    return out


def store_ops(lazy: bool, world: int = 8) -> dict[str, int]:
    """Store operations of forming ``world`` ranks and their first all-gather, counted by a
    store that forwards to a TCPStore (one process, threads)."""
    import torch
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.inner = dist.TCPStore("127.0.0.1", server.port, is_master=False)
            self.ops: dict[str, int] = {}

        def _note(self, op: str) -> None:
            self.ops[op] = self.ops.get(op, 0) + 1

        def set(self, key: str, value: Any) -> None:
            self._note("writes")
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            self._note("reads")
            return self.inner.get(key)

        def wait(self, keys: Any, timeout: Any = None) -> None:
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    stores = [Counting() for _ in range(world)]
    old = os.environ.get(LAZY_ENV)
    if lazy:
        os.environ[LAZY_ENV] = "1"
    try:
        groups: list[Any] = [None] * world

        def rank(r: int) -> None:
            groups[r] = dist.ProcessGroupGloo(stores[r], r, world, timedelta(seconds=60))

        _all(rank, world)
        formed = {k: sum(s.ops.get(k, 0) for s in stores) for k in ("writes", "reads")}

        def gather(r: int) -> None:
            groups[r].allgather([[torch.zeros(1) for _ in range(world)]],
                                [torch.ones(1)]).wait()

        _all(gather, world)
        total = {k: sum(s.ops.get(k, 0) for s in stores) for k in ("writes", "reads")}
    finally:
        if old is None:
            os.environ.pop(LAZY_ENV, None)
        else:
            os.environ[LAZY_ENV] = old
    return {"formation_writes": formed["writes"], "formation_reads": formed["reads"],
            "allgather_reads": total["reads"] - formed["reads"], "world": world}


def _all(fn: Any, world: int) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(world: int, mode: str, per_proc: int, repeat: int) -> dict[str, Any]:
    """One row: ``world`` ranks in ``mode``, the median of ``repeat`` formations (the full
    mesh above MESH_LIMIT is not run: the row says why), with the store operations."""
    row: dict[str, Any] = {"ranks": world, "mode": mode}
    if mode == "eager" and world > MESH_LIMIT:
        row["skipped"] = (f"the full mesh needs {world * (world - 1):,} socket ends; "
                          f"not run above {MESH_LIMIT} ranks on one machine")
    else:
        print(f"  {mode}: forming {world} ranks x{repeat}", file=sys.stderr, flush=True)
        runs = [form(world, mode, per_proc) for _ in range(repeat)]
        row.update(runs[len(runs) // 2] if repeat == 1 else _median(runs))
        row["formation_runs_s"] = [r["formation_s"] for r in runs]
    row["store_writes"] = world
    pairs = len(set().union(*({frozenset((r, p)) for p in ps}
                              for r, ps in enumerate(_plan_peers(world, STAGES)))))
    row["store_reads"] = {"eager": world * world, "lazy": 2 * world,   # ring: 2 per rank
                          "joined": 2 * pairs}[mode]
    return row


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["formation_s"])
    return dict(ordered[len(ordered) // 2])


def before_after(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world: the regroup before (gloo's full mesh, what join.py did at every size) and
    after (what join.py does now: lazy pairs and the join peers from ``LAZY_FROM`` ranks,
    the full mesh below), both from this run."""
    from chameleon_elastic.runtime.world.regroup import lazy_wins

    by = {(r["ranks"], r["mode"]): r for r in rows}
    out = []
    for world in sorted({r["ranks"] for r in rows}):
        before, after_mode = by.get((world, "eager")), ("joined" if lazy_wins("gloo", world)
                                                        else "eager")
        after = by.get((world, after_mode))
        out.append({"ranks": world, "after_mode": after_mode,
                    "before_s": None if before is None else before.get("formation_s"),
                    "after_s": None if after is None else after.get("formation_s")})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,16,64,256,1024",
                        help="world sizes (default 4,16,64,256,1024)")
    parser.add_argument("--modes", default="eager,lazy,joined",
                        help="eager (gloo's full mesh: the regroup before), lazy "
                             "(TORCH_GLOO_LAZY_INIT: pairs on first use), joined (lazy, then "
                             "the join peers connected: join.py's regroup now); default all")
    parser.add_argument("--per-proc", type=int, default=64,
                        help="ranks (threads) per process (default 64)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="formations per row below 256 ranks, the median reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds {args.worlds!r} must be comma-separated integers, e.g. 64,256")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or min(worlds) < 2 or args.per_proc < 1 or args.repeat < 1:
        parser.error("--modes takes eager, lazy and/or joined, --worlds sizes of 2 or more, "
                     "--per-proc and --repeat 1 or more")
    load = os.getloadavg()[0]
    ops = {m: store_ops(m == "lazy") for m in modes if m != "joined"}
    rows = [measure(w, m, args.per_proc, args.repeat if w < 256 else 1)
            for w in worlds for m in modes]
    result = {"benchmark": "regroup_scale", "store_ops_at_8": ops, "rows": rows,
              "before_after": before_after(rows), "stages": STAGES,
              "load_1min": {"start": load, "end": os.getloadavg()[0]}}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    for mode, counted in result["store_ops_at_8"].items():
        print(f"{mode}, 8 ranks: formation {counted['formation_writes']} writes, "
              f"{counted['formation_reads']} reads; first all-gather "
              f"{counted['allgather_reads']} reads")
    print("ranks | mode | formation | first all-gather | sockets | store writes | store reads")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"{r['ranks']} | {r['mode']} | - | - | - | {r['store_writes']:,} | "
                  f"{r['store_reads']:,} ({r['skipped']})")
            continue
        gather = (f"{r['first_allgather_s']:.3f} s" if "first_allgather_s" in r
                  else "not run")
        print(f"{r['ranks']} | {r['mode']} | {r['formation_s']:.3f} s | {gather} | "
              f"{r['sockets']:,} | {r['store_writes']:,} | {r['store_reads']:,}")
    print("ranks | regroup before (full mesh) | regroup after (join.py now) | after's mode")
    for r in result["before_after"]:
        before = "not run" if r["before_s"] is None else f"{r['before_s']:.3f} s"
        after = "not run" if r["after_s"] is None else f"{r['after_s']:.3f} s"
        print(f"{r['ranks']} | {before} | {after} | {r['after_mode']}")


if __name__ == "__main__":
    sys.exit(main())
