"""Post-recovery throughput with a standby node against without one, same job, same run.

    python benchmarks/standby.py [--rounds 2] [--steps 30] [--kill-at 8] [--json]
    python benchmarks/standby.py --table-from benchmarks/results/standby-<commit>.json

The job is (PP, DP) = (2, 2) over two nodes x two workers on loopback (etcd-v3, lease TTL 2 s),
``tests/launcher/workers/emulated.py``: 8 layers that take their time by sleeping (5 ms forward,
10 ms backward each), so on this 2-core machine every worker is a device of its own and step
times follow the layout, as on accelerators; a stage holds at most half the model (the job's
device memory), so no data-parallel-only layout competes. Two setups, alternating by round:

- ``standby``: a third node beyond the job's size (``cluster.devices = 6``): its two workers
  wait warm and idle outside the world;
- ``none``: the same two nodes alone (``cluster.devices = 4``).

After step ``--kill-at`` device 3's worker is SIGKILLed. The planner decides by score: with a
standby it swaps it in (the layout kept, one stage's layers moved), without one it reroutes or
re-plans on the three survivors. Measured from the reporting worker's wall times: steps per
second before the kill (steps 2 .. kill-at - 1) and after the recovery (from kill-at + 3 to the
end), the recovery's total (the ``recovered`` event: the fault to the first new step), the
policy chosen and the estimator's step times; and whether every loss equals a single-process
run (float64, rtol 1e-9).
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

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "launcher" / "workers" / "emulated.py"
JOB = """name = "standby-bench"
[model]
layers = 8
forward_s = 0.005
backward_s = 0.010
param_bytes = 1.0e6
optimizer_bytes = 2.0e6
activation_bytes = 2.0e5
[cluster]
devices = {devices}
devices_per_node = 2
device_memory_bytes = 2.5e7
bandwidth_bytes_per_s = 1e9
restart_s = 2.0
regroup_s = 0.3
failure_rate_per_hour = 0.1
[training]
dp = 2
pp = 2
global_micro_batches = 8
precision = "fp32"
"""
SETUPS = {"standby": 3, "none": 2}   # nodes


def reported(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _group_rank(state: Path) -> int | None:
    path = state / "events.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "rendezvous":
            return event["node"]
    return None


def run_job(setup: str, steps: int, kill_at: int, tmp: Path, endpoint: str,
            timeout_s: float = 180.0) -> dict:
    """One chameleon-run per node of the emulated job; device 3's worker SIGKILLed after step
    ``kill_at``: the reported steps, the deciding node's events and the exit codes."""
    nodes = SETUPS[setup]
    out = tmp / f"out-{setup}"
    out.mkdir(parents=True)
    job = tmp / f"{setup}.toml"
    job.write_text(JOB.format(devices=2 * nodes))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs, logs = [], []
    for n in range(nodes):
        logs.append(open(tmp / f"{setup}-{n}.log", "w"))  # noqa: SIM115 - closed below
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--nnodes", str(nodes),
             "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint,
             "--rdzv-id", f"{setup}-{tmp.name}", "--rdzv-conf",
             "last_call_timeout=5,lease_ttl=2", "--local-addr", "127.0.0.1",
             "--monitor-interval", "0.1", "--no-status", "--job", str(job),
             "--state-dir", str(tmp / f"{setup}-state-{n}"), str(WORKER), str(out), str(steps)],
            stdout=logs[-1], stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True))
    deadline = time.monotonic() + timeout_s
    killed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {setup} run did not finish in {timeout_s:.0f} s; see "
                                   f"{logs[0].name}")
            if killed_at is None and len(reported(out)) > kill_at:
                os.kill(int((out / "pid-3").read_text().split()[0]), signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.02)   # polling the steps file, not synchronising with the job
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    decider = next(n for n in range(nodes) if _group_rank(tmp / f"{setup}-state-{n}") == 0)
    events = [json.loads(x) for x in
              (tmp / f"{setup}-state-{decider}" / "events.jsonl").read_text().splitlines()]
    return {"rc": [p.returncode for p in procs], "steps": reported(out), "events": events,
            "killed_at": killed_at}


def rate(steps: list[dict], first: int, last: int) -> float | None:
    at = {s["step"]: s["time"] for s in steps}
    if first not in at or last not in at or last <= first:
        return None
    return (last - first) / (at[last] - at[first])


