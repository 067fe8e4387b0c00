"""A slowed device under ``chameleon-run --stragglers auto`` against ``--stragglers off``.

    python benchmarks/stragglers.py [--steps 40] [--after 15] [--rounds 1] [--json]

Four workers as (PP, DP) = (2, 2) run ``tests/launcher/workers/emulated.py``: 8 layers that
take their time by sleeping (``toy.emulated_model``, 5 ms forward and 10 ms backward each), so
on this 2-core machine a stopped process slows only its own device, as a throttled GPU would.
From step ``SLOW_FROM`` (8) to step ``--steps`` device 3 is stopped 60 ms of every 120 ms from
outside (SIGSTOP/SIGCONT): about half speed. ``--after`` more steps run at full speed again.

Throughput (steps per second, from the reporting worker's wall time of each step) before the
slowdown (steps 2-7), during it (from 8), over its last 15 steps (the target: auto >= 1.25x
off), and after it; for each setting in the same run, alternating which goes first by round.
Also: whether the job re-planned around the straggler and back, whether any device was
declared hung, and whether the losses equal a single-process run (float64, rtol 1e-9).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "launcher" / "workers" / "emulated.py"
SLOW_FROM = 8
STOP_S, PERIOD_S = 0.060, 0.120
TARGET = 1.25
JOB = """name = "emulated"
[model]
layers = 8
forward_s = 0.005
backward_s = 0.010
param_bytes = 4000.0
optimizer_bytes = 0.0
activation_bytes = 1000.0
[cluster]
devices = 4
device_memory_bytes = 1e9
bandwidth_bytes_per_s = 1e9
restart_s = 2.0
regroup_s = 0.7
failure_rate_per_hour = 0.1
[training]
dp = 2
pp = 2
global_micro_batches = 8
precision = "fp32"
[stragglers]
threshold = 0.7
recover = 0.85
window = 4
"""


class DutyCycle:
    """Stops a process ``STOP_S`` of every ``PERIOD_S`` from outside (SIGSTOP/SIGCONT), in a
    thread, from ``start()`` until ``stop()``; it is always left running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> DutyCycle:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(STOP_S)   # the duty cycle's own clock, not a synchronisation
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(PERIOD_S - STOP_S)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def reported(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_job(stragglers: str, steps: int, after: int, tmp: Path, timeout_s: float = 150.0
            ) -> dict:
    """One chameleon-run of the emulated job with device 3 slowed from ``SLOW_FROM`` to
    ``steps``: the reported steps, the event log and the launcher's exit code."""
    out, state = tmp / f"out-{stragglers}", tmp / f"state-{stragglers}"
    out.mkdir(parents=True)
    job = tmp / "emulated.toml"
    job.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp / f"launcher-{stragglers}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
         "--nproc-per-node", "4", "--job", str(job), "--state-dir", str(state),
         "--monitor-interval", "0.05", "--no-status", "--stragglers", stragglers,
         str(WORKER), str(out), str(steps + after)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    cycle = None
    deadline = time.monotonic() + timeout_s
    phase = "waiting for step 8"
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {stragglers} run did not finish in {timeout_s:.0f} s "
                                   f"({phase}); see {log.name}")
            done = len(reported(out))
            if cycle is None and done >= SLOW_FROM:
                pid = int((out / "pid-3").read_text().split()[-1])
                cycle, phase = DutyCycle(pid).start(), "slowed"
            if cycle is not None and done >= steps and phase == "slowed":
                cycle.stop()
                phase = "after the slowdown"
            time.sleep(0.02)   # polling the steps file, not synchronising with the job
    finally:
        if cycle is not None:
            cycle.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    events_path = state / "events.jsonl"
    events = ([json.loads(x) for x in events_path.read_text().splitlines()]
              if events_path.exists() else [])
    return {"rc": proc.returncode, "steps": reported(out), "events": events,
            "log": (tmp / f"launcher-{stragglers}.log").read_text()}


def rate(steps: list[dict], first: int, last: int) -> float | None:
    """Steps per second from step ``first`` to step ``last`` (reported times)."""
    at = {s["step"]: s["time"] for s in steps}
    if first not in at or last not in at or last <= first:
        return None
    return (last - first) / (at[last] - at[first])


