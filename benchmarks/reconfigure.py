"""Does torch's in-place reconfiguration (2.14+) release a gloo collective blocked on a lost peer?

Issue 46, part 3. A survivor's recovery has two jobs: make the collective its training thread is
blocked in return (a peer that *died* resets its sockets; one that is *stopped*, SIGSTOP or a
frozen node, keeps them open, and gloo has no abort), then form the world of the survivors. Today
the first is our socket cut (runtime/world/abort.py ``shut_down``, from the watchdog's thread when
the agents publish the next generation) and the second a fresh ``init_process_group`` on the new
generation's store prefix (runtime/world/join.py). torch 2.14 added
``init_process_group(..., enable_reconfigure=True)`` with ``dist._get_reconfigure_handle`` and
``dist._reconfigure(uuid, handles)``: the same group re-formed over new members, the way
torchft 0.3 recovers. If it also released the blocked collective, it could be the one regroup of
every backend (gloo in CI, nccl2 on GPUs); this measures whether it does, and what it costs.

Each trial: N gloo processes on loopback (N = 4), one TCPStore server in this process, a fresh
store prefix per trial. Every rank forms the world and checks it with an all-reduce; then every
rank but the victim (rank 1) enters an all-reduce that cannot complete (the victim never
contributes), and this process SIGKILLs or SIGSTOPs the victim (confirmed in /proc), then tells
each survivor's control thread (a pipe: the agent's bell). What each path does then:

    cut-init         today's: the control thread cuts the world's sockets (abort.shut_down); the
                     training thread, released, takes the world out of torch's books (freed on a
                     thread, abort.free_later) and calls init_process_group over N-1 ranks on a
                     new prefix
    reconfigure      a world made with enable_reconfigure=True; the control thread aborts the
                     group (``ProcessGroup.abort()``, all torch offers it) and calls
                     ``dist._reconfigure`` with the survivors' handles, then checks the new world
                     with an all-reduce of its own; the training thread goes on when its
                     blocked call returns, with one more all-reduce
    cut-reconfigure  the two together: our cut releases the call, the training thread
                     reconfigures instead of calling init_process_group
    none             nothing: how the blocked call ends by itself, then as cut-init

Measured from the signal (CLOCK_MONOTONIC is one clock for every process): when each survivor's
blocked call returned and how (its error's first line), the regroup call's own time
(init_process_group or _reconfigure), and when the training thread's first all-reduce on the new
world of N-1 succeeded (for ``reconfigure`` also the control thread's, which needs no released
call). A trial's figure is its slowest survivor's. A call "released" returned before the
collective timeout (``--timeout-s``, 5 s) and not with gloo's "Timed out". Every wait is bounded;
every process is killed and reaped at the end of its trial (the stopped one too), and dies with
this one (PR_SET_PDEATHSIG).

On a torch without reconfiguration (2.13) it says so in one line and measures cut-init and none.

    PYTHONPATH=. python benchmarks/reconfigure.py [--reps 10] [--ranks 4] [--faults kill,stop]
        [--paths cut-init,reconfigure,cut-reconfigure,none] [--timeout-s 5] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from chameleon_elastic.hang import quantile

PATHS = ("cut-init", "reconfigure", "cut-reconfigure", "none")
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
#: the lost rank: neither the first nor the last, so the ring has survivors on both sides
VICTIM = 1
#: after the survivors said they enter the all-reduce, before the fault: they are blocked then
SETTLE_S = 0.2
#: a trial's waits are each bounded (a minute or so at most); past this the benchmark prints
#: where it is stuck and ends, its ranks with it (PR_SET_PDEATHSIG): the rows so far are on
#: stderr, one JSON line each
TRIAL_BUDGET_S = 400.0
_PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------ inside a rank's process

def _die_with_parent() -> None:
    """SIGKILL this process when the benchmark dies (Linux), so nothing outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _check(size: int) -> None:
    """An all-reduce of ones over the current world; raises unless it sums to ``size``."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if int(t[0].item()) != size:
        raise RuntimeError(f"all-reduce gave {t[0].item()}, expected {size}")


def _exchange(store: Any, key: str, rank: int, n: int, mine: str) -> list[str]:
    """Every rank's ``mine`` in rank order, through the store (the out-of-band rendezvous
    ``_reconfigure`` needs: the agents' generation record would carry them)."""
    store.set(f"{key}/{rank}", mine)
    return [store.get(f"{key}/{r}").decode() for r in range(n)]


