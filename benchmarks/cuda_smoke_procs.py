"""``cuda_smoke.py --procs N [--kill] [--device cuda|cpu]``: several workers sharing one GPU.

The flow, each part a row of the table (``cuda_smoke.py``'s docstring says why):

1. **gloo and device tensors** (two bare processes, a gloo world, tensors on the device): the
   collectives the runtime uses on device tensors (all-reduce: the gradient sums; broadcast;
   all-gather) and its point-to-point transfers through runtime/world/wire.py, checked for
   their values; and, in a world of its own so that a crash stays there, a raw ``dist.isend`` /
   ``dist.recv`` of a device tensor, reported as it went (a note, not a check: torch's source
   says it cannot work on a GPU, which is why wire.py stages those transfers).
2. **the job**: ``chameleon-run --standalone --nproc-per-node N --job <one pipeline of N
   stages, the tiny-cpu-pp4 preset's model>`` with in-memory snapshots every ``--snapshot-every``
   steps, the worker benchmarks/cuda_smoke_worker.py on ``--device`` (every process on GPU 0),
   ``CHAMELEON_BACKEND=gloo``; with ``--kill``, a ``kill -9`` of device N // 2's worker right
   after step ``--kill-at`` is printed. Its layers exist nowhere else: the survivors go back to
   the partner's snapshot in host memory and train the steps since again, in place.
3. **checks and figures**: exit status, every step reported once (and the steps redone), each
   loss against single-process float64 training on the CPU (``toy.reference_training``, rtol
   ``--rtol``), the ``recovered`` event (in place, from the snapshot, its phases), kill -> next
   new step, every survivor's layers on the device and its transfers staged as wire.py decides,
   the memory each survivor held after its last step before the kill and holds afterwards
   (the plugin's figures), the device's (``torch.cuda.mem_get_info``; nvidia-smi's
   per-process list where present: the killed worker must hold nothing), the device's memory
   before the job and once it is gone (on a GPU all of it must be back, within
   ``RETURNED_MIB``), and no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import psutil
from launched import supervise, worker_of

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "cuda_smoke_worker.py"
STEP = re.compile(r"^(?:\S+ )?step\s+(\d+)\s+loss\s+(\S+)(.*)$")
LAYERS = 8          # the worker's model, and the preset's
MICRO_BATCHES = 8   # the preset's global micro-batches (micro-batch size 1)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather")


@dataclass
class Options:
    procs: int
    kill: bool
    device: str            # "cuda" or "cpu" (the dry run)
    steps: int = 16
    kill_at: int = 10
    snapshot_every: int = 4
    width: int = 64
    rtol: float = 1e-6
    deadline_s: float = 240.0

    @property
    def victim(self) -> int:
        return self.procs // 2


@dataclass
class Row:
    """One line of the table: ``passed`` None is a note (reported, not judged)."""

    check: str
    passed: bool | None
    detail: str


@dataclass
class Launched:
    """What one chameleon-run of the job left: its console, the kill, its files."""

    code: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    killed_at: float | None = None
    killed_pid: int | None = None
    left_behind: list[int] = field(default_factory=list)
    reported: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    pids: dict[int, list[int]] = field(default_factory=dict)
    recovered: dict | None = None
    stderr: dict[str, list[str]] = field(default_factory=dict)   # worker log -> its tail
    device_before: dict = field(default_factory=dict)   # device_used() before the job
    device_after: dict = field(default_factory=dict)    # and once it was gone


# ----------------------------------------------------------------------------- 1. gloo probes


def _device(device_type: str):
    import torch

    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def probe_collectives(rank: int, world: int, device_type: str) -> dict:
    """In a gloo world: the runtime's collectives on device tensors, and its staged
    point-to-point transfers (wire.py), each checked for its values."""
    import torch
    import torch.distributed as dist

    from chameleon_elastic.runtime.world import wire

    dev = _device(device_type)
    summed = torch.full((4,), float(rank + 1), dtype=torch.float64, device=dev)
    dist.all_reduce(summed)
    cast = torch.full((3,), float(rank), device=dev)
    dist.broadcast(cast, src=0)
    parts = [torch.zeros(2, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
    got = {"all_reduce": summed.cpu().tolist() == [world * (world + 1) / 2] * 4,
           "broadcast": cast.cpu().tolist() == [0.0] * 3,
           "all_gather": [p.cpu().tolist() for p in parts] == [[float(r)] * 2
                                                                 for r in range(world)]}
    sent = torch.arange(6, dtype=torch.float64, device=dev) * 7
    if rank == 0:
        wire.isend(sent, dst=1, tag=3).wait()
    elif rank == 1:
        buf = torch.zeros(6, dtype=torch.float64, device=dev)
        wire.recv(buf, src=0, tag=3)
        got["p2p"] = buf.cpu().tolist() == sent.cpu().tolist() and buf.device == dev
    got["through_host"] = wire.through_host(dev)
    return got


def probe_raw(rank: int, world: int, device_type: str) -> str:
    """A device tensor handed to gloo's send / recv as it is (what wire.py avoids)."""
    import torch
    import torch.distributed as dist

    dev = _device(device_type)
    sent = torch.arange(6, dtype=torch.float64, device=dev) * 7
    try:
        if rank == 0:
            dist.isend(sent, dst=1).wait()
            return "sent"
        buf = torch.zeros(6, dtype=torch.float64, device=dev)
        dist.recv(buf, src=0)
        return "received, right" if torch.equal(buf.cpu(), sent.cpu()) else "received, WRONG"
    except RuntimeError as exc:
        return f"raised: {str(exc).splitlines()[0][:160]}"


