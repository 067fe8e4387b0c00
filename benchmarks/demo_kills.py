"""The README demo, faulted as a user would fault it, many times: the tail of the recovery.

Each run is the README's plan-aware quick start (``chameleon-run --standalone --nproc-per-node 4
--preset tiny-cpu examples/train_gpt.py``, bf16 by default as the README runs it) with faults
struck right after given steps are printed: by default ``kill -9`` of device 3 after step 8 and
of device 0 after step 16 (issue 35's done-when). ``--fault STEP:DEVICE[:SIGNAL[:DELAY]]``
(repeatable) chooses them: ``8:0:STOP:0.3`` SIGSTOPs device 0 0.3 s after step 8 is printed
(frozen as it enters the plan made for an earlier kill). ``--load N`` runs N busy loops beside
the job, as on a shared machine.

Per run: the exit status, every step printed exactly once (a step printed twice is counted,
as a user would count it), and for each kill the seconds from the kill to the first step line
after the step it followed. A kill whose next step takes longer than ``--stall`` seconds gets
every process of the run dumped with py-spy into ``--dumps`` (when py-spy is installed), so a
stall can be read where it happened; such a run, or one that fails, also leaves its console
output and state directory (event log, workers' stderr) there. Prints a table (median, p99, max per fault) and, with
``--json``, every run.

    python benchmarks/demo_kills.py --runs 30 --load 1
    python benchmarks/demo_kills.py --runs 10 --fault 8:3 --fault 8:0:STOP:0.3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from launched import busy_loops, supervise, worker_of

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^(?:\S+ )?step\s+(\d+)\s")


def parse_fault(text: str) -> tuple[int, int, signal.Signals, float]:
    """``STEP:DEVICE[:SIGNAL[:DELAY]]`` -> (step, device, signal, delay seconds)."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 4:
        raise argparse.ArgumentTypeError(f"--fault {text!r}: use STEP:DEVICE[:SIGNAL[:DELAY]]")
    sig = signal.Signals[f"SIG{parts[2].upper().removeprefix('SIG')}"] if len(parts) > 2 else \
        signal.SIGKILL
    return int(parts[0]), int(parts[1]), sig, float(parts[3]) if len(parts) > 3 else 0.0


def dump(launcher: int, path: Path) -> None:
    """Where every process of the run is (py-spy), for a stall read afterwards."""
    if shutil.which("py-spy") is None:
        return
    try:
        procs = [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]
    except psutil.Error:
        return
    with path.open("w") as out:
        for p in procs:
            with contextlib.suppress(psutil.Error, subprocess.SubprocessError):
                out.write(f"==== pid {p.pid} device {p.environ().get('CHAMELEON_DEVICE')}\n")
                out.write(subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], check=False,
                                         capture_output=True, text=True, timeout=30).stdout)


class Run:
    """One run of the demo: reads its output, strikes the faults, watches for stalls."""

    def __init__(self, faults: list, steps: int, stall: float, dumps: Path | None,
                 index: int) -> None:
        self.faults, self.steps, self.stall, self.dumps, self.index = faults, steps, stall, \
            dumps, index
        self.lines: list[tuple[float, str]] = []
        self.kills: list[tuple[float, int, int]] = []   # (when, after step, device)
        self._lock = threading.Lock()

    def run(self, deadline: float) -> dict:
        with tempfile.TemporaryDirectory(prefix="demo-kills-") as state:
            cmd = [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
                   "--nproc-per-node", "4", "--preset", "tiny-cpu", "--no-status",
                   "--state-dir", state, str(ROOT / "examples" / "train_gpt.py"),
                   "--steps", str(self.steps), "--log-every", "1"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=ROOT, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
            reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
            reader.start()
            watcher = threading.Thread(target=self._watch, args=(proc,), daemon=True)
            watcher.start()
            code = supervise(proc, deadline)
            reader.join(10)
            result = self._result(code)
            if self.dumps is not None and (code != 0 or not result["every_step_once"] or any(
                    (k["next_step_s"] or math.inf) > self.stall for k in result["kills"])):
                keep = self.dumps / f"run{self.index}"   # what a stall or a failure left
                shutil.copytree(state, keep / "state", dirs_exist_ok=True)
                (keep / "console.txt").write_text("\n".join(t for _, t in self.lines) + "\n")
            return result

    def _read(self, proc: subprocess.Popen) -> None:
        pending = sorted(self.faults)
        for text in proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), text.rstrip()))
            m = STEP.match(text)
            while m and pending and int(m.group(1)) >= pending[0][0]:
                _, device, sig, delay = pending.pop(0)
                victim = worker_of(proc.pid, device)
                if victim is None:
                    continue
                if sig == signal.SIGKILL:
                    self.kills.append((time.monotonic() + delay, int(m.group(1)), device))
                threading.Timer(delay, _signal, (victim, sig)).start()

    def _watch(self, proc: subprocess.Popen) -> None:
        dumped: set[int] = set()
        while proc.poll() is None:
            time.sleep(0.5)
            for i, (at, step, _) in enumerate(list(self.kills)):
                if (i not in dumped and self._next_after(at, step) is None
                        and time.monotonic() - at > self.stall and self.dumps is not None):
                    dumped.add(i)
                    dump(proc.pid, self.dumps / f"run{self.index}-kill{step}.txt")

    def _next_after(self, at: float, step: int) -> float | None:
        with self._lock:
            return next((t for t, text in self.lines if t > at and (m := STEP.match(text))
                         and int(m.group(1)) > step), None)

    def _result(self, code: int | None) -> dict:
        printed = [int(m.group(1)) for _, text in self.lines if (m := STEP.match(text))]
        twice = sorted({s for s in printed if printed.count(s) > 1})
        kills = []
        for at, step, device in self.kills:
            nxt = self._next_after(at, step)
            kills.append({"device": device, "after_step": step,
                          "next_step_s": None if nxt is None else round(nxt - at, 3)})
        return {"exit_code": code, "every_step_once": sorted(set(printed)) == list(
            range(self.steps)) and not twice, "printed_twice": twice, "kills": kills,
            "recovery_lines": [t for _, t in self.lines if t.startswith("chameleon-run: ")
                               and " lost " in t]}


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (the largest of fewer than 1 / (1 - q) values); None if empty. Our
    own, not chameleon_elastic.hang's: the script also measures older versions of the code."""
    ordered = sorted(values)
    return ordered[min(len(ordered), math.ceil(q * len(ordered))) - 1] if ordered else None


