"""The examples as a new user tries them first (issue 39): each alone in one process, with no
launcher (a world of one), and the GPT under torchrun and under chameleon-run printing the same
fp32 losses as in one process, since the micro-batch size has one default everywhere."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
_STEP = re.compile(r"^step\s+(\d+)\s+loss (\d+\.\d{4})", re.MULTILINE)


def _alone(*argv: str, timeout: float = 50) -> subprocess.CompletedProcess:
    """``python examples/<argv>`` in a clean environment (no launcher's variables)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("CHAMELEON_", "TORCHELASTIC_"))}
    return subprocess.run([sys.executable, str(EXAMPLES / argv[0]), *argv[1:]], cwd=ROOT,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _losses(text: str) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in _STEP.findall(text)]


GPT = ("train_gpt.py", "--steps", "3", "--log-every", "1", "--precision", "fp32")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [
    GPT,
    ("ddp_torchrun.py", "--steps", "6"),
    ("train_hf.py", "--config", "llama-tiny", "--steps", "2", "--log-every", "1"),
], ids=lambda a: a[0])
def test_an_example_trains_alone_in_one_process(argv):
    done = _alone(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert re.search(r"^step\s+\d+\s+loss \d", done.stdout, re.MULTILINE), done.stdout


@pytest.mark.timeout(30)
def test_the_example_that_needs_a_plan_says_so_in_one_line():
    done = _alone("plan_aware.py")
    assert done.returncode == 1
    assert done.stderr.strip() == ("run me under chameleon-run --job/--preset: I need "
                                   "CHAMELEON_* variables")


@pytest.mark.timeout(90)   # about 20 s on a quiet machine: four workers start
@pytest.mark.parametrize("tool,flags", [
    ("torchrun", ["--standalone", "--nproc-per-node", "4"]),
    ("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                   "--no-status"]),
])
def test_the_gpt_prints_one_processs_fp32_losses_under_either_launcher(tool, flags, launch,
                                                                     capsys, monkeypatch):
    """'Replace the word torchrun': 4 data-parallel workers (torchrun) or 2 pipelines of 2
    stages (tiny-cpu) train the samples one process trains, 4 decimals alike. The one process
    is this one (the example's main, a world of one), while the launcher starts."""
    run = launch(tool, [*flags, str(EXAMPLES / GPT[0]), *GPT[1:]])
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLES / GPT[0])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(list(GPT[1:])) == 0
    expected = _losses(capsys.readouterr().out)
    assert [s for s, _ in expected] == [0, 1, 2]
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    assert _losses(run.log.read_text()) == expected