def probes(device_type: str) -> list[Row]:
    from chameleon_elastic.runtime.world.local_world import LocalWorldError, run_local_world

    where = "cuda tensors" if device_type == "cuda" else "CPU tensors (dry run)"
    rows = []
    try:
        got = run_local_world(probe_collectives, 2, device_type, timeout_s=90,
                              collective_timeout_s=20)
        bad = sorted({k for g in got for k, v in g.items() if k in COLLECTIVES and not v})
        rows.append(Row(f"gloo + {where}: all-reduce, broadcast, all-gather", not bad,
                        "values right on both ranks" if not bad else f"wrong: {bad}"))
        staged = got[1]["through_host"]
        expected = device_type == "cuda"
        rows.append(Row(f"gloo + {where}: send / recv through runtime/world/wire.py",
                        got[1].get("p2p") is True and staged == expected,
                        f"values right: {got[1].get('p2p')}; through host memory: {staged} "
                        f"(expected {expected})"))
    except LocalWorldError as exc:
        rows.append(Row(f"gloo + {where}: collectives and wire.py transfers", False,
                        str(exc).splitlines()[0][:200]))
    try:
        raw = run_local_world(probe_raw, 2, device_type, timeout_s=60, collective_timeout_s=15)
        detail = f"send: {raw[0]}; recv: {raw[1]}"
    except LocalWorldError as exc:
        detail = f"a rank died or hung: {str(exc).splitlines()[0][:200]}"
    rows.append(Row(f"gloo + {where}: raw dist.isend / dist.recv (not used by the runtime)",
                    None, detail))
    return rows


# ----------------------------------------------------------------------------- 2. the job


def job_text(procs: int) -> str:
    """The tiny-cpu-pp4 preset (one pipeline, a single replica per stage) on ``procs``
    devices: ``procs`` stages."""
    text = resources.files("chameleon_elastic.presets").joinpath("tiny-cpu-pp4.toml").read_text()
    text = re.sub(r"(?m)^devices = \d+", f"devices = {procs}", text)
    text = re.sub(r"(?m)^pp = \d+", f"pp = {procs}", text)
    return re.sub(r'(?m)^name = ".*"', f'name = "cuda-smoke-pp{procs}"', text)


