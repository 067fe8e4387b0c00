"""Many threads creating etcd watches at once on one client: pyetcd's ``Watcher`` against our
``WatchStream`` (rendezvous/watch_stream.py), on a real etcd.

Why it matters: an agent's node watch and its store waits share one client, and the scale
benchmark's simulated agents share a client by the hundred (256 per client at 16384 nodes).
pyetcd sends one creation at a time per stream and wakes every waiting caller on each answer;
ours sends them as they come and wakes only the caller answered. Each thread waits at a barrier,
creates one watch on its own key, and the run ends when the last is confirmed; then one put per
key checks that each watch got its own key's event (a mixed-up answer would fail the run).

    python benchmarks/watch_creation.py [--threads 16,64,256] [--repeats 3] [--json]

Prints, per thread count and implementation, the median wall time from the barrier to the last
creation confirmed and the process's CPU time (user + system) over the same span.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd
from chameleon_elastic.rendezvous.pyetcd_compat import add_watch

IMPLEMENTATIONS = ("pyetcd", "ours")


def _create(impl: str, client: Any, key: str, callback: Any) -> Any:
    if impl == "ours":
        return add_watch(client, key, callback).cancel
    watch_id = client.watcher.add_callback(key, callback)   # what add_watch used before
    return lambda: client.watcher.cancel(watch_id)


def one_run(impl: str, settings: EtcdSettings, threads: int, run: int) -> dict[str, float]:
    """``threads`` threads creating one watch each at once on a fresh client."""
    with EtcdClient(settings) as etcd:
        client = etcd.client()
        client.get("/warm-up")   # the channel connected before the clock starts
        got: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads)]
        keys = [f"/wc/{impl}/{run}/{n}" for n in range(threads)]
        barrier = threading.Barrier(threads + 1)
        cancels: list[Any] = [None] * threads
        errors: list[BaseException] = []

        def create(n: int) -> None:
            def callback(response: Any, inbox: queue.SimpleQueue = got[n]) -> None:
                for event in getattr(response, "events", None) or ():
                    inbox.put(bytes(event.key).decode())
            barrier.wait()
            try:
                cancels[n] = _create(impl, client, keys[n], callback)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=create, args=(n,), daemon=True)
                   for n in range(threads)]
        for worker in workers:
            worker.start()
        barrier.wait()
        start, cpu = time.monotonic(), os.times()
        for worker in workers:
            worker.join()
        wall, end = time.monotonic() - start, os.times()
        if errors:
            raise RuntimeError(f"{impl}: {len(errors)} creations failed: {errors[0]!r}")
        for key in keys:
            client.put(key, b"x")
        for n, key in enumerate(keys):
            if got[n].get(timeout=30) != key:
                raise RuntimeError(f"{impl}: watch {n} received another key's event")
        for cancel in cancels:
            cancel()
        return {"wall_s": wall,
                "cpu_s": (end.user - cpu.user) + (end.system - cpu.system)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="16,64,256",
                        help="comma-separated thread counts (default 16,64,256)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per thread count and implementation, alternating "
                             "(default 3); the medians are reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r}: comma-separated integers, e.g. 16,64")
    rows = []
    with LocalEtcd(data_dir=None) as server:
        settings = EtcdSettings.from_config(server.endpoint, {})
        for threads in counts:
            runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLEMENTATIONS}
            for run in range(args.repeats):
                for impl in IMPLEMENTATIONS:
                    runs[impl].append(one_run(impl, settings, threads, run))
            for impl in IMPLEMENTATIONS:
                rows.append({"threads": threads, "watcher": impl,
                             "wall_s": statistics.median(r["wall_s"] for r in runs[impl]),
                             "cpu_s": statistics.median(r["cpu_s"] for r in runs[impl]),
                             "runs": args.repeats})
            print(f"  {threads} threads done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"benchmark": "watch_creation", "rows": rows}, indent=2))
        return 0
    print("| threads | watcher | all created (median) | CPU, user + system |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['threads']} | {row['watcher']} | {row['wall_s']:.3f} s | "
              f"{row['cpu_s']:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
