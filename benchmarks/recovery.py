"""Crash-to-running-again time and recovery success rate: chameleon-run vs torchrun.

Same script, same flags, side by side in one run. Each trial is one job: ``--standalone
--nproc-per-node N --max-restarts 1``; every worker joins a gloo process group and runs an
all-reduce ("running"); on the first launch rank 0 then crashes (exit 1). A trial succeeds when
the relaunched group is running again and the job exits 0 within ``--deadline`` seconds.

    crash-to-running = (last rank's "running" time in launch 2) - (rank 0's crash time)

This covers failure detection, stopping the group, rendezvous, process start, the worker's
``import torch`` and ``init_process_group`` - what a user waits for. Trials alternate between the
launchers so that machine load drifts affect both alike. Prints a table; ``--json`` prints JSON.

    python benchmarks/recovery.py --trials 10
    python benchmarks/recovery.py --trials 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "chameleon-run": [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--no-status"],
}


def worker(out: str) -> None:
    """The training script under test (also runs unmodified under torchrun)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    assert int(t[0]) == dist.get_world_size()
    _note(out, {"event": "running", "restart": restart, "rank": rank, "t": time.time()})
    if restart == 0:
        if rank == 0:
            _note(out, {"event": "crash", "restart": restart, "rank": rank, "t": time.time()})
            os._exit(1)
        time.sleep(120)  # stopped by the launcher when rank 0 fails
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


def _note(out: str, record: dict) -> None:
    with open(os.path.join(out, f"events-{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _read(out: Path) -> list[dict]:
    records = []
    for path in out.glob("events-*.jsonl"):
        records += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return records


def trial(tool: str, nproc: int, deadline: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        out = Path(tmp)
        cmd = [*LAUNCHERS[tool], "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "1", "--monitor-interval", "0.1",
               str(Path(__file__).resolve()), "--as-worker", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=deadline)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code, hung = None, True
        wall = time.monotonic() - start
        records = _read(out)
    crash = [r["t"] for r in records if r["event"] == "crash"]
    again = [r for r in records if r["event"] == "running" and r["restart"] == 1]
    recovered = bool(crash) and len({r["rank"] for r in again}) == nproc and code == 0
    seconds = (max(r["t"] for r in again) - crash[0]) if recovered else None
    return {"tool": tool, "exit_code": code, "hung": hung, "recovered": recovered,
            "crash_to_running_s": seconds, "wall_s": wall}


def summarise(results: list[dict]) -> dict[str, dict]:
    table = {}
    for tool in LAUNCHERS:
        mine = [r for r in results if r["tool"] == tool]
        times = [r["crash_to_running_s"] for r in mine if r["recovered"]]
        table[tool] = {
            "trials": len(mine),
            "recovered": sum(r["recovered"] for r in mine),
            "success_rate": (sum(r["recovered"] for r in mine) / len(mine)) if mine else None,
            "hung": sum(r["hung"] for r in mine),
            "median_s": statistics.median(times) if times else None,
            "min_s": min(times) if times else None,
            "max_s": max(times) if times else None,
        }
    return table


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--as-worker":
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per launcher (>= 10)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=90.0,
                        help="seconds before a trial counts as hung and is killed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--table-from", metavar="FILE",
                        help="print the table of a saved --json report and exit")
    args = parser.parse_args()
    if args.table_from:
        report = json.loads(Path(args.table_from).read_text())
        print_table(report["summary"], report["nproc_per_node"], report["trials"])
        return
    if args.trials < 1 or args.nproc < 2:
        parser.error("--trials must be >= 1 and --nproc >= 2 (a crash needs a peer to affect).")

    results = []
    for i in range(args.trials):
        for tool in (LAUNCHERS if i % 2 == 0 else reversed(list(LAUNCHERS))):
            results.append(trial(tool, args.nproc, args.deadline))
            r = results[-1]
            t = r["crash_to_running_s"]
            print(f"  trial {i + 1:2d} {tool:13s} recovered={r['recovered']!s:5s} "
                  f"exit={r['exit_code']} crash->running="
                  f"{'-' if t is None else f'{t:.2f} s'}", file=sys.stderr, flush=True)
    table = summarise(results)
    report = {"benchmark": "recovery", "nproc_per_node": args.nproc, "trials": args.trials,
              "deadline_s": args.deadline, "summary": table, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_table(table, args.nproc, args.trials)


def print_table(table: dict, nproc: int, trials: int) -> None:
    print(f"\ncrash-to-running-again, one node, {nproc} gloo workers, "
          f"{trials} trials each (same script, same flags)")
    print(f"{'launcher':14s} {'recovered':>10s} {'hung':>5s} {'median s':>9s} "
          f"{'min s':>7s} {'max s':>7s}")

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    for tool, row in table.items():
        print(f"{tool:14s} {row['recovered']:>4d}/{row['trials']:<5d} {row['hung']:>5d} "
              f"{fmt(row['median_s']):>9s} {fmt(row['min_s']):>7s} {fmt(row['max_s']):>7s}")


if __name__ == "__main__":
    main()
