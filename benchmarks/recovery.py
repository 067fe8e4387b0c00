"""Recovery after a lost device: in place vs relaunch + checkpoint vs torchrun + checkpoint, and
the paper's weight-transfer ablation on real transfers.

Part 1 (``--trials N``, default 10 per path, all paths in one run, alternating). Each trial
trains the tiny byte-level GPT (examples/train_gpt.py, 4 gloo workers, checkpoints every 5
steps) and SIGKILLs the worker of device/rank 3 right after the line of step ``--kill-at`` is
printed. Measured from the kill:

    kill -> next committed step : until the first step that had not been committed before the
                                  kill is printed (the time a user loses)
    steps redone                : steps a launcher printed again after the kill (committed work redone)
    step s (fault-free)         : the median time between two step lines before the kill, so
                                  that the recovery path can be told from the step it ends with

The GPT trains in fp32 by default (``--precision``): on a CPU, bf16 autocast is emulated and
triples the step (0.34 s against 0.14 s for 4 workers), and the first new step is part of the
figure, so bf16 would measure the emulation more than the recovery.

Paths: ``inplace`` (chameleon-run --preset tiny-cpu, survivors keep their processes and take
state from peers), ``relaunch`` (the same with --recovery relaunch: every worker restarts and
loads the checkpoint), ``torchrun`` (torchrun --max-restarts 1, plain data parallelism, every
worker restarts and loads the checkpoint) and ``torchrun-fresh`` (the same with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch's switch away from the store it shares across
restarts, whose stale keys make plain torchrun's relaunched workers fail or hang).

Two nodes (paths ``2n-worker``, ``2n-node-kill``, ``2n-node-stop``, ``2n-decider-kill``,
``2n-decider-stop``): two chameleon-run agents x 2 workers on one local etcd (``--rdzv-backend
etcd-v3``, ``lease_ttl=2``, ``--nnodes 2``), the same tiny GPT without checkpoints; the fault is
a kill -9 of device 3's worker, a SIGKILL of its node's agent and workers, or a SIGSTOP of them
(nothing resets: only the node's lease tells). The ``decider`` paths strike the node of device
0 instead: the lowest node, which decides a quick round, so the survivor must decide in its
place once the lost node's lease is gone.
Each trial also records the survivor's ``recovered`` event: its phases from the fault to the
first new step committed (launcher/observation/reporter.py's ``RECOVERY_PHASES``: detect, decide, publish,
notify, regroup, agree, transfer, rebuild, first step), their total, what they leave unnamed
(the total less the phases: a few ms) and the parts of some of them (rendezvous, plan, stop,
launch).

Part 2 (``--ablation``): 8 gloo processes hold a 16-layer model as DP=4 x PP=2 (the paper's
setting); device 7 is lost; the planner re-plans. The same new layout is entered twice per
repetition in the same processes, with the planner's transfer sources and with the naive choice
(the first holder of each layer, as Oobleck does), alternating. Reported: bytes moved, transfer
time (the slowest process's) and total recovery time (entering the plan plus the first step).

    python benchmarks/recovery.py --trials 10
    python benchmarks/recovery.py --trials 10 --paths inplace,2n-worker,2n-node-kill,2n-node-stop
    python benchmarks/recovery.py --trials 10 --paths 2n-decider-kill,2n-decider-stop
    python benchmarks/recovery.py --ablation --repeats 5
    python benchmarks/recovery.py --trials 10 --ablation --json > recovery.json
    python benchmarks/recovery.py --trials 30 --paths inplace --load 2   # the tail, loaded
    python benchmarks/recovery.py --trials 30 --load 2 --keep-slow /tmp/slow   # and explain it

``--load N`` runs N busy loops beside the job; the table then gives p99 and max of kill -> next
step as well as the median (a recovery is judged by its worst case).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
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

from chameleon_elastic.hang import quantile
from chameleon_elastic.launcher.observation.reporter import RECOVERY_PHASES
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "train_gpt.py")
PATHS = ("inplace", "relaunch", "torchrun", "torchrun-fresh",
         "2n-worker", "2n-node-kill", "2n-node-stop", "2n-decider-kill", "2n-decider-stop")
#: the ``recovered`` event's phases, from the fault to the first new step (docs/launcher.md),
#: their total, and the parts of some of them
PHASES = (*(f"{p}_s" for p in RECOVERY_PHASES), "total_s")
PARTS = ("rendezvous_s", "plan_s", "stop_s", "launch_s")
#: a recovery slower than this is kept for a look (``--keep-slow``)
KEEP_ABOVE_S = 2.0
#: torch's switch away from the store it shares across restarts (whose stale keys make the
#: relaunched workers fail with "connectFullMesh ... Connection refused" or hang)
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STEP_LINE = re.compile(r"step\s+(\d+)\s+loss")
#: fault-free steps are timed from this step on (the first ones warm up)
WARM_FROM = 3


def script(steps: int, precision: str, *extra: str) -> list[str]:
    return [GPT, "--steps", str(steps), "--log-every", "1", "--precision", precision, *extra]


def command(path: str, steps: int, precision: str, ckpt: str, state: str) -> list[str]:
    train = script(steps, precision, "--checkpoint-dir", ckpt, "--checkpoint-every", "5")
    if path.startswith("torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", "--max-restarts", "1", "--monitor-interval", "0.1",
                *train]
    extra = ["--recovery", "relaunch"] if path == "relaunch" else []
    return [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
            "--nproc-per-node", "4", "--preset", "tiny-cpu", "--no-status",
            "--monitor-interval", "0.1", "--state-dir", state, *extra, *train]


class StepWatch:
    """Reads the step lines of launchers' output (one reader thread each) and fires ``kill``
    once, at the first line of a step >= ``kill_at``; ``kill`` returns whether it struck. A
    step is redone when a launcher prints it again after the kill: every node prints the
    steps, and the survivor printing the kill's step just after the kill is no redo."""

    def __init__(self, procs: list[subprocess.Popen], kill_at: int, kill) -> None:
        self.lines: list[tuple[float, int, int]] = []   # (time, step, which launcher)
        self.kill_t: float | None = None
        self.committed = -1
        self._lock = threading.Lock()
        self._kill_at, self._kill = kill_at, kill
        self._threads = [threading.Thread(target=self._read, args=(p, i), daemon=True)
                         for i, p in enumerate(procs)]
        for t in self._threads:
            t.start()

    def _read(self, proc: subprocess.Popen, which: int) -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            m = STEP_LINE.match(text)
            if not m:
                continue
            with self._lock:
                now, step = time.monotonic(), int(m.group(1))
                self.lines.append((now, step, which))
                if self.kill_t is None and step >= self._kill_at:
                    committed = max(s for _, s, _ in self.lines)
                    if self._kill():
                        self.committed, self.kill_t = committed, time.monotonic()

    def _redone(self, kill_t: float | None) -> int:
        if kill_t is None:
            return 0
        printed: dict[int, int] = {}   # the launcher's last step printed before the kill
        for t, s, who in self.lines:
            if t < kill_t:
                printed[who] = max(printed.get(who, -1), s)
        return sum(1 for t, s, who in self.lines if t >= kill_t and s <= printed.get(who, -1))

    def join(self) -> None:
        for t in self._threads:
            t.join(10)

    def result(self, path: str, code: int | None, steps: int,
               resumed: int | None = None) -> dict:
        """``resumed``: the first step of the recovery (its ``recovered`` event), when known: a
        step committed before the kill may be read after it (another launcher's line, under
        load), and is not the recovery's."""
        kill_t, committed = self.kill_t, self.committed
        first = max(committed + 1, resumed or 0)
        new = [t for t, s, _ in self.lines if kill_t is not None and t >= kill_t and s >= first]
        finished = sorted({s for _, s, _ in self.lines}) == list(range(steps))
        before = [(t, s) for t, s, _ in self.lines if kill_t is None or t < kill_t]
        gaps = [t - t0 for (t0, s0), (t, s) in itertools.pairwise(before)
                if s == s0 + 1 and s0 >= WARM_FROM]
        return {"path": path, "exit_code": code, "hung": code is None,
                "finished": finished and code == 0,
                "killed_after_step": committed if kill_t else None,
                "kill_to_next_step_s": (new[0] - kill_t) if new and kill_t else None,
                "steps_redone": self._redone(kill_t),
                "step_s": statistics.median(gaps) if gaps else None}