def command(opts: Options, job: Path, out: Path, state: Path) -> list[str]:
    return [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
            "--nproc-per-node", str(opts.procs), "--job", str(job),
            "--snapshot-every", str(opts.snapshot_every), "--stragglers", "off",
            "--monitor-interval", "0.1", "--no-status", "--state-dir", str(state),
            str(WORKER), str(out), str(opts.steps), "--device", opts.device,
            "--width", str(opts.width)]


def _read(proc: subprocess.Popen, opts: Options, run: Launched) -> None:
    """Keep the console with times; strike the kill right after step ``kill_at``'s line."""
    for text in proc.stdout:
        now = time.monotonic()
        run.lines.append((now, text.rstrip()))
        m = STEP.match(text.strip())
        if (opts.kill and run.killed_at is None and m and not m.group(3).strip()
                and int(m.group(1)) >= opts.kill_at):
            victim = worker_of(proc.pid, opts.victim, script=WORKER.stem)
            if victim is not None:
                run.killed_pid, run.killed_at = victim, time.monotonic()
                os.kill(victim, signal.SIGKILL)


def _leftovers(pids: dict[int, list[int]]) -> list[int]:
    """Processes of the run still alive after the launcher was reaped: killed, and named."""
    alive = []
    for pid in (p for ps in pids.values() for p in ps):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def launch(opts: Options) -> Launched:
    """One run of the job under chameleon-run, bounded by ``opts.deadline_s``; every process it
    started is killed at the end (supervise), and any worker still alive after that is named."""
    run = Launched()
    with tempfile.TemporaryDirectory(prefix="cuda-smoke-") as tmp:
        out, state, job = Path(tmp, "out"), Path(tmp, "state"), Path(tmp, "job.toml")
        out.mkdir()
        job.write_text(job_text(opts.procs))
        # the workers import the chameleon_elastic this process imported, wherever it is
        env = dict(os.environ, CHAMELEON_BACKEND="gloo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen(command(opts, job, out, state), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                                start_new_session=True)
        reader = threading.Thread(target=_read, args=(proc, opts, run), daemon=True)
        reader.start()
        run.code = supervise(proc, opts.deadline_s)
        reader.join(10)
        _collect(run, out, state)
    return run


def _collect(run: Launched, out: Path, state: Path) -> None:
    for path in out.glob("pid-*"):
        run.pids[int(path.name.split("-")[1])] = [int(x) for x in path.read_text().split()]
    run.left_behind = _leftovers(run.pids)
    steps = out / "steps.jsonl"
    if steps.exists():
        run.reported = [json.loads(x) for x in steps.read_text().splitlines() if x.strip()]
    run.memory = sorted((json.loads(p.read_text()) for p in out.glob("memory-*.json")),
                        key=lambda m: m["device"])
    for log in sorted((state / "logs").glob("*")) if (state / "logs").is_dir() else ():
        if log.is_file() and log.stat().st_size:
            run.stderr[log.name] = log.read_text(errors="replace").splitlines()[-15:]
    events = state / "events.jsonl"
    if events.exists():
        recovered = [e for e in (json.loads(x) for x in events.read_text().splitlines()
                                 if x.strip()) if e.get("event") == "recovered"]
        run.recovered = recovered[-1] if recovered else None


# ----------------------------------------------------------------------------- memory

_USED = ("import json, torch; free, total = torch.cuda.mem_get_info(0); "
         "print(json.dumps([total - free, total]))")
RETURNED_MIB = 128   # what the device may hold more after the job than before it


def device_used(device_type: str, timeout_s: float = 90.0) -> dict:
    """The device's used and total memory now, every process's use counted. On a GPU asked
    of a short-lived process (the driver keeps no CUDA context of its own, so the workers'
    figures are theirs; the probe's own context counts in every reading alike); the host's
    memory on the dry run. ``error`` instead when the question failed or timed out."""
    if device_type != "cuda":
        vm = psutil.virtual_memory()
        return {"used": int(vm.total - vm.available), "total": int(vm.total)}
    try:
        done = subprocess.run([sys.executable, "-c", _USED], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        used, total = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    return {"used": int(used), "total": int(total)}


def device_after(device_type: str, before: dict, tries: int = 3) -> dict:
    """``device_used`` once the job is gone; asked again (up to ``tries`` times, each a new
    process) while the device still holds more than before, since a killed process's memory
    is given back by the driver as the process is torn down, which may trail its exit."""
    after = device_used(device_type)
    for _ in range(tries - 1):
        if "used" not in after or "used" not in before or device_type != "cuda":
            break
        if after["used"] - before["used"] <= RETURNED_MIB * 2**20:
            break
        after = device_used(device_type)
    return after


def before_kill(run: Launched) -> None:
    """Each survivor's figures after the last step it finished before the kill (``history``,
    on the machine's monotonic clock like the kill), as ``before_kill`` in its record."""
    for m in run.memory:
        history = m.get("history") or []
        before = [h for h in history if run.killed_at is None or h["t"] < run.killed_at]
        m["before_kill"] = before[-1] if before and run.killed_at is not None else None


# ----------------------------------------------------------------------------- 3. checks


def kill_to_next_step(run: Launched, after: int) -> float | None:
    """Seconds from the kill to the first line of a step past ``after`` not trained before."""
    if run.killed_at is None:
        return None
    for t, text in run.lines:
        m = STEP.match(text.strip())
        if t > run.killed_at and m and int(m.group(1)) > after and not m.group(3).strip():
            return t - run.killed_at
    return None


def training_rows(opts: Options, run: Launched) -> list[Row]:
    from chameleon_elastic.models.toy import mlp_model, reference_training

    fresh = [r["step"] for r in run.reported if not r["redone"]]
    again = [r["step"] for r in run.reported if r["redone"]]
    once = fresh == list(range(opts.steps))
    code = "none (hung: killed at the deadline)" if run.code is None else run.code
    rows = [Row(f"job: {opts.procs} workers, {opts.steps} steps" + (
        f", kill -9 of device {opts.victim} after step {opts.kill_at}" if opts.kill else ""),
        run.code == 0 and once, f"exit {code}; every step reported once: {once}; "
        f"trained again: {again or 'none'}")]
    ref, _ = reference_training(mlp_model(layers=LAYERS, width=opts.width), opts.steps,
                                MICRO_BATCHES)
    worst = max((abs(r["loss"] - ref[r["step"]]) / max(abs(ref[r["step"]]), 1e-12)
                 for r in run.reported), default=float("inf"))
    rows.append(Row("losses = failure-free single-process reference (float64, CPU)",
                    bool(run.reported) and worst <= opts.rtol,
                    f"{len(run.reported)} lines, max relative difference {worst:.1e} "
                    f"(rtol {opts.rtol:g})"))
    return rows


def recovery_rows(opts: Options, run: Launched) -> list[Row]:
    if not opts.kill:
        return []
    r = run.recovered or {}
    survivors = [d for d in range(opts.procs) if d != opts.victim]
    first = all(len(run.pids.get(d, [])) == 1 for d in survivors)
    moved = r.get("transfer_bytes")
    ok = (run.killed_pid is not None and r.get("mode") == "inplace"
          and r.get("source") == "snapshot" and first)
    return [Row(f"recovered in place from the in-memory snapshot (device {opts.victim} "
                "killed)", ok,
                f"killed pid {run.killed_pid}; mode {r.get('mode')}, source {r.get('source')}, "
                f"resumed at step {r.get('resumed_step')}, {r.get('redone_steps')} steps "
                f"redone, {r.get('moved_layers')} layers moved "
                f"({'-' if moved is None else f'{moved:.0f}'} B); "
                f"survivors in their first processes: {first}")]


def placement_rows(opts: Options, run: Launched) -> list[Row]:
    survivors = [d for d in range(opts.procs) if d != opts.victim or not opts.kill]
    mem = {m["device"]: m for m in run.memory}
    want = "cuda:0" if opts.device == "cuda" else "cpu"
    placed = all(mem.get(d, {}).get("layers_on") == [want] for d in survivors)
    staged = all(mem.get(d, {}).get("through_host") == (opts.device == "cuda")
                 for d in survivors)
    held = sorted({x for m in run.memory for x in m["layers"]})
    return [Row(f"every survivor trains on {want}, its transfers staged as wire.py decides",
                placed and staged and held == list(range(LAYERS)),
                f"{len(mem)} of {len(survivors)} survivors reported; layers on {want}: "
                f"{placed}; transfers through host memory where wire.py should stage them "
                f"(on cuda over gloo) and only there: {staged}; layers held: {held}")]


def memory_rows(opts: Options, run: Launched) -> list[Row]:
    rows = []
    apps = next((m["nvidia_smi"] for m in run.memory if m.get("nvidia_smi") is not None), None)
    if opts.device == "cuda":
        mine = {m["pid"] for m in run.memory}
        listed = {a["pid"] for a in apps or []}
        if apps is None or not mine & listed:
            rows.append(Row("the killed worker holds no GPU memory", None,
                            "nvidia-smi absent, or it lists none of the survivors (a "
                            "container's pids): not visible here"))
        else:
            rows.append(Row("the killed worker holds no GPU memory (nvidia-smi)",
                            run.killed_pid not in listed,
                            f"compute processes: {sorted(listed)}; killed: {run.killed_pid}"))
    rows.append(device_row(opts, run))
    rows.append(Row("no process left behind", not run.left_behind,
                    f"alive after the launcher was reaped (killed now): {run.left_behind}"))
    return rows


def device_row(opts: Options, run: Launched) -> Row:
    """The device's memory before the job and once it is gone: on a GPU every byte the
    workers held, the killed one's included, must be back (within ``RETURNED_MIB``); on the
    dry run the host's memory moves with everything else on the machine, so it is a note."""
    before, after = run.device_before, run.device_after
    if "used" not in before or "used" not in after:
        return Row("device memory given back after the job", None,
                   f"not measured: before {before}, after {after}")
    grew = after["used"] - before["used"]
    detail = (f"used {before['used'] / 2**20:.0f} MiB before the job, "
              f"{after['used'] / 2**20:.0f} MiB after it ({grew / 2**20:+.0f} MiB; "
              f"{after['total'] / 2**30:.1f} GiB in all)")
    if opts.device != "cuda":
        return Row("host memory after the job (dry run: the machine's, not judged)", None,
                   detail)
    return Row(f"GPU memory given back after the job (within {RETURNED_MIB} MiB)",
               grew <= RETURNED_MIB * 2**20, detail)


def assess(opts: Options) -> tuple[list[Row], dict]:
    rows = probes(opts.device)
    before = device_used(opts.device)
    run = launch(opts)
    run.device_before, run.device_after = before, device_after(opts.device, before)
    before_kill(run)
    rows += training_rows(opts, run) + recovery_rows(opts, run)
    rows += placement_rows(opts, run) + memory_rows(opts, run)
    figures = {"kill_to_next_step_s": kill_to_next_step(run, opts.kill_at),
               "killed_pid": run.killed_pid, "exit_code": run.code,
               "recovered": run.recovered, "memory": run.memory, "reported": run.reported,
               "device_memory": {"before_job": run.device_before,
                                 "after_job": run.device_after}}
    if run.code != 0 or not all(r.passed is not False for r in rows):   # what to read
        figures["console_tail"] = [text for _, text in run.lines[-40:]]
        figures["worker_stderr"] = run.stderr
    return rows, figures


def crashed(exc: BaseException) -> tuple[list[Row], dict]:
    """What :func:`assess` gives when the smoke itself raised: one failed row naming it and
    empty figures, so that the table and the JSON still come out of an unattended GPU run
    (every process the job started is killed by then: :func:`launch`'s supervise)."""
    import traceback

    figures = {"kill_to_next_step_s": None, "killed_pid": None, "exit_code": None,
               "recovered": None, "memory": [], "reported": [],
               "device_memory": {"before_job": {}, "after_job": {}},
               "console_tail": traceback.format_exception(exc)[-12:]}
    return [Row("the smoke ran to its end", False,
                f"raised {type(exc).__name__}: {str(exc)[:200]}")], figures


def report(opts: Options, rows: list[Row], figures: dict, header: dict) -> dict:
    ok = all(r.passed is not False for r in rows)
    return {"benchmark": "cuda_smoke", "mode": "procs", **header, "options": asdict(opts),
            "ok": ok, "exit_status": 0 if ok else 1, "checks": [asdict(r) for r in rows],
            "figures": figures}


# ----------------------------------------------------------------------------- the table


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _phases(recovered: dict | None) -> str | None:
    from chameleon_elastic.launcher.observation.reporter import RECOVERY_PHASES

    if not recovered:
        return None
    parts = [f"{name} {recovered[f'{name}_s']:.3f}" for name in RECOVERY_PHASES
             if recovered.get(f"{name}_s") is not None]
    total = recovered.get("total_s")
    return ", ".join(parts) + (f"; total {total:.3f} s" if total is not None else "")


def _memory_lines(memory: list[dict], device: str) -> list[str]:
    if not memory:
        return ["memory afterwards: no survivor reported"]
    smi = {a["pid"]: a["used_mib"] for m in memory for a in (m.get("nvidia_smi") or [])}
    source = "the caching allocator" if device == "cuda" else "RSS"
    lines = [(f"memory per surviving process ({source}, MiB; before: after the last step "
              "finished before the kill, after: at the end):"),
             (f"  {'device':>6s} {'pid':>8s} {'alloc before':>12s} {'alloc after':>12s} "
              f"{'resv before':>12s} {'resv after':>12s} {'peak':>10s} {'nvidia-smi':>10s}")]
    for m in memory:
        b = m.get("before_kill") or {}
        lines.append(f"  {m['device']:>6d} {m['pid']:>8d} {_mib(b.get('allocated')):>12s} "
                     f"{_mib(m['allocated']):>12s} {_mib(b.get('reserved')):>12s} "
                     f"{_mib(m['reserved']):>12s} {_mib(m['peak']):>10s} "
                     f"{smi.get(m['pid'], '-')!s:>10s}")
    first = memory[0]
    used = first["device_total"] - first["device_free"]
    what = "GPU 0 (mem_get_info: every process)" if device == "cuda" else "host memory"
    lines.append(f"  {what} with the survivors alive: {used / 2**30:.2f} GiB used of "
                 f"{first['device_total'] / 2**30:.1f} GiB")
    return lines


def render(rep: dict) -> str:
    opts = rep["options"]
    lines = [(f"cuda_smoke --procs {opts['procs']}{' --kill' if opts['kill'] else ''} "
              f"--device {opts['device']}: torch {rep['torch']}, {rep['device_name']}, "
              f"{opts['procs']} workers on one device over gloo")]
    width = max(len(c["check"]) for c in rep["checks"])
    for c in rep["checks"]:
        status = {True: "ok  ", False: "FAIL", None: "note"}[c["passed"]]
        lines.append(f"{c['check']:{width}s}  {status}  {c['detail']}")
    fig = rep["figures"]
    if opts["kill"]:
        nxt = fig["kill_to_next_step_s"]
        lines.append(f"kill -9 -> next new step: {'-' if nxt is None else f'{nxt:.2f} s'}")
        lines.append(f"recovery phases (the recovered event, s): {_phases(fig['recovered'])}")
    lines += _memory_lines(fig["memory"], opts["device"])
    dm = fig["device_memory"]
    lines.append("device memory, before the job / after it: "
                 f"{_mib(dm['before_job'].get('used'))} / {_mib(dm['after_job'].get('used'))} "
                 "MiB used")
    lines.append(f"exit status: chameleon-run {fig['exit_code']}; this smoke {rep['exit_status']}")
    lines += [f"  | {x}" for x in fig.get("console_tail", [])]
    for name, tail in fig.get("worker_stderr", {}).items():
        lines += [f"  {name}:", *(f"  ! {x}" for x in tail)]
    return "\n".join(lines)
