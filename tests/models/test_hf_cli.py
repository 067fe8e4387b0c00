"""chameleon-job hf writes a job that matches the model (exact layer count and bytes, measured
figures it says it measured); it and train_hf.py refuse bad input in one line with exit 2: a
directory without a config, an unsupported architecture, a missing extra, a job whose layer
count does not match the model, a micro-batch size that disagrees with the job's. Without one,
precision=None follows the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_hf.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _job(*args: str, block_transformers: bool = False) -> subprocess.CompletedProcess:
    prelude = "import sys; sys.modules['transformers'] = None; " if block_transformers else ""
    code = (f"{prelude}from chameleon_elastic.models.jobfile import main; "
            f"sys.exit(main({list(args)!r}))" if prelude else None)
    cmd = [sys.executable, "-c", "import sys; " + code] if code else [
        sys.executable, "-m", "chameleon_elastic.models.jobfile", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=ENV)


def _one_line_exit_2(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip() and not x.startswith("[transf")]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_job_file_from_the_model(tiny_dirs, tmp_path):
    from chameleon_elastic.models import hf

    directory = tiny_dirs("llama-tiny", layers=3)
    out = _job("hf", str(directory), "--devices", "4", "--precision", "fp32",
               "-o", str(tmp_path / "job.toml"))
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "job.toml").read_text()
    assert "measured on this machine" in text and "by the runtime's profiler" in text
    spec = JobSpec.from_toml(tmp_path / "job.toml")
    model = hf.causal_lm(directory)
    assert spec.model.layers == model.num_layers == 5
    assert (spec.training.dp, spec.training.pp, spec.cluster.devices) == (2, 2, 4)
    assert spec.training.precision == "fp32" and spec.training.micro_batch_size == 4
    counts = hf.parameter_count(model)
    assert list(spec.model.param_bytes) == [4.0 * c for c in counts]
    assert all(o > 2 * p for o, p in zip(spec.model.optimizer_bytes, spec.model.param_bytes))
    assert all(t > 0 for t in spec.model.forward_s + spec.model.backward_s)
    # a decoder layer keeps more for its backward than the embedding does
    assert spec.model.activation_bytes[1] > spec.model.activation_bytes[0]


def test_job_usage_errors_are_one_line_with_exit_2(tiny_dirs, tmp_path):
    from transformers import OPTConfig

    _one_line_exit_2(_job("hf", str(tmp_path), "--devices", "4", "-o", "x.toml"),
                     "has no config.json")
    opt = tmp_path / "opt"
    OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
              num_attention_heads=2).save_pretrained(str(opt))
    _one_line_exit_2(_job("hf", str(opt), "--devices", "4", "-o", "x.toml"),
                     "is not supported", "llama")
    llama = str(tiny_dirs("llama-tiny", layers=3))
    _one_line_exit_2(_job("hf", llama, "--devices", "4", "--dp", "3", "--pp", "2",
                          "-o", "x.toml"), "do not fit")
    _one_line_exit_2(_job("hf", llama, "--devices", "4", "-o", "x.toml",
                          block_transformers=True), "pip install 'chameleon-elastic[hf]'")


def _train(directory: Path, tmp_path: Path, layers: int, *args: str,
           env: dict | None = None) -> subprocess.CompletedProcess:
    plan = ExecutionPlan("initial", 0, (Pipeline((0,), ((0, layers),), 2),)).validate()
    (tmp_path / "plan.json").write_text(plan.to_json())
    full = dict(ENV, CHAMELEON_PLAN_FILE=str(tmp_path / "plan.json"), **(env or {}))
    return subprocess.run([sys.executable, EXAMPLE, "--model", str(directory), "--steps", "1",
                           "--context", "16", *args], check=False, capture_output=True, text=True,
                          timeout=120, env=full)


def test_train_hf_refuses_a_job_of_another_layer_count(tiny_dirs, tmp_path):
    out = _train(tiny_dirs("llama-tiny", layers=3), tmp_path, 7)
    _one_line_exit_2(out, "plan has 7 layers but the model has 5", "model.layers = 5")


def test_train_hf_refuses_a_micro_batch_size_the_job_did_not_plan(tiny_dirs, tmp_path):
    out = _train(tiny_dirs("llama-tiny", layers=3), tmp_path, 5, "--micro-batch-size", "4",
                 env={"CHAMELEON_MICRO_BATCH_SIZE": "2"})
    _one_line_exit_2(out, "micro-batches of 4 samples", "micro_batch_size = 2")


def test_train_hf_follows_the_jobs_precision_and_micro_batch_size(tiny_dirs, tmp_path):
    out = _train(tiny_dirs("llama-tiny", layers=3), tmp_path, 5,
                 env={"CHAMELEON_MICRO_BATCH_SIZE": "2", "CHAMELEON_PRECISION": "fp32"})
    assert out.returncode == 0, out.stderr
    assert "; fp32" in out.stdout and "step    0" in out.stdout


def test_train_hf_without_the_extra_is_one_line(tmp_path):
    code = ("import runpy, sys; sys.modules['transformers'] = None; "
            f"sys.argv = ['train_hf.py', '--config', 'llama-tiny']; "
            f"runpy.run_path({EXAMPLE!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120, env=ENV)
    _one_line_exit_2(out, "pip install 'chameleon-elastic[hf]'")


@pytest.mark.parametrize("args", [["--help"]])
def test_job_help_explains_itself(args):
    out = _job("hf", *args)
    assert out.returncode == 0
    assert "exact from the model" in out.stdout and "exit status" in out.stdout