def _popen(cmd: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                     **env),
                            cwd=ROOT, start_new_session=True)


def trial(path: str, steps: int, precision: str, kill_at: int, deadline: float,
          keep: Path | None = None) -> dict:
    """One run on one node; every process it started is killed at the end, orphans included
    (torchrun's workers outlive a killed torchrun and would hold the output pipe open)."""
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        proc = _popen(command(path, steps, precision, f"{tmp}/ckpt", f"{tmp}/state"),
                      **(FRESH_STORE if path == "torchrun-fresh" else {}))

        def kill() -> bool:
            victim = worker_of(proc.pid, 3)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            return victim is not None

        watch = StepWatch([proc], kill_at, kill)
        code = supervise(proc, deadline)
        watch.join()
        phases = _phases(Path(tmp, "state", "events.jsonl"))
        result = watch.result(path, code, steps, (phases or {}).get("resumed_step"))
        result["phases"] = phases
        _keep_if_slow(result, tmp, keep)
    return result


def _keep_if_slow(result: dict, tmp: str, keep: Path | None) -> None:
    """Copy a trial's state directories (events, plans, workers' logs) under ``keep`` when it
    did not finish or its recovery took over ``KEEP_ABOVE_S``: the tail is what to explain."""
    t = result["kill_to_next_step_s"]
    if keep is None or (result["finished"] and t is not None and t <= KEEP_ABOVE_S):
        return
    where = keep / f"{result['path']}-{Path(tmp).name}"
    shutil.copytree(tmp, where, dirs_exist_ok=True)
    result["kept"] = str(where)


