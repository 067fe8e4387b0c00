"""A Hugging Face model recovers in place under chameleon-run, with single-process results.

examples/train_hf.py trains a tiny Llama (tied embeddings, float64 master weights, fp32 compute,
AdamW, warm-up + cosine, clipping) in one process, then under ``chameleon-run --preset
tiny-cpu`` (2 pipelines x 2 stages) where device 3's worker is killed with SIGKILL after step
2; the launcher is forced to re-plan in one test and to reroute in the other. Both runs exit 0,
every step is reported once and none redone, the survivors keep their processes, the losses
equal the single-process run's at rtol 1e-9, and the two ``--export`` directories load in
transformers with weights equal at rtol 1e-9 (and different from the initial ones)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_hf.py")
STEPS = 8
TRAIN = ["--steps", str(STEPS), "--precision", "fp32", "--dtype", "float64", "--context", "32",
         "--log-every", "1", "--lr", "3e-3", "--warmup-steps", "2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _steps(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from .conftest import save_tiny

    return save_tiny(tmp_path_factory.mktemp("llama"), "llama-tiny", layers=6)  # 8 layers


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> tuple[list[float], Path]:
    """One process, no launcher (global batch 8 x 1 sample, as tiny-cpu's plan)."""
    out = tmp_path_factory.mktemp("reference")
    run = subprocess.run([sys.executable, EXAMPLE, "--model", str(model_dir), *TRAIN,
                          "--global-micro-batches", "8", "--micro-batch-size", "1",
                          "--losses", str(out / "steps.jsonl"), "--export", str(out / "A")],
                         check=False, capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    return [r["loss"] for r in _steps(out / "steps.jsonl")], out / "A"


def _worker_of(launcher: psutil.Process, device: int) -> psutil.Process | None:
    for proc in launcher.children(recursive=True):
        try:
            if proc.environ().get("CHAMELEON_DEVICE") == str(device) and \
                    "train_hf.py" in " ".join(proc.cmdline()):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _state(directory: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["replan", "reroute"])
def test_kill_9_recovers_in_place_with_single_process_results(model_dir, reference, policy,
                                                              tmp_path):
    ref_losses, ref_export = reference
    steps, state = tmp_path / "steps.jsonl", tmp_path / "state"
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115 - closed below
    launcher = subprocess.Popen(
        [sys.executable, "-m", "chameleon_elastic.launcher.cli", "--standalone",
         "--nproc-per-node", "4", "--preset", "tiny-cpu", "--policy", policy,
         "--state-dir", str(state), "--monitor-interval", "0.05", "--no-status", EXAMPLE,
         "--model", str(model_dir), *TRAIN, "--pace", "0.15", "--losses", str(steps),
         "--export", str(tmp_path / "B")],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        parent = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 60
        while not any(r["step"] >= 2 for r in _steps(steps)):
            assert launcher.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.05)
        workers = {d: _worker_of(parent, d) for d in range(4)}
        assert all(workers.values())
        workers[3].send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=90) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
    text = (tmp_path / "launcher.log").read_text()
    assert "Traceback" not in text
    reported = _steps(steps)
    assert [r["step"] for r in reported] == list(range(STEPS))   # each step once, in order
    assert not any(r["redone"] for r in reported)
    np.testing.assert_allclose([r["loss"] for r in reported], ref_losses, rtol=1e-9)
    events = [json.loads(x) for x in (state / "events.jsonl").read_text().splitlines()]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["mode"] == "inplace"
    assert sorted(recovered[0]["kept_devices"]) == [0, 1, 2]
    assert recovered[0]["started_devices"] == []
    assert "device 3 lost (SIGKILL)" in text and ("re-planned" if policy == "replan"
                                                   else "rerouted") in text
    # no survivor was started again (the agent's record), and the reporter, device 0, is the
    # process that was there before the kill for every step
    assert {r["pid"] for r in reported} == {workers[0].pid}
    want, got, initial = _state(ref_export), _state(tmp_path / "B"), _state(model_dir)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12,
                                   err_msg=name)
    assert all(not np.allclose(want[k], initial[k]) for k in want if k.endswith("proj.weight"))