def _form(store: Any, prefix: str, rank: int, n: int, path: str,
          timeout: timedelta) -> tuple[frozenset, list[str]]:
    """The first world, as each path makes it; its sockets (recorded as the runtime does) and,
    for the reconfigure paths, every rank's handle after the first reconfigure."""
    import torch.distributed as dist

    from chameleon_elastic.runtime.world.abort import new_sockets

    reconf = path in ("reconfigure", "cut-reconfigure")
    extra = {"enable_reconfigure": True} if reconf else {}
    with new_sockets() as sockets:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/gen0/", store),
                                rank=rank, world_size=n, timeout=timeout, **extra)
        if reconf:   # a reconfigurable world connects nothing before its first reconfigure
            first = _exchange(store, f"{prefix}/h0", rank, n, dist._get_reconfigure_handle())
            dist._reconfigure(1, first, timeout=timeout).wait()
    handles = (_exchange(store, f"{prefix}/h1", rank, n, dist._get_reconfigure_handle())
               if reconf else [])
    return frozenset(sockets), handles


def _regroup(path: str, store: Any, prefix: str, rank: int, size: int, handles: list[str],
             timeout: timedelta) -> float:
    """Form the survivors' world: a new init_process_group on a new prefix (today's), or a
    reconfigure with the survivors' handles; returns the call's seconds."""
    import torch.distributed as dist

    from chameleon_elastic.runtime.world.abort import free_later

    began = time.monotonic()
    if path in ("reconfigure", "cut-reconfigure"):
        dist._reconfigure(2, handles, timeout=timeout).wait()
    else:
        old = [dist.group.WORLD]
        dist.destroy_process_group()   # out of torch's books; freed on a thread, as the runtime
        free_later(old)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/gen1/", store),
                                rank=rank, world_size=size, timeout=timeout)
    return time.monotonic() - began


def _control(conn: Any, path: str, sockets: frozenset, regroup: Any, out: dict[str, Any],
             told: threading.Event) -> None:
    """The survivor's second thread (the runtime's watchdog): on the fault, cut (the cut paths)
    or abort and reconfigure (``reconfigure``, which then checks the new world itself)."""
    import torch.distributed as dist

    from chameleon_elastic.runtime.world.abort import shut_down

    try:
        conn.recv()
        out["noticed"] = time.monotonic()
        if path in ("cut-init", "cut-reconfigure"):
            shut_down(sockets)
        elif path == "reconfigure":
            dist.distributed_c10d._get_default_group().abort()
            out["regroup_s"] = regroup()
            _check(out["size"])
            out["world_ready"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["control_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        told.set()


def _survive(conn: Any, store: Any, prefix: str, rank: int, n: int, path: str,
             formed: tuple[frozenset, list[str]], timeout_s: float) -> dict[str, Any]:
    """Block in an all-reduce the victim never joins; after the fault, regroup per ``path``
    and check the new world from this (the training) thread. Times are CLOCK_MONOTONIC."""
    import torch
    import torch.distributed as dist

    sockets, handles = formed
    size, timeout = n - 1, timedelta(seconds=timeout_s)
    new_rank = rank - (rank > VICTIM)
    kept = [h for r, h in enumerate(handles) if r != VICTIM]
    out: dict[str, Any] = {"rank": rank, "size": size}
    told = threading.Event()

    def regroup() -> float:
        return _regroup(path, store, prefix, new_rank, size, kept, timeout)

    control = threading.Thread(target=_control, args=(conn, path, sockets, regroup, out, told),
                               daemon=True)
    control.start()
    conn.send(("entering", time.monotonic()))
    try:
        dist.all_reduce(torch.ones(4))
        out["ended"] = "completed"
    except RuntimeError as exc:
        out["ended"] = str(exc).splitlines()[0][:200]
    out["returned"] = time.monotonic()
    if not told.wait(timeout_s + 10):   # the generation never came: nothing to regroup into
        out["error"] = "no fault notice"
        return out
    try:
        if path != "reconfigure":
            out["regroup_s"] = regroup()
        elif "world_ready" not in out:
            raise RuntimeError(out.get("control_error", "the control thread did not regroup"))
        _check(size)
        out["ready"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def _rank(rank: int, n: int, port: int, prefix: str, path: str, conn: Any,
          timeout_s: float) -> None:
    """One rank's process: form the world, check it, say ready; the victim then waits for its
    fault, a survivor blocks, recovers and reports. Leaves with ``os._exit`` when told."""
    _die_with_parent()
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=60))
        formed = _form(store, prefix, rank, n, path, timedelta(seconds=timeout_s))
        _check(n)
        conn.send(("ready", os.getpid()))
        if rank == VICTIM:
            conn.recv()   # killed or stopped before anything comes; "exit" otherwise
            os._exit(0)
        conn.send(("result", _survive(conn, store, prefix, rank, n, path, formed, timeout_s)))
        conn.recv()   # "exit": peers may still be finishing their checks with this rank
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"[:300]))
        except OSError:
            pass
    os._exit(0)


# ------------------------------------------------------------------ the benchmark's process

def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T stopped, Z dead), '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _strike(pid: int, fault: str, deadline_s: float = 5.0) -> float:
    """Signal the victim; returns when /proc shows it stopped or dead, the signal's time."""
    at = time.monotonic()
    os.kill(pid, FAULTS[fault])
    want = {"T", "t"} if fault == "stop" else {"Z", "X", ""}
    while _state(pid) not in want:
        if time.monotonic() - at > deadline_s:
            raise RuntimeError(f"the victim (pid {pid}) is still {_state(pid)!r} after "
                               f"{deadline_s:g} s of {FAULTS[fault].name}")
        time.sleep(0.001)
    return at