def summary(run: dict, steps: int, after: int) -> dict:
    s = run["steps"]
    chosen = [e for e in run["events"] if e["event"] == "plan_chosen" and e.get("slow") is not None]
    hung = [e for e in run["events"] if e["event"] == "failure_seen"
            and "hung" in str(e.get("reason", ""))]
    def step_at(ts: float) -> int:
        return max((x["step"] for x in s if x["time"] <= ts), default=-1) + 1

    return {"rc": run["rc"], "before": rate(s, 2, SLOW_FROM - 1),
            "during": rate(s, SLOW_FROM, steps - 1),
            "last15": rate(s, steps - 15, steps - 1),
            "after": rate(s, steps + 3, steps + after - 1) if after > 4 else None,
            "straggler_plans": [{"step": step_at(e["ts"]), "slow": e["slow"],
                                 "chosen": _option(e)} for e in chosen],
            "hung": len(hung)}


def _option(event: dict) -> str:
    """Which option a straggler decision took: the candidate with the best score."""
    scores = {k: c["score"] for k, c in event["candidates"].items()}
    return max(scores, key=scores.get) if scores else "?"


def reference_losses(steps: int) -> list[float]:
    """Single-process losses of the same model and batches (sleeping nothing)."""
    import torch

    from chameleon_elastic.models.toy import emulated_model, reference_training

    losses, _ = reference_training(emulated_model(8, 0.0, 0.0, dtype=torch.float64), steps, 8)
    return losses


def losses_equal(run: dict, ref: list[float]) -> bool:
    got = {s["step"]: s["loss"] for s in run["steps"]}
    return sorted(got) == list(range(len(ref))) and all(
        abs(got[i] - ref[i]) <= 1e-9 * max(1.0, abs(ref[i])) for i in range(len(ref)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps up to the end of the slowdown")
    p.add_argument("--after", type=int, default=15, help="steps at full speed after it")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs (auto, off)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.steps < SLOW_FROM + 16 or args.after < 0 or args.rounds < 1:
        p.error(f"--steps must be at least {SLOW_FROM + 16}, --after >= 0, --rounds >= 1.")
    ref = reference_losses(args.steps + args.after)
    rows: dict[str, list[dict]] = {"auto": [], "off": []}
    for r in range(args.rounds):
        for setting in (("auto", "off") if r % 2 == 0 else ("off", "auto")):
            with tempfile.TemporaryDirectory() as tmp:
                run = run_job(setting, args.steps, args.after, Path(tmp))
            row = summary(run, args.steps, args.after)
            row["losses_equal"] = losses_equal(run, ref)
            rows[setting].append(row)
    med = {k: {m: _median([row[m] for row in v]) for m in ("before", "during", "last15", "after")}
           for k, v in rows.items()}
    ratio = (med["auto"]["last15"] / med["off"]["last15"]
             if med["auto"]["last15"] and med["off"]["last15"] else None)
    report = {"rows": rows, "median_steps_per_s": med, "last15_ratio": ratio, "target": TARGET}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _table(report)
    return 0


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _table(report: dict) -> None:
    def f(v):
        return "-" if v is None else f"{v:.2f}"

    print(f"{'--stragglers':<13} {'before':>7} {'during':>7} {'last 15':>8} {'after':>7}  "
          "(steps/s, median)   re-plans around the straggler, hung, losses equal")
    for k, m in report["median_steps_per_s"].items():
        rows = report["rows"][k]
        plans = "; ".join(", ".join(f"step {x['step']}: {x['chosen']} {x['slow'] or 'none slow'}"
                                    for x in row["straggler_plans"]) for row in rows)
        print(f"{k:<13} {f(m['before']):>7} {f(m['during']):>7} {f(m['last15']):>8} "
              f"{f(m['after']):>7}  {plans or '-'}, {sum(r['hung'] for r in rows)}, "
              f"{all(r['losses_equal'] for r in rows)}")
    ratio = report["last15_ratio"]
    print(f"last 15 steps of the slowdown: auto / off = {f(ratio)} (target >= {TARGET})")


if __name__ == "__main__":
    sys.exit(main())