def summary(run: dict, steps: int, kill_at: int, ref: list[float]) -> dict:
    s = run["steps"]
    chosen = [e for e in run["events"] if e["event"] == "plan_chosen" and e["lost"]]
    recovered = [e for e in run["events"] if e["event"] == "recovered"]
    last = chosen[-1] if chosen else {}
    got = {x["step"]: x["loss"] for x in s}
    return {
        "rc": run["rc"], "before": rate(s, 2, kill_at - 1),
        "after": rate(s, kill_at + 3, steps - 1),
        "recovery_s": recovered[-1]["total_s"] if recovered else None,
        "policy": last.get("policy"),
        "estimated_step_s": {k: v["step_time_s"] for k, v in last.get("candidates", {}).items()},
        "scores": {k: v["score"] for k, v in last.get("candidates", {}).items()},
        "losses_equal": sorted(got) == list(range(steps)) and all(
            abs(got[i] - ref[i]) <= 1e-9 * max(1.0, abs(ref[i])) for i in range(steps)),
    }


def reference_losses(steps: int) -> list[float]:
    """Single-process losses of the same model and batches (sleeping nothing)."""
    import torch

    from chameleon_elastic.models.toy import emulated_model, reference_training

    losses, _ = reference_training(emulated_model(8, 0.0, 0.0, dtype=torch.float64), steps, 8)
    return losses


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (standby, none)")
    p.add_argument("--steps", type=int, default=30, help="steps of each run")
    p.add_argument("--kill-at", type=int, default=8, help="device 3 dies after this step")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--table-from", metavar="PATH",
                   help="print the table of a saved --json report and exit")
    args = p.parse_args(argv)
    if args.table_from:
        _table(json.loads(Path(args.table_from).read_text()))
        return 0
    if args.kill_at < 5 or args.steps < args.kill_at + 8 or args.rounds < 1:
        p.error("--kill-at must be at least 5, --steps at least --kill-at + 8, --rounds >= 1.")
    from chameleon_elastic.rendezvous.local_etcd import LocalEtcd

    ref = reference_losses(args.steps)
    load_before = os.getloadavg()
    rows: dict[str, list[dict]] = {k: [] for k in SETUPS}
    with tempfile.TemporaryDirectory() as tmp, LocalEtcd(data_dir=Path(tmp) / "etcd") as etcd:
        for r in range(args.rounds):
            for setup in (("standby", "none") if r % 2 == 0 else ("none", "standby")):
                print(f"round {r + 1}/{args.rounds}: {setup} ...", file=sys.stderr, flush=True)
                where = Path(tmp) / f"r{r}"
                where.mkdir(exist_ok=True)
                run = run_job(setup, args.steps, args.kill_at, where, etcd.endpoint)
                rows[setup].append(summary(run, args.steps, args.kill_at, ref))
    med = {k: {m: _median([row[m] for row in v]) for m in ("before", "after", "recovery_s")}
           for k, v in rows.items()}
    after = (med["standby"]["after"] / med["none"]["after"]
             if med["standby"]["after"] and med["none"]["after"] else None)
    report = {"args": vars(args), "rows": rows, "median": med,
              "after_standby_over_none": after, "load_before": load_before,
              "load": os.getloadavg()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _table(report)
    return 0


def _table(report: dict) -> None:
    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    print(f"{'setup':<8} {'before':>7} {'after':>7} {'after/before':>13} {'recovery s':>11}  "
          "policy chosen (estimated step s per candidate), losses equal")
    for k, m in report["median"].items():
        rows = report["rows"][k]
        ratio = m["after"] / m["before"] if m["after"] and m["before"] else None
        chosen = "; ".join(f"{row['policy']} (" + ", ".join(
            f"{c} {s:.3f}" for c, s in row["estimated_step_s"].items()) + ")" for row in rows)
        print(f"{k:<8} {f(m['before']):>7} {f(m['after']):>7} {f(ratio):>13} "
              f"{f(m['recovery_s']):>11}  {chosen}, {all(r['losses_equal'] for r in rows)}")
    print(f"steps/s (median of {len(report['rows']['none'])} runs each); after the recovery, "
          f"standby / none = {f(report['after_standby_over_none'])}; "
          f"load (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in report['load_before'])} "
          f"before, {', '.join(f'{x:.1f}' for x in report['load'])} after")


if __name__ == "__main__":
    sys.exit(main())
