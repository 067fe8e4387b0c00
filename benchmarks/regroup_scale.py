"""What a regroup costs per rank, measured at small world sizes, extrapolated to 1k-16k ranks.

A regroup is torch's store-based ``init_process_group`` on a fresh TCPStore (launcher/rounds.py
``open_worker_store``). Two measurements on this machine:

1. ``init_process_group("gloo")`` in ``--worlds`` processes (default 2, 4, 8): the time each
   rank spends in the call (median over ranks), with the store's server in the parent, as the
   agent hosts it.
2. The TCPStore server's throughput for the operations a rank does: ``--clients`` threads, each
   with its own client, doing ``set`` then ``get`` of other ranks' keys, as gloo's full-mesh
   rendezvous does (every rank writes its address, then reads every other rank's: N^2 reads
   on one server thread).

Extrapolation (printed for 1024-16384 ranks): gloo's store traffic is N^2 reads at the measured
server rate; NCCL's bootstrap reads one unique id per rank (N reads) and then forms a ring
outside the store. Neither includes the transport's own connection set-up.

    python benchmarks/regroup_scale.py [--worlds 2,4,8] [--clients 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

SCALES = (1024, 2048, 4096, 8192, 16384)


def _rank(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    start = time.perf_counter()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def init_time(world: int) -> float:
    """Median seconds a rank spends in ``init_process_group`` at this world size."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, server.port, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return statistics.median(times)


def store_rate(clients: int, keys_per_client: int = 200) -> float:
    """Reads per second one TCPStore server answers to ``clients`` concurrent clients."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    stores = [dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(clients)]
    for i, s in enumerate(stores):
        s.set(f"addr/{i}", "x" * 64)
    barrier = threading.Barrier(clients + 1)

    def reads(s: Any) -> None:
        barrier.wait()
        for k in range(keys_per_client):
            s.get(f"addr/{k % clients}")

    threads = [threading.Thread(target=reads, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return clients * keys_per_client / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8", help="gloo world sizes (default 2,4,8)")
    parser.add_argument("--clients", type=int, default=8, help="store clients (default 8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds {args.worlds!r} must be comma-separated integers, e.g. 2,4,8")
    inits = {}
    for w in worlds:
        print(f"  init_process_group(gloo) with {w} ranks", file=sys.stderr, flush=True)
        inits[w] = init_time(w)
    rate = store_rate(args.clients)
    rows = [{"ranks": n, "gloo_store_reads": n * n, "gloo_store_s": n * n / rate,
             "nccl_store_s": n / rate} for n in SCALES]
    result = {"benchmark": "regroup_scale", "init_s": inits, "store_reads_per_s": rate,
              "rows": rows}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    for w, s in inits.items():
        print(f"init_process_group(gloo), {w} ranks: {s * 1e3:.1f} ms per rank (median)")
    print(f"TCPStore server: {rate:,.0f} reads/s with {args.clients} clients")
    print("ranks | gloo store reads | gloo store time | nccl store time")
    for r in rows:
        print(f"{r['ranks']} | {r['gloo_store_reads']:,} | {r['gloo_store_s']:.1f} s | "
              f"{r['nccl_store_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