def _expect(conn: Any, kind: str, deadline: float) -> Any:
    """The next message of ``kind`` from a rank, before ``deadline`` (monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0 or not conn.poll(left):
        raise TimeoutError(f"no {kind!r} message before the deadline")
    got, value = conn.recv()
    if got != kind:
        raise RuntimeError(f"expected {kind!r}, got {got!r}: {value}")
    return value


def _cleanup(procs: list[Any], conns: list[Any]) -> None:
    """Tell every rank to leave, kill what is left (the stopped victim: SIGKILL ends a stopped
    process) and reap all of them, each wait bounded."""
    for conn in conns:
        try:
            conn.send(("exit", None))
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=5)
    for conn in conns:
        conn.close()


def trial(fault: str, path: str, n: int, port: int, index: int,
          timeout_s: float) -> dict[str, Any]:
    """One fault on one path; the per-survivor times are relative to the signal."""
    ctx = mp.get_context("forkserver")   # torch imported once, in the server (run)
    pipes = [ctx.Pipe() for _ in range(n)]
    prefix = f"t{index}-{fault}-{path}"
    procs = [ctx.Process(target=_rank, args=(r, n, port, prefix, path, pipes[r][1], timeout_s),
                         daemon=True) for r in range(n)]
    conns = [p[0] for p in pipes]
    row: dict[str, Any] = {"fault": fault, "path": path, "trial": index}
    try:
        for p in procs:
            p.start()
        start = time.monotonic() + 180
        pids = [_expect(c, "ready", start) for c in conns]
        survivors = [r for r in range(n) if r != VICTIM]
        for r in survivors:
            _expect(conns[r], "entering", time.monotonic() + 30)
        time.sleep(SETTLE_S)
        row["blocked"] = not any(conns[r].poll(0) for r in survivors)
        at = _strike(pids[VICTIM], fault)
        for r in survivors:
            conns[r].send(("fault", at))
        deadline = time.monotonic() + 3 * timeout_s + 20
        row["survivors"] = [_relative(_expect(conns[r], "result", deadline), at)
                            for r in survivors]
    except (TimeoutError, RuntimeError, OSError, EOFError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _cleanup(procs, conns)
    return _judge(row, timeout_s)


def _relative(result: dict[str, Any], at: float) -> dict[str, Any]:
    for key in ("noticed", "returned", "world_ready", "ready"):
        if key in result:
            result[f"{key}_s"] = round(result.pop(key) - at, 6)
    return result


def _judge(row: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """A trial's figures: its slowest survivor's; released when every blocked call returned
    before the collective timeout and not with gloo's timeout."""
    survivors = row.get("survivors", [])
    errors = [s["error"] for s in survivors if "error" in s]
    if errors and "error" not in row:
        row["error"] = errors[0]
    if not survivors or "error" in row:
        row["released"] = False
        return row
    row["released"] = all("timed out" not in s["ended"].lower()
                          and s["returned_s"] < timeout_s for s in survivors)
    for key in ("returned_s", "regroup_s", "world_ready_s", "ready_s"):
        values = [s[key] for s in survivors if key in s]
        if len(values) == len(survivors):
            row[key] = max(values)
    row["ended"] = sorted({_kind(s["ended"]) for s in survivors})
    return row