def summarise(results: list[dict]) -> dict:
    by_kill: dict[str, list[float | None]] = {}
    for r in results:
        for k in r["kills"]:
            by_kill.setdefault(f"kill -9 device {k['device']} after step {k['after_step']}",
                               []).append(k["next_step_s"])
    rows = {}
    for name, values in by_kill.items():
        known = [v for v in values if v is not None]
        rows[name] = {"kills": len(values), "no_next_step": len(values) - len(known),
                      "median_s": statistics.median(known) if known else None,
                      "p99_s": quantile(known, 0.99), "max_s": max(known, default=None)}
    return {"runs": len(results), "exit_0": sum(r["exit_code"] == 0 for r in results),
            "every_step_once": sum(r["every_step_once"] for r in results), "kills": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault", type=parse_fault, action="append", metavar="STEP:DEVICE",
                        help="STEP:DEVICE[:SIGNAL[:DELAY]], repeatable (default: 8:3 and 16:0)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N CPU-bound busy loops beside the job")
    parser.add_argument("--stall", type=float, default=5.0,
                        help="seconds after a kill without a new step before the run's "
                             "processes are dumped (py-spy)")
    parser.add_argument("--dumps", type=Path, default=None, metavar="DIR",
                        help="where stalls' py-spy dumps go (default: none taken)")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds before a run is killed and counted as hung")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    faults = args.fault or [parse_fault("8:3"), parse_fault("16:0")]
    if args.dumps is not None:
        args.dumps.mkdir(parents=True, exist_ok=True)
    results = []
    with busy_loops(args.load):
        for i in range(args.runs):
            r = Run(faults, args.steps, args.stall, args.dumps, i).run(args.deadline)
            results.append(r)
            print(f"  run {i + 1:3d}: exit {r['exit_code']} kill->next step "
                  f"{[k['next_step_s'] for k in r['kills']]} every step once: "
                  f"{r['every_step_once']}", file=sys.stderr, flush=True)
    report = {"benchmark": "demo_kills", "load": args.load, "steps": args.steps,
              "faults": [f"{s}:{d}:{sig.name}:{delay:g}" for s, d, sig, delay in faults],
              "summary": summarise(results), "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    s = report["summary"]
    print(f"\nREADME demo (tiny GPT, bf16, 4 gloo workers), {s['runs']} runs, {args.load} busy "
          f"loop(s) beside it: exit 0 in {s['exit_0']}, every step printed once in "
          f"{s['every_step_once']}")
    print(f"{'fault':36s} {'kills':>6s} {'no step':>8s} {'median s':>9s} {'p99 s':>7s} "
          f"{'max s':>7s}")
    for name, row in s["kills"].items():
        def fmt(v):
            return "-" if v is None else f"{v:.2f}"
        print(f"{name:36s} {row['kills']:>6d} {row['no_next_step']:>8d} "
              f"{fmt(row['median_s']):>9s} {fmt(row['p99_s']):>7s} {fmt(row['max_s']):>7s}")


if __name__ == "__main__":
    main()
