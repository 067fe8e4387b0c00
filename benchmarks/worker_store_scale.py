"""One generation's worker store with thousands of clients: where it stops.

Every generation, the deciding agent opens one TCPStore (launcher/coordination/rounds.py) and every rank of
the job connects to it to form the world (runtime/world/join.py). This simulates those ranks: N
clients, spread over ``--procs`` processes and ``--threads`` threads each, against one server
in this process, as the agent hosts it. Each client does what a rank's regroup does with lazy
gloo pairs (runtime/world/regroup.py): connect, write its address (64 bytes), read its two ring
neighbours' addresses (waiting until they are written), and count itself in (``add``, as
torch's barriers do). Reported per backend (libuv, torch's default since 2.4, and the legacy
one) and client count: the time for every client to connect, then for every client's
operations, and the operations per second the server answered; a run that fails (refused
connections, timeouts) says how.

torch looks up the name of every client socket's address when it connects (a warning, "The
hostname of the client socket cannot be retrieved", where that fails). Where no DNS server
answers (this machine's sandbox), each lookup waits out the resolver's timeout, 5 s by default,
and the connections come in waves 5-10 s apart; the benchmark sets ``RES_OPTIONS`` to a 1 s
timeout and one attempt (glibc's resolver reads it) unless it is set already, so its connect
times are still an upper bound there.

    python benchmarks/worker_store_scale.py [--clients 1024,4096,16384] [--backends libuv,legacy]
        [--procs 8] [--threads 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from typing import Any

OPS_PER_CLIENT = 4   # set, two gets, add


def _clients(first: int, count: int, total: int, port: int, threads: int, go: Any,
             out: Any) -> None:
    """``count`` clients on ``threads`` threads: connect all (timed), then at ``go`` do each
    client's operations (timed); puts (connected at, done at, error)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=120)
    stores: list[Any] = [None] * count
    errors: list[str] = []

    def connect(part: range) -> None:
        for i in part:
            try:
                stores[i] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout,
                                          wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001 - reported
                errors.append(f"client {first + i} could not connect: {exc}")
                return

    def work(part: range) -> None:
        """A thread's clients write first, then read: a thread reading for one client
        before writing for the next would wait on itself (a rank is one client, and
        writes before it reads)."""
        try:
            for i in part:
                stores[i].set(f"addr/{first + i}", "x" * 64)
            for i in part:
                rank = first + i
                stores[i].get(f"addr/{(rank + 1) % total}")
                stores[i].get(f"addr/{(rank - 1) % total}")
                stores[i].add("joined", 1)
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"{str(exc).splitlines()[0]}")

    parts = [range(t, count, threads) for t in range(threads)]
    start = time.monotonic()
    _run(connect, parts)
    connected = time.monotonic()
    out.put(("connected", connected - start, errors[:1]))
    begin = go.get()
    _run(work, parts)
    out.put(("done", time.monotonic() - begin, errors[:1]))
    go.get()   # the parent has read the count: the clients may go


def _run(fn: Any, parts: list[range]) -> None:
    threads = [threading.Thread(target=fn, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(clients: int, libuv: bool, procs: int, threads: int) -> dict[str, Any]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120), use_libuv=libuv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gos = [ctx.Queue() for _ in range(procs)]
    bounds = [(i * clients // procs, (i + 1) * clients // procs) for i in range(procs)]
    children = [ctx.Process(target=_clients, args=(lo, hi - lo, clients, server.port, threads,
                                                   gos[i], out))
                for i, (lo, hi) in enumerate(bounds)]
    for c in children:
        c.start()
    row: dict[str, Any] = {"clients": clients, "backend": "libuv" if libuv else "legacy"}
    try:
        got = [out.get(timeout=600) for _ in children]
        row["connect_s"] = max(g[1] for g in got)
        errors = [e for g in got for e in g[2]]
        if not errors:
            start = time.monotonic()
            for go in gos:
                go.put(start)
            got = [out.get(timeout=600) for _ in children]
            row["operations_s"] = max(g[1] for g in got)
            row["ops_per_s"] = clients * OPS_PER_CLIENT / row["operations_s"]
            errors = [e for g in got for e in g[2]]
            if not errors and int(server.add("joined", 0)) != clients:
                errors.append(f"{server.add('joined', 0)} of {clients} clients counted in")
        row["error"] = errors[0] if errors else None
    finally:
        for go in gos:
            go.put(None)
            go.put(None)
        for c in children:
            c.join(timeout=60)
            if c.is_alive():
                c.kill()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1024,4096,16384",
                        help="client counts (default 1024,4096,16384)")
    parser.add_argument("--backends", default="libuv,legacy",
                        help="server backends: libuv and/or legacy (default both)")
    parser.add_argument("--procs", type=int, default=8, help="client processes (default 8)")
    parser.add_argument("--threads", type=int, default=32,
                        help="threads per client process (default 32)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")   # see the docstring
    try:
        counts = [int(c) for c in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients {args.clients!r} must be comma-separated integers")
    backends = args.backends.split(",")
    if not set(backends) <= {"libuv", "legacy"} or min(counts) < 1 or args.procs < 1 \
            or args.threads < 1:
        parser.error("--backends takes libuv and/or legacy; --clients, --procs and --threads "
                     "must be positive")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(counts) + 100 > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(counts) + 1000), hard))
        except (ValueError, OSError):
            pass
    rows = []
    for n in counts:
        for backend in backends:
            print(f"  {n} clients, {backend} server", file=sys.stderr, flush=True)
            rows.append(measure(n, backend == "libuv", min(args.procs, n), args.threads))
    if args.json:
        json.dump({"benchmark": "worker_store_scale", "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print("clients | server | connect all | operations (4 per client) | ops/s | error")
    for r in rows:
        ops = (f"{r['operations_s']:.2f} s | {r['ops_per_s']:,.0f}" if "operations_s" in r
               else "- | -")
        print(f"{r['clients']} | {r['backend']} | {r['connect_s']:.2f} s | {ops} | "
              f"{r['error'] or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