def _kind(ended: str) -> str:
    """How a blocked call ended, in a few words."""
    low = ended.lower()
    if "timed out" in low:
        return "gloo timeout"
    if "closed by peer" in low or "connection reset" in low or "broken pipe" in low:
        return "connection closed"
    return ended[:60]


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault and path: trials, released, and median / p90 / max of each time."""
    out = []
    for fault in dict.fromkeys(r["fault"] for r in rows):
        for path in dict.fromkeys(r["path"] for r in rows if r["fault"] == fault):
            mine = [r for r in rows if r["fault"] == fault and r["path"] == path]
            cell: dict[str, Any] = {"fault": fault, "path": path, "trials": len(mine),
                                    "released": sum(r["released"] for r in mine),
                                    "failed": sum("error" in r for r in mine),
                                    "ended": sorted({k for r in mine for k in r.get("ended", [])})}
            for key in ("returned_s", "regroup_s", "world_ready_s", "ready_s"):
                values = [r[key] for r in mine if key in r]
                if values:
                    cell[key] = {"median": statistics.median(values),
                                 "p90": quantile(values, 0.9), "max": max(values)}
            out.append(cell)
    return out


def _ms(stats: dict[str, float] | None) -> str:
    if not stats:
        return "-"
    return "/".join(f"{stats[k] * 1e3:.1f}" for k in ("median", "p90", "max"))


def print_table(report: dict[str, Any]) -> None:
    print(f"torch {report['torch']}, {report['ranks']} gloo ranks, rank {VICTIM} lost, "
          f"{report['reps']} trials, collective timeout {report['timeout_s']:g} s; "
          "ms as median/p90/max from the signal")
    print("fault | path | released | blocked call returned | regroup call | "
          "new world works (training thread) | (control thread) | how the call ended")
    for c in report["summary"]:
        failed = f", {c['failed']} failed" if c["failed"] else ""
        print(f"{c['fault']} | {c['path']} | {c['released']}/{c['trials']}{failed} | "
              f"{_ms(c.get('returned_s'))} | {_ms(c.get('regroup_s'))} | "
              f"{_ms(c.get('ready_s'))} | {_ms(c.get('world_ready_s'))} | "
              f"{', '.join(c['ended'])}")


def supported() -> bool:
    """Whether this torch can reconfigure a gloo world (torch_compat decides)."""
    from chameleon_elastic import torch_compat

    return torch_compat.supports_reconfigure()


def run(faults: list[str], paths: list[str], reps: int, n: int,
        timeout_s: float) -> list[dict[str, Any]]:
    """Every fault x path, ``reps`` times, interleaved (one of each in turn), so that a slow
    minute of the shared machine falls on every path alike."""
    import torch.distributed as dist

    mp.get_context("forkserver").set_forkserver_preload(
        ["torch.distributed", "chameleon_elastic.runtime.world.abort"])
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    rows = []
    for index in range(reps):
        for fault in faults:
            for path in paths:
                faulthandler.dump_traceback_later(TRIAL_BUDGET_S, exit=True)
                row = trial(fault, path, n, server.port, index, timeout_s)
                faulthandler.cancel_dump_traceback_later()
                print(f"  {fault} {path} #{index}: released={row['released']} "
                      f"returned={row.get('returned_s')} ready={row.get('ready_s')} "
                      f"{row.get('error', '')}\n  row {json.dumps(row)}",
                      file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="trials per fault and path")
    parser.add_argument("--ranks", type=int, default=4, help="gloo processes (default 4)")
    parser.add_argument("--faults", default="kill,stop", help="kill and/or stop")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"a subset of {PATHS}")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="the groups' collective timeout (default 5 s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    faults, paths = args.faults.split(","), args.paths.split(",")
    if (not set(faults) <= set(FAULTS) or not set(paths) <= set(PATHS) or args.ranks < 3
            or args.reps < 1 or args.timeout_s <= 0):
        parser.error(f"--faults takes {','.join(FAULTS)}, --paths {','.join(PATHS)}; "
                     "--ranks 3 or more, --reps 1 or more")
    import torch

    can = supported()
    if not can:
        dropped = [p for p in paths if "reconfigure" in p]
        paths = [p for p in paths if "reconfigure" not in p]
        print(f"torch {torch.__version__} cannot reconfigure a process group (torch >= 2.14 "
              f"can): measuring {', '.join(paths)} only, not {', '.join(dropped)}",
              file=sys.stderr if args.json else sys.stdout, flush=True)
    load_before = os.getloadavg()
    rows = run(faults, paths, args.reps, args.ranks, args.timeout_s)
    report = {"benchmark": "reconfigure", "torch": torch.__version__,
              "reconfigure_supported": can, "ranks": args.ranks, "victim": VICTIM,
              "reps": args.reps, "timeout_s": args.timeout_s, "cpus": os.cpu_count(),
              "python": platform.python_version(),
              "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "summary": summarise(rows), "rows": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