def _phases(events: Path) -> dict | None:
    """The last recovery's phase durations, as the agent's ``recovered`` event gives them."""
    if not events.exists():
        return None
    recovered = [e for e in map(json.loads, events.read_text().splitlines())
                 if e.get("event") == "recovered"]
    if not recovered:
        return None
    return {k: recovered[-1].get(k) for k in (*PHASES, *PARTS, "resumed_step")}


def two_node_trial(path: str, steps: int, precision: str, kill_at: int, deadline: float,
                   endpoint: str, run_id: str, keep: Path | None = None) -> dict:
    """Two agents x two workers on etcd-v3 (lease TTL 2 s), the tiny GPT. ``2n-worker``:
    kill -9 of device 3's worker; ``2n-node-kill`` / ``2n-node-stop``: SIGKILL / SIGSTOP of
    the agent and workers of the node that runs device 3; ``2n-decider-*``: of device 0's
    (the quick round's decider)."""
    device = 0 if path.startswith("2n-decider") else 3
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        agents = {name: _popen([
            sys.executable, "-m", "chameleon_elastic.launcher.cli", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "lease_ttl=2", "--local-addr", "127.0.0.1",
            "--monitor-interval", "0.1", "--no-status", "--preset", "tiny-cpu",
            "--state-dir", f"{tmp}/{name}", *script(steps, precision)]) for name in ("a", "b")}
        victims: list[psutil.Process] = []

        def kill() -> bool:
            for name, agent in agents.items():
                worker = worker_of(agent.pid, device)
                if worker is None:
                    continue
                if path == "2n-worker":
                    os.kill(worker, signal.SIGKILL)
                    return True
                root = psutil.Process(agent.pid)
                victims.extend([root, *root.children(recursive=True)])
                sig = signal.SIGKILL if path.endswith("-kill") else signal.SIGSTOP
                for proc in victims:
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(sig)
                survivor.append(next(n for n in agents if n != name))
                return True
            return False

        survivor: list[str] = []
        watch = StepWatch(list(agents.values()), kill_at, kill)
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(
                agents[n].poll() is None for n in (survivor or agents)):
            time.sleep(0.2)
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        codes = {name: supervise(agent, 1) for name, agent in agents.items()}
        watch.join()
        code = codes[survivor[0]] if survivor else (
            None if None in codes.values() else max(codes.values()))
        watched = survivor[0] if survivor else "a"
        phases = _phases(Path(tmp, watched, "events.jsonl"))
        result = watch.result(path, code, steps, (phases or {}).get("resumed_step"))
        result["phases"] = phases
        _keep_if_slow(result, tmp, keep)
    return result


