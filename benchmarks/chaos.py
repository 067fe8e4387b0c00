"""Chaos: random sequences of faults against a 2-node job, chameleon-run vs torchrun + c10d.

Every trial trains the tiny GPT (examples/train_gpt.py, checkpoints every 10 steps) on 2 nodes x
2 gloo workers and injects 1-3 faults drawn with ``--seed``, each once the job trains again after
the previous one:

    worker-kill   kill -9 of one worker
    worker-stop   SIGSTOP of one worker (a stuck device)
    slow-device   one worker stopped 60 ms of every 120 ms for 10 s (SIGSTOP/SIGCONT from
                  outside: a device at half speed); not a failure, so no device may be
                  declared hung
    node-kill     SIGKILL of a node's launcher and workers (a node loss)
    node-stop     SIGSTOP of a node's launcher and workers (a frozen node)
    etcd-leader   SIGKILL of the etcd leader of a three-member cluster (chameleon-run only);
                  the member is restarted once the job trains again
    etcd-restart  SIGKILL of a random member of the three (the leader included), started
                  again at once on its data directory (chameleon-run only)
    partition     a node's link cut (network namespaces; needs root)
    recovery-kill kill -9 of one worker, then of another 50-500 ms later, while the survivors
                  recover from the first (a fault during a recovery)

chameleon-run runs with ``--rdzv-backend etcd-v3`` (lease_ttl 2 s, the automatic hang timeout),
torchrun with ``--rdzv-backend c10d`` on the first node and ``--max-restarts 3``; both with a
30 s collective timeout. Measured per fault: **detection** (the fault -> chameleon-run's first
``failure_seen`` after it; torchrun logs none) and **recovery** (the fault -> the first step that
had not been printed before it), and per run the steps whose loss differs from a failure-free run
(4 decimals; a step printed twice counts once, by its last value). The GPT trains in fp32 here
(``--precision fp32``): a re-plan changes the order of fp32 gradient sums, and under the
example's default bf16 that can move the 4th decimal of later steps, which is rounding, not a
lost step. A run *finishes* (every launcher left exits 0, every step printed), *ends* (exit 1,
or 93 "do not requeue", with one sentence, as when too few devices remain), *fails* (another
exit, or a traceback) or *hangs* (no new step for ``--stall`` seconds, or past ``--deadline``).
Each run also counts the devices chameleon-run declared hung (``hung_declared``): a slowed
device must not be one.

    python benchmarks/chaos.py --trials 50
    python benchmarks/chaos.py --trials 3 --launchers chameleon --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from demo_kills import dump  # benchmarks/, the script's own directory

from chameleon_elastic.exit_status import ExitStatus

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "train_gpt.py")
KINDS = ("worker-kill", "worker-stop", "slow-device", "node-kill", "node-stop", "etcd-leader",
         "etcd-restart", "partition", "recovery-kill")
ETCD_FAULTS = ("etcd-leader", "etcd-restart")
#: the slow device: stopped STOPPED_S of every PERIOD_S, for SLOW_FOR_S
SLOW_FOR_S, STOPPED_S, PERIOD_S = 10.0, 0.06, 0.12
LAUNCHERS = ("chameleon", "torchrun")
STEP = re.compile(r"step\s+(\d+)\s+loss\s+([0-9.]+)")
#: each launcher's exit in a run that ended with one sentence: done (a node that finished
#: first), failed, or "no plan fits the devices left" (chameleon_elastic/exit_status.py)
ENDINGS = (0, ExitStatus.FAILED, ExitStatus.DO_NOT_REQUEUE)
SENTENCE = re.compile(r"^chameleon-run: .*(lost|closed|no plan|cannot|left)", re.MULTILINE)


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    host: object | None   # a local_hosts.Host, or None on loopback
    lines: list[tuple[float, str]] = field(default_factory=list)   # (wall time, line)
    family: set[int] = field(default_factory=set)   # every pid seen under the launcher

    def read(self) -> threading.Thread:
        def pump() -> None:
            assert self.proc.stdout is not None
            for text in self.proc.stdout:
                self.lines.append((time.time(), text))

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return thread

    def text(self) -> str:
        return "".join(t for _, t in self.lines)

    def refresh(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.family |= {c.pid for c in psutil.Process(self.proc.pid).children(True)}

    def workers(self) -> list[int]:
        alive = []
        for pid in sorted(self.family):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if "train_gpt" in " ".join(proc.cmdline()) and proc.status() != "zombie":
                    alive.append(pid)
        return alive


def _signal(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _duty_cycle(pid: int) -> None:
    """Slow ``pid`` down from outside, as a throttled device is: stopped ``STOPPED_S`` of every
    ``PERIOD_S`` for ``SLOW_FOR_S``, then left running."""
    end = time.monotonic() + SLOW_FOR_S
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOPPED_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(PERIOD_S - STOPPED_S)
    except ProcessLookupError:
        pass   # killed meanwhile (another fault, or the end of the trial)
    finally:
        _signal([pid], signal.SIGCONT)


@contextlib.contextmanager
def testbed(netns: bool) -> Iterator[tuple[object | None, list[object | None]]]:
    if not netns:
        yield None, [None, None]
        return
    from chameleon_elastic.rendezvous.local_hosts import LocalHosts

    with LocalHosts(2) as bed:
        yield bed, list(bed.hosts)


def launch(launcher: str, index: int, hosts, endpoint: str, steps: int, tmp: Path,
           port: int) -> Node:
    host = hosts[index]
    addr = host.ip if host is not None else "127.0.0.1"
    script = [GPT, "--steps", str(steps), "--log-every", "1", "--checkpoint-dir",
              str(tmp / "ckpt"), "--checkpoint-every", "10", "--precision", "fp32"]
    if launcher == "chameleon":
        cmd = [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--nnodes", "1:2",
               "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
               endpoint, "--rdzv-id", "chaos", "--rdzv-conf",
               "last_call_timeout=3,lease_ttl=2", "--local-addr", addr, "--monitor-interval",
               "0.1", "--no-status", "--preset", "tiny-cpu",
               "--state-dir", str(tmp / f"state{index}"), *script]
    else:
        rdzv = hosts[0].ip if hosts[0] is not None else "127.0.0.1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"{rdzv}:{port}", "--rdzv-id", "chaos", "--local-addr", addr,
               # one hostname for every namespace: torch cannot tell which node hosts the store
               "--rdzv-conf", f"is_host={'true' if index == 0 else 'false'}",
               "--max-restarts", "3", "--monitor-interval", "0.1", *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CHAMELEON_COLLECTIVE_TIMEOUT_S="30")
    if launcher == "torchrun":
        # its best setting: with the rendezvous store shared with workers, restarted workers
        # meet stale keys (connectFullMesh fails; see benchmarks/recovery.py)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if host is not None:
        env["GLOO_SOCKET_IFNAME"] = host.inside
        cmd = [*host.wrap(), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    node = Node(f"node{index}", proc, host)
    node.read()
    return node


def step_lines(nodes: list[Node]) -> list[tuple[float, int, float]]:
    """(time printed, step, loss) of every step line of ``nodes``, in time order."""
    found = []
    for node in nodes:
        for t, text in list(node.lines):
            m = STEP.match(text)
            if m:
                found.append((t, int(m.group(1)), float(m.group(2))))
    return sorted(found)


def last_step(nodes: list[Node]) -> int:
    return max((s for _, s, _ in step_lines(nodes)), default=-1)


def events(tmp: Path) -> list[dict]:
    found = []
    for path in tmp.glob("state*/events.jsonl"):
        with contextlib.suppress(OSError):
            found += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return sorted(found, key=lambda e: e["ts"])


class Trial:
    def __init__(self, launcher: str, faults: list[str], rng: random.Random, netns: bool,
                 steps: int, deadline: float, stall: float) -> None:
        self.launcher, self.faults, self.rng = launcher, faults, rng
        self.netns, self.steps, self.deadline, self.stall = netns, steps, deadline, stall
        self.injected: list[dict] = []

    def run(self) -> dict:
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmpdir, testbed(self.netns) as (
                bed, hosts):
            tmp = Path(tmpdir)
            with self._etcd(bed) as etcd:
                endpoint = etcd.endpoints if etcd is not None else ""
                port = _free_port()
                nodes = [launch(self.launcher, i, hosts, endpoint, self.steps, tmp, port)
                         for i in range(2)]
                try:
                    return self._drive(nodes, bed, etcd, tmp)
                finally:
                    for node in nodes:
                        node.refresh()
                        _signal([node.proc.pid, *node.family], signal.SIGKILL)
                    for node in nodes:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            node.proc.wait(10)

    @contextlib.contextmanager
    def _etcd(self, bed):
        if self.launcher != "chameleon":
            yield None
            return
        from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster

        cluster = LocalEtcdCluster(3, host=bed.bridge_ip if bed is not None else "127.0.0.1")
        with cluster:
            yield cluster

    def _drive(self, nodes: list[Node], bed, etcd, tmp: Path) -> dict:
        self._end = time.monotonic() + self.deadline
        self._nodes = nodes
        alive_nodes = list(nodes)
        if not self._wait(lambda: len(_world(nodes)) >= 4 and last_step(nodes) >= 3):
            return self._outcome(nodes, alive_nodes, True, tmp)
        for kind in self.faults:
            begin = last_step(alive_nodes)
            if not self._wait(lambda b=begin: last_step(alive_nodes) >= b + 3 + self.rng.random()):
                break
            for node in nodes:
                node.refresh()
            self._inject(kind, alive_nodes, bed, etcd, tmp)
        # whatever is still running must finish
        finished = self._wait(lambda: all(n.proc.poll() is not None for n in alive_nodes))
        return self._outcome(nodes, alive_nodes, not finished, tmp)

    def _wait(self, predicate) -> bool:
        """Poll ``predicate`` until it holds; False once the run stalls or passes its deadline.

        A run stalls when no node prints a step for ``stall`` seconds: a launcher that waits
        forever for a frozen peer is hung, however long the deadline.
        """
        while time.monotonic() < self._end:
            if predicate():
                return True
            latest = max((t for t, _, _ in step_lines(self._nodes)), default=None)
            started = self._end - self.deadline   # monotonic start of the run
            quiet = time.time() - latest if latest is not None else time.monotonic() - started
            if quiet > self.stall:
                return False
            time.sleep(0.05)
        return False

    def _inject(self, kind: str, alive_nodes: list[Node], bed, etcd, tmp: Path) -> None:
        node_fault = kind in ("node-kill", "node-stop", "partition")
        if node_fault and len(alive_nodes) < 2:
            kind = "worker-kill"   # never take the last node: nothing would be left to say
        if kind in ETCD_FAULTS and etcd is None:
            self.injected.append({"kind": kind, "skipped": "no etcd under torchrun + c10d"})
            return
        if kind == "partition" and bed is None:
            self.injected.append({"kind": kind, "skipped": "no network namespaces"})
            return
        target = self.rng.choice(alive_nodes)
        printed = last_step(alive_nodes)
        at = time.time()
        if kind in ("worker-kill", "worker-stop", "slow-device", "recovery-kill"):
            workers = [p for n in alive_nodes for p in n.workers()]
            if not workers:
                return
            victim = self.rng.choice(workers)
            if kind == "slow-device":
                threading.Thread(target=_duty_cycle, args=(victim,), daemon=True).start()
            else:
                _signal([victim], signal.SIGSTOP if kind == "worker-stop" else signal.SIGKILL)
            if kind == "recovery-kill" and len(workers) > 1:
                second = self.rng.choice([w for w in workers if w != victim])
                threading.Timer(self.rng.uniform(0.05, 0.5), _signal,
                                ([second], signal.SIGKILL)).start()
        elif kind in ("node-kill", "node-stop"):
            _signal([target.proc.pid, *target.family],
                    signal.SIGKILL if kind == "node-kill" else signal.SIGSTOP)
            alive_nodes.remove(target)
        elif kind == "partition":
            bed.cut(target.host)
            alive_nodes.remove(target)
        elif kind == "etcd-restart":
            etcd.restart(self.rng.randrange(len(etcd.members)))
        else:
            killed = etcd.leader()
            etcd.kill(killed)
        record = {"kind": kind, "at": at, "printed": printed}
        self.injected.append(record)
        self._wait(lambda: last_step(alive_nodes) > printed)
        if kind == "etcd-leader":
            # its supervisor brings the member back: a second leader kill in the same run must
            # not take the cluster's quorum (two of three members), which nothing survives
            etcd.restart(killed)
        after = [t for t, s, _ in step_lines(alive_nodes) if s > printed and t >= at]
        record["recovery_s"] = (min(after) - at) if after else None
        found = [e["ts"] for e in events(tmp) if e["event"] == "failure_seen" and e["ts"] >= at]
        record["detect_s"] = (min(found) - at) if found else None

    def _outcome(self, nodes: list[Node], alive_nodes: list[Node], hung: bool,
                 tmp: Path) -> dict:
        text = "".join(n.text() for n in nodes)
        codes = [n.proc.poll() for n in alive_nodes]
        printed = {s: loss for _, s, loss in step_lines(nodes)}   # the last value wins
        if hung:
            outcome = "hung"
        elif all(c == 0 for c in codes) and sorted(printed) == list(range(self.steps)):
            outcome = "finished"
        elif all(c in ENDINGS for c in codes) and SENTENCE.search(text) and (
                "Traceback" not in text or self.launcher != "chameleon"):
            outcome = "ended"
        else:
            outcome = "failed"
        declared = sum(1 for e in events(tmp) if e["event"] == "failure_seen"
                       and str(e.get("reason", "")).startswith("hung"))
        stacks = {f"{n.name}-stacks": _stacks(n.proc.pid, tmp) for n in alive_nodes
                  if hung and n.proc.poll() is None}
        return {"launcher": self.launcher, "faults": self.injected, "outcome": outcome,
                "exit_codes": codes, "losses": printed, "hung_declared": declared,
                "output": stacks | {n.name: n.text() for n in nodes} | {
                    f"{p.parent.name}-events": p.read_text()
                    for p in tmp.glob("state*/events.jsonl")} | {
                    f"{p.parent.parent.name}-{p.name.removesuffix('.log')}": p.read_text()
                    for p in tmp.glob("state*/logs/*.stderr.log")}}


def _stacks(launcher: int, tmp: Path) -> str:
    """Where a hung launcher and its workers wait (demo_kills.dump: py-spy, when installed):
    a hang that cannot be reproduced at will is otherwise a mystery."""
    path = tmp / f"stacks-{launcher}.txt"
    dump(launcher, path)
    return path.read_text() if path.exists() else "py-spy is not installed: no stacks\n"


def _world(nodes: list[Node]) -> set[int]:
    """Processes training in the newest world: both nodes' workers, before any fault."""
    for node in nodes:
        node.refresh()
    return {p for node in nodes for p in node.workers()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the report


def draw(rng: random.Random, kinds: tuple[str, ...]) -> list[str]:
    return [rng.choice(kinds) for _ in range(rng.randint(1, 3))]


def reference(netns: bool, steps: int) -> dict[int, float]:
    """Losses of a failure-free chameleon-run of the same job (4 decimals are compared)."""
    result = Trial("chameleon", [], random.Random(0), netns, steps, 300, 60).run()
    output = result.pop("output")
    if result["outcome"] != "finished":
        for name, text in output.items():
            sys.stderr.write(f"--- {name}\n{text[-3000:]}\n")
        raise SystemExit(f"the failure-free reference run did not finish: {result['outcome']}")
    return result["losses"]


def summarise(results: list[dict], ref: dict[int, float]) -> dict:
    table: dict = {}
    for r in results:
        bad = sum(1 for s, v in r["losses"].items() if s in ref and round(v, 4) != round(ref[s], 4))
        r["losses_differ"] = bad
        for f in r["faults"]:
            if "skipped" in f:
                continue
            row = table.setdefault((r["launcher"], f["kind"]), {
                "runs": 0, "finished": 0, "ended": 0, "failed": 0, "hung": 0, "detect": [],
                "recover": [], "losses_differ": 0, "hung_declared": None})
            row["runs"] += 1
            row[r["outcome"]] += 1
            row["losses_differ"] += bad
            if "hung_declared" in r:   # journals before the slow device have none
                row["hung_declared"] = (row["hung_declared"] or 0) + r["hung_declared"]
            if f.get("detect_s") is not None:
                row["detect"].append(f["detect_s"])
            if f.get("recovery_s") is not None:
                row["recover"].append(f["recovery_s"])
    out = {}
    for (launcher, kind), row in sorted(table.items()):
        out[f"{launcher}/{kind}"] = {
            k: v for k, v in row.items() if k not in ("detect", "recover")} | {
            "detect_median_s": statistics.median(row["detect"]) if row["detect"] else None,
            "detect_max_s": max(row["detect"]) if row["detect"] else None,
            "recover_median_s": statistics.median(row["recover"]) if row["recover"] else None,
            "recover_max_s": max(row["recover"]) if row["recover"] else None}
    return out


def print_table(report: dict) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"\nchaos: {report['trials']} trials, 1-3 faults each (seed {report['seed']}), tiny GPT "
          f"on 2 nodes x 2 gloo workers, {'network namespaces' if report['netns'] else 'loopback'}")
    print(f"{'launcher/fault':24s} {'runs':>5s} {'finished':>9s} {'ended':>6s} {'failed':>7s} "
          f"{'hung':>5s} {'detect s med/max':>17s} {'recover s med/max':>18s} {'loss !=':>8s} "
          f"{'declared hung':>13s}")
    for key, row in report["summary"].items():
        print(f"{key:24s} {row['runs']:>5d} {row['finished']:>9d} {row['ended']:>6d} "
              f"{row['failed']:>7d} {row['hung']:>5d} "
              f"{fmt(row['detect_median_s']):>8s}/{fmt(row['detect_max_s']):<8s} "
              f"{fmt(row['recover_median_s']):>9s}/{fmt(row['recover_max_s']):<8s} "
              f"{row['losses_differ']:>8d} {str(row.get('hung_declared', '-')).replace('None', '-'):>13s}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50,
                        help="runs per launcher (0 with --journal: only the failure-free "
                             "reference run, kept for trials that --resume)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds a run may take before it counts as hung")
    parser.add_argument("--stall", type=float, default=90.0,
                        help="seconds without a new step line before a run counts as hung")
    parser.add_argument("--faults", metavar="KIND,KIND",
                        help=f"the same faults in every trial instead of random ones ({', '.join(KINDS)})")
    parser.add_argument("--no-netns", action="store_true",
                        help="loopback only (no partitions), also when root could")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--logs", metavar="DIR", type=Path,
                        help="write each run's launcher output, events and workers' stderr to "
                             "DIR/<trial>-<launcher>-<name>.log")
    parser.add_argument("--journal", metavar="FILE", type=Path,
                        help="append the settings, the reference and each run as JSON lines as "
                             "they finish (a long run that is stopped keeps its results)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the --journal of a stopped run of the same --seed, "
                             "--steps and launchers: its trials and reference are kept, the rest run")
    parser.add_argument("--table-from", metavar="FILE",
                        help="print the table of a --json report or of a --journal, then exit")
    args = parser.parse_args(argv)
    if args.table_from:
        report = _from_journal(Path(args.table_from))
        print(json.dumps(report, indent=2, default=str)) if args.json else print_table(report)
        return
    launchers = [x for x in args.launchers.split(",") if x]
    if set(launchers) - set(LAUNCHERS) or args.trials < (0 if args.journal else 1):
        parser.error(f"--launchers takes {', '.join(LAUNCHERS)}; --trials must be >= 1 "
                     "(0 with --journal: the reference run alone, for later --resume).")
    netns = not args.no_netns
    if netns:
        from chameleon_elastic.rendezvous.local_hosts import unavailable

        why = unavailable()
        if why:
            print(f"  no partitions: {why}", file=sys.stderr)
            netns = False
    kinds = KINDS if netns else tuple(k for k in KINDS if k != "partition")
    rng = random.Random(args.seed)
    fixed = [k for k in (args.faults or "").split(",") if k]
    if set(fixed) - set(kinds):
        parser.error(f"--faults takes {', '.join(kinds)} here.")
    plans = [fixed or draw(rng, kinds) for _ in range(args.trials)]
    results: list[dict] = []
    if args.resume:
        if not (args.journal and args.journal.exists()):
            parser.error("--resume needs the --journal FILE of the run to go on with.")
        header, results = _journal(args.journal)
        settings = {"seed": args.seed, "netns": netns, "steps": args.steps}
        if any(header[k] != v for k, v in settings.items()) or any(
                r["launcher"] not in launchers for r in results):
            parser.error(f"{args.journal} was written with other settings "
                         f"({ {k: header[k] for k in settings} }); pass the same ones, or drop --resume.")
        results = results[: len(results) // len(launchers) * len(launchers)]   # whole trials
        ref = header["reference"]
        print(f"  resuming after {len(results) // len(launchers)} trials of {args.journal}",
              file=sys.stderr, flush=True)
    else:
        print("  failure-free reference run", file=sys.stderr, flush=True)
        ref = reference(netns, args.steps)
        header = {"seed": args.seed, "netns": netns, "steps": args.steps, "reference": ref}
    if args.journal:   # rewritten whole: a trial cut off by the stop is dropped
        args.journal.write_text("".join(json.dumps(x, default=str) + "\n"
                                        for x in [header, *results]))
    if not plans:   # --trials 0: the journal holds the reference, for trials to --resume
        print(f"  reference of {len(ref)} steps written to {args.journal}", file=sys.stderr)
        return
    done = len(results) // len(launchers)
    for i, faults in enumerate(plans):
        if i < done:
            continue
        for launcher in launchers:
            r = Trial(launcher, faults, random.Random(args.seed * 1000 + i), netns, args.steps,
                      args.deadline, args.stall).run()
            results.append(r)
            if args.journal:
                with args.journal.open("a") as fh:
                    fh.write(json.dumps({k: v for k, v in r.items() if k != "output"},
                                        default=str) + "\n")
            for name, text in r.pop("output").items():
                if args.logs:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / f"{i + 1:03d}-{launcher}-{name}.log").write_text(text)
            print(f"  trial {i + 1:3d} {launcher:9s} {'+'.join(faults):40s} {r['outcome']}",
                  file=sys.stderr, flush=True)
    report = {"benchmark": "chaos", "trials": args.trials, "seed": args.seed, "netns": netns,
              "steps": args.steps, "summary": summarise(results, ref), "results": results}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_table(report)


def _from_journal(path: Path) -> dict:
    """A report from a --json report or from a --journal (complete trials only)."""
    text = path.read_text()
    try:
        return json.loads(text)   # a --json report is one document
    except json.JSONDecodeError:
        pass                      # a journal is one document per line
    header, results = _journal(path)
    ref = header["reference"]
    launchers = {r["launcher"] for r in results}
    trials = len(results) // max(1, len(launchers))
    results = results[: trials * len(launchers)]
    return {"benchmark": "chaos", "trials": trials, "seed": header["seed"],
            "netns": header["netns"], "steps": header["steps"],
            "summary": summarise(results, ref), "results": results}


def _journal(path: Path) -> tuple[dict, list[dict]]:
    """The header and the runs of a --journal, with step numbers as ints again (JSON keys)."""
    header, *results = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    header["reference"] = {int(k): v for k, v in header["reference"].items()}
    for r in results:
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
    return header, results


if __name__ == "__main__":
    main()
