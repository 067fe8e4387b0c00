"""What forming a generation's gloo world costs at 64-1024 ranks: the full mesh vs lazy pairs.

A regroup is torch's store-based ``init_process_group`` on the generation's fresh TCPStore
(launcher/coordination/rounds.py ``open_worker_store``, runtime/world/join.py). gloo's default is a full mesh:
every rank writes its address (one key of N pair addresses) and reads every other rank's, then
opens a connection per pair: N^2 store reads on the store's server and N(N-1)/2 connections.
With ``TORCH_GLOO_LAZY_INIT=1`` (torch >= 2.7, so 2.13 has it; runtime/world/regroup.py) a rank
writes its address and connects a pair only when it first talks to that peer: N writes, then
two reads per pair used. The runtime's first use of the world after a regroup is the agree
all-gather (a ring: two peers per rank), so that is what this measures after formation.

Ranks run as threads, ``--per-proc`` per process (a rank is a ``ProcessGroupGloo`` of its
own: torch allows one default group per process, not one group per rank), against one
TCPStore server in the parent, as the deciding agent hosts it. Every process creates its
store clients first; then all ranks start forming at one moment. Reported per mode and world:
formation (the start -> the last rank formed), the first all-gather (ring), the sockets the
world holds (socket descriptors, both ends of each pair, and each rank's listener), and the
store operations the mode makes (counted at 8 ranks with a counting store, then given as a
formula of N). The full mesh at 1024 ranks needs about a million sockets (N(N-1) ends) and is
not run: its row says so. Nor is the all-gather above 300 ranks: a ring of N ranks as threads on
two cores is N^2 thread hand-offs (263 s at 1024), which measures the machine, not the regroup.

    python benchmarks/regroup_scale.py [--worlds 64,256,1024] [--modes eager,lazy]
        [--per-proc 64] [--json]
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


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _ranks(first: int, count: int, world: int, port: int, lazy: bool, go: Any,
           out: Any) -> None:
    """One process's ranks: store clients first, then (at ``go``) formation, then the first
    all-gather; puts (formed at, all-gathered at, sockets held) per process."""
    import torch
    import torch.distributed as dist

    if lazy:
        os.environ[LAZY_ENV] = "1"
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


def form(world: int, lazy: bool, per_proc: int) -> dict[str, Any]:
    """Form one world of ``world`` ranks; the slowest rank's times and the sockets held."""
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
                                                      world, server.port, lazy, go, out)))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="64,256,1024",
                        help="world sizes (default 64,256,1024)")
    parser.add_argument("--modes", default="eager,lazy",
                        help="eager (gloo's full mesh, today's regroup) and/or lazy "
                             "(TORCH_GLOO_LAZY_INIT: pairs on first use); default both")
    parser.add_argument("--per-proc", type=int, default=64,
                        help="ranks (threads) per process (default 64)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds {args.worlds!r} must be comma-separated integers, e.g. 64,256")
    modes = args.modes.split(",")
    if not set(modes) <= {"eager", "lazy"} or min(worlds) < 2 or args.per_proc < 1:
        parser.error("--modes takes eager and/or lazy, --worlds sizes of 2 or more, "
                     "--per-proc 1 or more")
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    ops = {m: store_ops(m == "lazy") for m in modes}
    rows = []
    for world in worlds:
        for mode in modes:
            row: dict[str, Any] = {"ranks": world, "mode": mode}
            if mode == "eager" and world > MESH_LIMIT:
                row["skipped"] = (f"the full mesh needs {world * (world - 1):,} socket ends; "
                                  f"not run above {MESH_LIMIT} ranks on one machine")
            else:
                say(f"  {mode}: forming {world} ranks")
                row.update(form(world, mode == "lazy", args.per_proc))
            n = world
            row["store_writes"] = n
            row["store_reads"] = n * n if mode == "eager" else 2 * n   # ring: 2 per rank
            rows.append(row)
    result = {"benchmark": "regroup_scale", "store_ops_at_8": ops, "rows": rows}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    for mode, counted in ops.items():
        print(f"{mode}, 8 ranks: formation {counted['formation_writes']} writes, "
              f"{counted['formation_reads']} reads; first all-gather "
              f"{counted['allgather_reads']} reads")
    print("ranks | mode | formation | first all-gather | sockets | store writes | store reads")
    for r in rows:
        if "skipped" in r:
            print(f"{r['ranks']} | {r['mode']} | - | - | - | {r['store_writes']:,} | "
                  f"{r['store_reads']:,} ({r['skipped']})")
            continue
        gather = (f"{r['first_allgather_s']:.2f} s" if "first_allgather_s" in r
                  else "not run")
        print(f"{r['ranks']} | {r['mode']} | {r['formation_s']:.2f} s | {gather} | "
              f"{r['sockets']:,} | {r['store_writes']:,} | {r['store_reads']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
