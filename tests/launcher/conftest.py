"""Helpers for launcher tests: start launchers as real process trees, poll with deadlines, and
kill whatever a test started (by its own process group) when it ends."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

PROBE = str(Path(__file__).parent / "workers" / "probe.py")
MLP_FAULTS = str(Path(__file__).parent / "workers" / "mlp_faults.py")

# tiny-cpu's model on 2 devices: half the worker start-ups of the preset's 4, for tests whose
# point needs only two processes
TWO_DEVICES = """
name = "two"
[model]
layers = 8
forward_s = 0.002
backward_s = 0.004
param_bytes = 1.0e6
optimizer_bytes = 2.0e6
activation_bytes = 2.0e5
[cluster]
devices = 2
device_memory_bytes = 2e9
bandwidth_bytes_per_s = 1e9
restart_s = 2.0
failure_rate_per_hour = 0.1
[training]
dp = {dp}
pp = {pp}
global_micro_batches = 8
"""


def two_device_job(directory: Path, replicas: bool = False) -> Path:
    """TWO_DEVICES as a --job file in ``directory``: one pipeline of two stages, or
    (``replicas``) two data-parallel replicas of the whole model, so that either can be lost."""
    job = directory / "two.toml"
    job.write_text(TWO_DEVICES.format(dp=2 if replicas else 1, pp=1 if replicas else 2))
    return job


@functools.cache
def mlp_reference(steps: int, featured: bool = False) -> tuple[list[float], dict[int, dict]]:
    """Single-process training of mlp_faults.py's model (float64): losses and final layers
    (``featured``: its --featured model, clipped as it clips)."""
    from chameleon_elastic.models.toy import featured_model, mlp_model, reference_training

    if featured:
        from .workers.mlp_faults import FEATURED, FEATURED_CLIP

        losses, layers = reference_training(featured_model(**FEATURED), steps, 8,
                                            max_grad_norm=FEATURED_CLIP)
    else:
        losses, layers = reference_training(mlp_model(layers=8), steps, 8)
    return losses, {i: {k: v.detach() for k, v in m.state_dict().items()}
                    for i, m in enumerate(layers)}


@functools.cache
def featured_ema(steps: int) -> dict[tuple[int, str], object]:
    """The single-process EMA (decay 0.9, toy.WeightEMA's) of the --featured model's layers."""
    from chameleon_elastic.models.toy import featured_model, reference_run

    from .workers.mlp_faults import FEATURED, FEATURED_CLIP

    start = reference_run(featured_model(**FEATURED), 0, 8).layers
    ema = {(i, k): p.detach().clone() for i, m in enumerate(start)
           for k, p in m.named_parameters()}

    def update(step, layers):
        for i, layer in enumerate(layers):
            for k, p in layer.named_parameters():
                ema[i, k] = 0.9 * ema[i, k] + 0.1 * p.detach()

    reference_run(featured_model(**FEATURED), steps, 8, max_grad_norm=FEATURED_CLIP,
                  after_step=update)
    return ema


def assert_single_process_results(out: Path, survivors: list[int], steps: int,
                                  restarted: tuple[int, ...] = (), featured: bool = False) -> None:
    """What mlp_faults.py left in ``out``: every step reported once by the job (whichever
    process reported it, whoever died when) and none redone, losses and every survivor's final
    layers equal to single-process training (rtol 1e-9), every layer held by some survivor,
    and each survivor ran in one process the whole time. ``restarted``: survivors that
    legitimately ran in a second process (a device that came back)."""
    import numpy as np
    import torch

    ref_losses, ref_params = mlp_reference(steps, featured)
    reported = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in reported}
    assert sorted(by_step) == list(range(steps))
    assert len(reported) == len(by_step), [r["step"] for r in reported]
    assert not any(r["redone"] for r in reported)
    np.testing.assert_allclose([r["loss"] for r in reported], [ref_losses[r["step"]] for r in
                                                                reported], rtol=1e-9, atol=1e-12)
    held = set()
    for device in survivors:
        runs = len((out / f"pid-{device}").read_text().split())
        assert runs == (2 if device in restarted else 1), f"device {device} ran {runs} times"
        params = torch.load(out / f"params-{device}.pt", weights_only=True)
        for layer, tensors in params.items():
            held.add(layer)
            for name, value in tensors.items():
                np.testing.assert_allclose(value.numpy(), ref_params[layer][name].numpy(),
                                           rtol=1e-9, atol=1e-12,
                                           err_msg=f"device {device} layer {layer} {name}")
        if featured:   # the EMA registered as per-layer state, through the same recovery
            ema = featured_ema(steps)
            for layer, shadow in torch.load(out / f"ema-{device}.pt",
                                            weights_only=True).items():
                for name, value in shadow.items():
                    np.testing.assert_allclose(value.numpy(), ema[layer, name].numpy(),
                                               rtol=1e-9, atol=1e-12,
                                               err_msg=f"device {device} EMA {layer} {name}")
    assert held == set(ref_params)


def launch_mlp(launch, tmp_path: Path, steps: int, *worker_args: str, flags: tuple = (),
               status: bool = False, two_devices: bool = False, replicas: bool = False):
    """chameleon-run --preset tiny-cpu over 4 workers of workers/mlp_faults.py (``two_devices``:
    TWO_DEVICES over 2, as two_device_job's ``replicas``): (launcher, its OUT directory, its
    state directory)."""
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    job = (["--nproc-per-node", "2", "--job", str(two_device_job(tmp_path, replicas))]
           if two_devices else ["--nproc-per-node", "4", "--preset", "tiny-cpu"])
    run = launch("chameleon", ["--standalone", *job,
                               "--state-dir", str(state), "--monitor-interval", "0.05",
                               *(() if status else ("--no-status",)), *flags, MLP_FAULTS,
                               str(out), str(steps), *worker_args])
    return run, out, state


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def read_envs(out: Path) -> list[dict]:
    """Every worker launch recorded by probe.py, oldest first."""
    records = []
    for path in out.glob("env-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(records, key=lambda r: r["time"])


def read_events(path: Path) -> list[dict]:
    """A chameleon-run event log (JSONL)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launcher:
    """One launcher process (chameleon-run or torchrun) in its own process group."""

    def __init__(self, tool: str, args: list[str], log: Path, env: dict | None = None,
                 wrap: list[str] | None = None) -> None:
        module = {"chameleon": "chameleon_elastic.launcher.cli",
                  "torchrun": "torch.distributed.run"}[tool]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.log = log
        self.args = args
        self._fh = open(log, "w")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", module, *args],
                                     stdout=self._fh,
                                     stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = self.where_workers_are() + self.where_launcher_is()
            self.kill()
            raise AssertionError(f"launcher did not finish in {timeout:.0f} s; {where}log:\n"
                                 + self.log.read_text()[-3000:]) from None
        finally:
            self._fh.close()

    def where_workers_are(self) -> str:
        """Each live test worker's innermost frames (workers/mlp_faults.py dumps its stack into
        its stderr file on SIGUSR2), so that a timeout names where every worker was stuck, and
        the agent's last events."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return ""
        workers, zombies = [], []
        for proc in children:
            try:
                if any("workers/" in part for part in proc.cmdline()):
                    workers.append(proc)
            except psutil.ZombieProcess:   # ended, never reaped: the agent is not polling
                zombies.append(proc.pid)
            except psutil.Error:
                pass
        logs: dict[int, tuple[Path, int, str]] = {}
        for proc in workers:
            with contextlib.suppress(OSError, psutil.Error):
                log = Path(os.readlink(f"/proc/{proc.pid}/fd/2"))
                if log.is_file():
                    logs[proc.pid] = (log, log.stat().st_size, proc.status())
                    proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(
                log.stat().st_size == size for log, size, _ in logs.values()):
            time.sleep(0.05)   # diagnostics only: the dumps are being written
        lines = []
        for pid, (log, size, status) in sorted(logs.items()):
            with open(log, "rb") as fh:
                fh.seek(size)
                dump = fh.read().decode(errors="replace").splitlines()
            frames = [x.split(" in ")[-1] for x in dump if x.strip().startswith("File ")][:5]
            lines.append(f"  {log.name} (pid {pid}, {status}): {' <- '.join(frames) or '-'}")
        state = self._state_dir()
        events = []
        if state is not None and (state / "events.jsonl").exists():
            events = [json.loads(x)["event"] for x in
                      (state / "events.jsonl").read_text().splitlines()[-4:]]
        if zombies:
            lines.append(f"  unreaped (zombie) children of the agent: {zombies}")
        return ("workers, innermost frame first:\n" + "\n".join(lines) + "\n"
                + (f"agent's last events: {', '.join(events)}\n" if events else ""))

    def where_launcher_is(self) -> str:
        """The launcher's own threads (py-spy, where installed: it is no dependency of ours),
        so that a launcher stuck outside Python's reach (a blocking C++ call) names the call."""
        if shutil.which("py-spy") is None:
            return ""
        dump = subprocess.run(["py-spy", "dump", "--pid", str(self.proc.pid)],
                              capture_output=True, text=True, timeout=20, check=False)
        return f"launcher's threads (py-spy):\n{dump.stdout[-4000:]}{dump.stderr[-500:]}\n"

    def _state_dir(self) -> Path | None:
        args = self.args
        return next((Path(b) for a, b in itertools.pairwise(args) if a == "--state-dir"), None)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._fh.close()


@pytest.fixture
def launch(tmp_path):
    started: list[Launcher] = []
    worker_pids: list[int] = []

    def start(tool: str, args: list[str], name: str = "launcher", env: dict | None = None,
              wrap: list[str] | None = None):
        launcher = Launcher(tool, args, tmp_path / f"{name}.log", env, wrap)
        started.append(launcher)
        return launcher

    start.worker_pids = worker_pids
    yield start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.kill()
    # workers run in their own sessions: end any that a failed test left behind (by pid)
    for out in tmp_path.rglob("env-*.json"):
        try:
            pid = json.loads(out.read_text())["pid"]
        except (OSError, json.JSONDecodeError, KeyError):
            continue
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