def summarise(results: list[dict]) -> dict[str, dict]:
    table = {}
    for path in PATHS:
        mine = [r for r in results if r["path"] == path]
        if not mine:
            continue
        times = [r["kill_to_next_step_s"] for r in mine if r["kill_to_next_step_s"] is not None]
        redone = [r["steps_redone"] for r in mine if r["finished"]]
        table[path] = {
            "trials": len(mine), "finished": sum(r["finished"] for r in mine),
            "hung": sum(r["hung"] for r in mine),
            "median_s": statistics.median(times) if times else None,
            "p99_s": quantile(times, 0.99), "min_s": min(times) if times else None,
            "max_s": max(times) if times else None,
            "redone_median": statistics.median(redone) if redone else None,
            "redone_max": max(redone) if redone else None,
            "step_s": _median([r.get("step_s") for r in mine]),
            "phases_median": {k: _median([(r.get("phases") or {}).get(k) for r in mine])
                              for k in (*PHASES, *PARTS)},
            "unnamed_median": _median([_unnamed(r.get("phases")) for r in mine]),
        }
    return table


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _unnamed(phases: dict | None) -> float | None:
    """The total less its phases: what the phases do not name (a few ms: clocks read apart)."""
    if not phases or any(phases.get(k) is None for k in PHASES):
        return None
    return phases["total_s"] - sum(phases[k] for k in PHASES if k != "total_s")


# --------------------------------------------------------------------------- ablation


