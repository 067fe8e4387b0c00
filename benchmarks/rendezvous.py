"""Group formation and lost-node detection: etcd-v3 vs c10d rendezvous, N agents, one run.

Each agent is its own process running torch's ``DynamicRendezvousHandler`` (the same code a
torchrun agent runs), created through torch's handler registry with backend ``etcd-v3`` (a real
local etcd) or ``c10d`` (TCPStore hosted by agent 0). Measured per (backend, N):

- formation: from the moment the first agent calls ``next_rendezvous`` (all are released by
  one "go" file) until the last agent has its rank, in seconds;
- keep-alive detection: after SIGKILL of the last agent, until the first survivor's view of the
  rendezvous state no longer lists it (torch's heartbeat protocol, identical for both backends:
  ``keep_alive_interval`` x ``keep_alive_max_attempt``, compared on wall clocks);
- lease detection (etcd-v3 only): until the first survivor's ``NodeLiveness`` watch reports the
  node ``left`` (its lease expired in etcd; no wall clocks compared).

Both detections use the same nominal budget (--timeout seconds: keep-alive 1 s x timeout,
lease TTL = timeout). Timestamps are ``time.time()`` of processes on one machine.

Usage: python benchmarks/rendezvous.py [--sizes 2 3 4] [--timeout 3] [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("c10d", "etcd-v3")


# -- agent process ----------------------------------------------------------------------------


def _agent(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from chameleon_elastic.rendezvous.registration import register

    register()
    out = Path(args.out)
    conf: dict[str, Any] = {
        "join_timeout": "60", "last_call_timeout": "1", "close_timeout": "10",
        "keep_alive_interval": "1", "keep_alive_max_attempt": str(args.timeout),
        "heartbeat_timeout": "10", "read_timeout": "60",
    }
    if args.backend == "c10d":
        conf["is_host"] = "true" if args.index == 0 else "false"
    params = RendezvousParameters(args.backend, args.endpoint, args.run_id, args.n, args.n,
                                  local_addr="127.0.0.1", **conf)
    handler = get_rendezvous_handler(params)
    left_at: list[float] = []
    if args.backend == "etcd-v3":
        from chameleon_elastic.rendezvous.client import EtcdClient
        from chameleon_elastic.rendezvous.config import EtcdSettings
        from chameleon_elastic.rendezvous.liveness import NodeLiveness

        settings = EtcdSettings.from_config(args.endpoint)
        liveness = NodeLiveness(
            EtcdClient(settings), settings.run_prefix(args.run_id), f"a{args.index}",
            ttl=args.timeout,
            on_event=lambda e: left_at.append(time.time()) if e.kind == "left" else None,
        )
        liveness.start()
    (out / f"ready-{args.index}").touch()
    go = out / "go"
    while not go.exists():
        time.sleep(0.001)
    t0 = time.time()
    info = handler.next_rendezvous()
    t1 = time.time()
    (out / f"formed-{args.index}.json").write_text(
        json.dumps({"t0": t0, "t1": t1, "rank": info.rank, "pid": os.getpid()}))
    victim = args.n - 1
    if args.index == victim:
        while True:  # wait to be killed, heartbeating through the handler's timer
            time.sleep(1)
    deadline = time.monotonic() + 60
    keep_alive_at = None
    while time.monotonic() < deadline and (keep_alive_at is None or
                                           (args.backend == "etcd-v3" and not left_at)):
        if keep_alive_at is None:
            handler.num_nodes_waiting()  # syncs the state (sanitising dead nodes)
            if len(handler._state_holder.state.participants) < args.n:
                keep_alive_at = time.time()
        time.sleep(0.02)
    (out / f"detected-{args.index}.json").write_text(json.dumps(
        {"keep_alive": keep_alive_at, "lease": left_at[0] if left_at else None}))
    done = out / "done"  # agent 0 may host the c10d store: stay until everybody reported
    while not done.exists() and time.monotonic() < deadline + 60:
        time.sleep(0.01)
    os._exit(0)  # the rendezvous is left for dead on purpose; no shutdown round trip


# -- driver -----------------------------------------------------------------------------------


def _wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"timed out waiting for {what}")


def _one(backend: str, n: int, timeout: int, endpoint: str, run_id: str) -> dict[str, Any]:
    from chameleon_elastic.rendezvous.local_etcd import free_port

    if backend == "c10d":
        endpoint = f"127.0.0.1:{free_port()}"
    out = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for index in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--agent", "--backend", backend, "--endpoint",
                 endpoint, "--run-id", run_id, "--n", str(n), "--index", str(index),
                 "--timeout", str(timeout), "--out", str(out)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
            if backend == "c10d" and index == 0:
                _wait("the c10d host", lambda: (out / "ready-0").exists(), 120)
        _wait("agents ready", lambda: all((out / f"ready-{i}").exists() for i in range(n)), 120)
        (out / "go").touch()
        formed = _wait("the group", lambda: [json.loads((out / f"formed-{i}.json").read_text())
                                             for i in range(n)]
                       if all((out / f"formed-{i}.json").exists() for i in range(n)) else None,
                       120)
        killed_at = time.time()
        os.kill(procs[n - 1].pid, signal.SIGKILL)
        survivors = range(n - 1)
        detected = _wait("detection", lambda: [json.loads((out / f"detected-{i}.json").read_text())
                                               for i in survivors]
                         if all((out / f"detected-{i}.json").exists() for i in survivors)
                         else None, 90)
        (out / "done").touch()
        keep = [d["keep_alive"] for d in detected if d["keep_alive"]]
        lease = [d["lease"] for d in detected if d["lease"]]
        return {
            "backend": backend, "n": n,
            "formation_s": max(f["t1"] for f in formed) - min(f["t0"] for f in formed),
            "keepalive_detect_s": (min(keep) - killed_at) if keep else None,
            "lease_detect_s": (min(lease) - killed_at) if lease else None,
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(out, ignore_errors=True)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--timeout", type=int, default=3,
                        help="detection budget in seconds (lease TTL; keep-alive 1 s x this)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--backend", "--endpoint", "--run-id", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent:
        return _agent(args)
    if args.timeout < 2 or min(args.sizes) < 2 or args.repeats < 1:
        parser.error("need --timeout >= 2 (etcd's minimum lease), sizes >= 2, repeats >= 1")

    from chameleon_elastic.rendezvous.local_etcd import LocalEtcd

    rows = []
    with LocalEtcd() as etcd:
        for n in args.sizes:
            for backend in BACKENDS:
                runs = [_one(backend, n, args.timeout, etcd.endpoint, f"bench-{backend}-{n}-{r}")
                        for r in range(args.repeats)]

                def median(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
                    values = [r[key] for r in runs if r[key] is not None]
                    return statistics.median(values) if values else None

                rows.append({"backend": backend, "n": n, "repeats": args.repeats,
                             "formation_s": median("formation_s"),
                             "keepalive_detect_s": median("keepalive_detect_s"),
                             "lease_detect_s": median("lease_detect_s")})
    result = {"timeout_s": args.timeout, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"rendezvous benchmark (median of {args.repeats}; detection budget {args.timeout} s)")
    print(f"{'N':>3} {'backend':<8} {'formation s':>12} {'keep-alive detect s':>20} "
          f"{'lease detect s':>15}")
    for row in rows:
        print(f"{row['n']:>3} {row['backend']:<8} {_fmt(row['formation_s']):>12} "
              f"{_fmt(row['keepalive_detect_s']):>20} {_fmt(row['lease_detect_s']):>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
