"""Does a run with lost devices print the failure-free run's losses? Per precision, measured.

The README's quick-start demo: ``chameleon-run --standalone --nproc-per-node 4 --preset
tiny-cpu examples/train_gpt.py --steps 40 --log-every 1``, once without faults and once with
``kill -9`` of device 3 right after step 10 is printed and of device 1 after step 25 (the
default ``--kills 10:3,25:1``; each re-plans and recovers in place). Both runs print every step's loss to 4 decimals; the
table counts the steps whose printed losses differ, and the largest difference.

Why it is not always 0: a re-plan changes which device sums which micro-batches' gradients and
in which order the data-parallel sums add them. In fp32 that moves a weight by an ulp; in bf16
autocast the next forward can round an activation the other way, which the printed loss shows.
How many steps differ, and by how much, depends on where each kill lands (the step the new plan
takes over at, printed as "new plan at"), so it varies from run to run. Stragglers are off
(``--stragglers auto`` to let them in): on a loaded machine a straggler re-plan is one more plan
change, in the reference run too.

    python benchmarks/loss_equality.py [--precision bf16,fp32] [--repeats 1]
                                       [--kills 10:3,25:1] [--stragglers off] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from launched import supervise, worker_of

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "train_gpt.py")
STEP_LINE = re.compile(r"step\s+(\d+)\s+loss\s+([0-9.]+)")
#: the launcher's recovery line: where a new plan took over (depends on where a kill lands),
#: and why (a lost device, or a straggler: on a loaded machine, one more plan change)
RESUMED = re.compile(r"chameleon-run: .*(lost|slow|back to speed).*resumed at step (\d+)")


def run(precision: str, steps: int, kills: list[tuple[int, int]],
        env_extra: dict[str, str], deadline_s: float = 300.0, stragglers: str = "off") -> dict:
    """One run; returns {"losses": {step: "x.xxxx"}, "exit_code", "killed": [(step, device)],
    "resumed": [the step each plan change took over at, "s" after a straggler's]}. Kills
    are (after step, device); every process started is killed at the end. ``stragglers``:
    chameleon-run's flag; off by default, so that the clean run stays one plan and the faulty
    one changes plan at the kills only (on a loaded machine a straggler re-plan is one more
    plan change, which moves bf16 losses as a kill's does)."""
    with tempfile.TemporaryDirectory(prefix="loss-equality-") as tmp:
        cmd = [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
               "--nproc-per-node", "4", "--preset", "tiny-cpu", "--no-status",
               "--monitor-interval", "0.1", "--state-dir", f"{tmp}/state",
               "--stragglers", stragglers,
               GPT, "--steps", str(steps), "--log-every", "1", "--precision", precision]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=ROOT, start_new_session=True)
        losses: dict[int, str] = {}
        resumed: list[str] = []
        todo = sorted(kills)
        done: list[tuple[int, int]] = []

        def read() -> None:
            assert proc.stdout is not None
            for text in proc.stdout:
                back = RESUMED.search(text)
                if back:   # "11" for a kill's re-plan, "12s" for a straggler's
                    resumed.append(back.group(2) + ("" if back.group(1) == "lost" else "s"))
                m = STEP_LINE.match(text.strip())
                if not m:
                    continue
                step = int(m.group(1))
                losses.setdefault(step, m.group(2))
                while todo and step >= todo[0][0]:
                    victim = worker_of(proc.pid, todo[0][1])
                    if victim is None:
                        break
                    os.kill(victim, signal.SIGKILL)
                    done.append(todo.pop(0))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code = supervise(proc, deadline_s)
        reader.join(10)
    return {"losses": losses, "exit_code": code, "killed": done, "resumed": resumed}


def compare(base: dict[int, str], other: dict[int, str]) -> dict:
    steps = sorted(set(base) & set(other))
    diff = [s for s in steps if base[s] != other[s]]
    return {"steps": len(steps), "differ": len(diff), "first": diff[0] if diff else None,
            "max_abs": max((abs(float(base[s]) - float(other[s])) for s in diff), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", default="10:3,25:1", help="after-step:device, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="faulty runs per precision")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra environment for every run (e.g. a runtime switch under test)")
    ap.add_argument("--stragglers", default="off", choices=("auto", "off"),
                    help="chameleon-run's --stragglers (default off: plan changes at the kills "
                         "only)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kills = [(int(a), int(b)) for a, b in (k.split(":") for k in args.kills.split(","))]
    env_extra = dict(e.split("=", 1) for e in args.env)
    rows = []
    for precision in args.precision.split(","):
        clean = run(precision, args.steps, [], env_extra, stragglers=args.stragglers)
        for _ in range(args.repeats):
            faulty = run(precision, args.steps, kills, env_extra, stragglers=args.stragglers)
            rows.append({"precision": precision, "env": env_extra, "killed": faulty["killed"],
                         "resumed": faulty["resumed"], "clean_changes": clean["resumed"],
                         "exit_codes": [clean["exit_code"], faulty["exit_code"]],
                         **compare(clean["losses"], faulty["losses"])})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'precision':9} {'kills (after step:device)':26} {'new plan at':12} {'steps':>5} "
          f"{'differ':>6} {'first':>5} {'max |diff|':>10}  exit")
    for r in rows:
        kill_text = ",".join(f"{s}:{d}" for s, d in r["killed"]) or "-"
        back = ",".join(r["resumed"]) or "-"
        if r["clean_changes"]:   # the reference itself changed plan: say so
            back += f" (clean: {','.join(r['clean_changes'])})"
        print(f"{r['precision']:9} {kill_text:26} {back:12} {r['steps']:5d} {r['differ']:6d} "
              f"{r['first'] if r['first'] is not None else '-':>5} {r['max_abs']:10.4f}  "
              f"{r['exit_codes']}")


if __name__ == "__main__":
    main()