def _ablation_world(rank: int, world: int, plans: dict[str, str], repeats: int,
                    width: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from chameleon_elastic.models.toy import mlp_model
    from chameleon_elastic.plan import ExecutionPlan
    from chameleon_elastic.runtime import PipelineTrainer
    from chameleon_elastic.runtime.topology import dense_rank_map

    before = ExecutionPlan.from_json(plans["before"])
    device = dense_rank_map(before).device_of_rank[rank]
    model = mlp_model(layers=before.num_layers, width=width, dtype=torch.float32)
    trainer = PipelineTrainer(model, before, device)
    trainer.step(0)
    out = []
    for rep in range(repeats):
        for variant in (("planner", "naive") if rep % 2 == 0 else ("naive", "planner")):
            trainer.enter(ExecutionPlan.from_json(plans["before"]), None)  # back to DP4 x PP2
            if device == 7:   # the lost device: its process stays only as a stateless spare
                trainer.layers, trainer.optimizer, trainer.committed = {}, None, None
            dist.barrier()
            began = time.perf_counter()
            entry = trainer.enter(ExecutionPlan.from_json(plans[variant]), None)
            entered = time.perf_counter()
            trainer.step(trainer.committed)
            done = time.perf_counter()
            out.append({"variant": variant, "rep": rep, "transfer_s": entry.transfer_s,
                        "total_s": done - began, "enter_s": entered - began,
                        "received_bytes": entry.moved_bytes})
    trainer.close()
    return out


def ablation(repeats: int, width: int) -> dict:
    from dataclasses import replace

    from chameleon_elastic.planning.search import decide, initial_plan
    from chameleon_elastic.runtime.world.local_world import run_local_world
    from chameleon_elastic.sim.policies.oobleck import first_holder_transfers
    from chameleon_elastic.spec import JobSpec

    layer_bytes = 4.0 * (width * width + width)   # float32 Linear; SGD momentum the same size
    spec = JobSpec.from_dict({
        "name": "ablation",
        "model": {"layers": 16, "forward_s": 0.01, "backward_s": 0.02,
                  "param_bytes": layer_bytes, "optimizer_bytes": layer_bytes,
                  "activation_bytes": 4.0 * width},
        "cluster": {"devices": 8, "device_memory_bytes": 8e9, "bandwidth_bytes_per_s": 1e9,
                    "restart_s": 5.0, "failure_rate_per_hour": 0.1},
        "training": {"dp": 4, "pp": 2, "global_micro_batches": 8},
    })
    before = initial_plan(spec)
    planned = decide(spec, before, failed=[7], policy="replan").chosen
    naive = replace(planned, transfers=first_holder_transfers(spec, before, planned.pipelines))
    spare = (*planned.spare_devices, 7)    # the lost device's process idles as a spare
    plans = {"before": before.to_json(), "planner": replace(planned, spare_devices=spare).to_json(),
             "naive": replace(naive, spare_devices=spare).to_json()}
    results = run_local_world(_ablation_world, 8, plans, repeats, width, timeout_s=900,
                              collective_timeout_s=300)
    rows = [r for per_rank in results for r in per_rank]
    summary = {}
    for variant, plan in (("planner", planned), ("naive", naive)):
        reps = sorted({r["rep"] for r in rows})
        slowest = [max((r for r in rows if r["variant"] == variant and r["rep"] == rep),
                       key=lambda r: r["total_s"]) for rep in reps]
        summary[variant] = {
            "bytes_moved": sum(t.bytes for t in plan.transfers),
            "busiest_sender_bytes": max(
                sum(t.bytes for t in plan.transfers if t.src == s)
                for s in {t.src for t in plan.transfers}),
            "transfer_s": statistics.median(
                max(r["transfer_s"] for r in rows if r["variant"] == variant and r["rep"] == rep)
                for rep in reps),
            "total_s": statistics.median(r["total_s"] for r in slowest),
        }
    layout = [len(p.devices) for p in planned.pipelines]
    return {"layers": 16, "layer_bytes": 2 * layer_bytes, "layout_after": layout,
            "repeats": repeats, "summary": summary}


# --------------------------------------------------------------------------- output


def print_tables(report: dict) -> None:
    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    if "summary" in report:
        print(f"\nfault after step {report['kill_at']} (device 3's worker, or its node; device 0's "
              f"node for 2n-decider-*), tiny GPT in "
              f"{report.get('precision', 'bf16')}, 4 gloo workers on {os.cpu_count()} cores, "
              f"{report.get('load', 0)} busy loop(s) beside the job, "
              f"{report['trials']} trials per path")
        print(f"{'path':15s} {'finished':>9s} {'hung':>5s} {'kill->next step s: median':>26s} "
              f"{'p99':>6s} {'min':>6s} {'max':>6s} {'steps redone: median':>21s} {'max':>4s} "
              f"{'step s (fault-free)':>20s}")
        for path, row in report["summary"].items():
            print(f"{path:15s} {row['finished']:>4d}/{row['trials']:<4d} {row['hung']:>5d} "
                  f"{fmt(row['median_s']):>26s} {fmt(row.get('p99_s')):>6s} "
                  f"{fmt(row['min_s']):>6s} {fmt(row['max_s']):>6s} "
                  f"{fmt(row['redone_median'], 'g'):>21s} {fmt(row['redone_max'], 'g'):>4s} "
                  f"{fmt(row.get('step_s'), '.3f'):>20s}")
        print("\nthe survivor agent's `recovered` event, medians in seconds: phases in their "
              "order, from the fault's first sign to the first new step committed (total); "
              "unnamed: total less the phases")
        names = [*(k[:-2] for k in PHASES), "unnamed"]
        print(f"{'path':15s} " + " ".join(f"{k:>10s}" for k in names))
        for path, row in report["summary"].items():
            ph = {**(row.get("phases_median") or {}), "unnamed": row.get("unnamed_median")}
            print(f"{path:15s} " + " ".join(f"{fmt(ph.get(k), '.3f'):>10s}"
                                            for k in (*PHASES, "unnamed")))
        print("\nparts of phases, medians in seconds (rendezvous and plan: of decide; stop: of "
              "publish; launch: of notify)")
        print(f"{'path':15s} " + " ".join(f"{k[:-2]:>10s}" for k in PARTS))
        for path, row in report["summary"].items():
            ph = row.get("phases_median") or {}
            print(f"{path:15s} " + " ".join(f"{fmt(ph.get(k), '.3f'):>10s}" for k in PARTS))
    if "ablation" in report:
        a = report["ablation"]
        print(f"\nweight-transfer ablation: 16 layers of {a['layer_bytes'] / 1e6:.1f} MB "
              f"(weights + momentum), DP=4 x PP=2 on 8 gloo processes, device 7 lost, "
              f"re-planned to pipelines {a['layout_after']}, median of {a['repeats']}")
        print(f"{'sources':8s} {'bytes moved':>12s} {'busiest sender':>15s} {'transfer s':>11s} "
              f"{'recovery s':>11s}")
        for variant, row in a["summary"].items():
            print(f"{variant:8s} {row['bytes_moved'] / 1e6:>9.1f} MB "
                  f"{row['busiest_sender_bytes'] / 1e6:>12.1f} MB {row['transfer_s']:>11.3f} "
                  f"{row['total_s']:>11.3f}")
        p, n = a["summary"]["planner"], a["summary"]["naive"]
        print(f"planner vs naive: transfer {100 * (p['transfer_s'] / n['transfer_s'] - 1):+.1f}%, "
              f"recovery {100 * (p['total_s'] / n['total_s'] - 1):+.1f}% "
              "(paper: -32.35% and -26.79%)")


def run_trials(paths: list[str], trials: int, steps: int, precision: str, kill_at: int,
               deadline: float, keep: Path | None = None) -> list[dict]:
    """Every path ``trials`` times, alternating the order; two-node paths share one etcd."""
    results = []
    with contextlib.ExitStack() as stack:
        etcd = (stack.enter_context(LocalEtcd()) if any(p.startswith("2n-") for p in paths)
                else None)
        for i in range(trials):
            for path in (paths if i % 2 == 0 else paths[::-1]):
                if etcd is not None and path.startswith("2n-"):
                    r = two_node_trial(path, steps, precision, kill_at, deadline,
                                       etcd.endpoint, f"bench-{i}-{path}", keep)
                else:
                    r = trial(path, steps, precision, kill_at, deadline, keep)
                results.append(r)
                t = r["kill_to_next_step_s"]
                print(f"  trial {i + 1:2d} {path:14s} finished={r['finished']!s:5s} kill->next="
                      f"{'-' if t is None else f'{t:.2f} s'} redone={r['steps_redone']} "
                      f"step={r['step_s']} phases={r['phases']}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10,
                        help="kill -9 trials per path (0: skip part 1)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="fp32",
                        help="the tiny GPT's precision (fp32: bf16 autocast is emulated on "
                             "CPU and triples the step, which is part of the figure)")
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="seconds before a trial is killed and counted as unfinished")
    parser.add_argument("--ablation", action="store_true", help="run part 2 too")
    parser.add_argument("--repeats", type=int, default=5, help="ablation repetitions")
    parser.add_argument("--width", type=int, default=1024, help="ablation layer width")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N CPU-bound busy loops beside the job for the whole run (a "
                             "shared, loaded machine: the tail of the recovery time)")
    parser.add_argument("--keep-slow", metavar="DIR", type=Path,
                        help=f"copy the state directories of every trial that did not finish "
                             f"or took over {KEEP_ABOVE_S:g} s from the kill to the next step "
                             "into DIR (to explain the tail)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--table-from", metavar="FILE",
                        help="print the tables of a saved --json report and exit")
    args = parser.parse_args()
    if args.table_from:
        print_tables(json.loads(Path(args.table_from).read_text()))
        return
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown or args.kill_at >= args.steps - 1 or args.trials < 0:
        parser.error(f"--paths takes {', '.join(PATHS)}; --kill-at must leave steps after it.")
    report: dict = {"benchmark": "recovery"}
    if args.trials:
        with busy_loops(args.load):
            results = run_trials(paths, args.trials, args.steps, args.precision, args.kill_at,
                                 args.deadline, args.keep_slow)
        report.update(trials=args.trials, kill_at=args.kill_at, steps=args.steps,
                      precision=args.precision, load=args.load,
                      summary=summarise(results), results=results)
    if args.ablation:
        print("  ablation: 8 processes, this takes a few minutes", file=sys.stderr, flush=True)
        report["ablation"] = ablation(args.repeats, args.width)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(report)


if __name__ == "__main__":
    main()
