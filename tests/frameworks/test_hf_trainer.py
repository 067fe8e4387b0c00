"""The Hugging Face Trainer under chameleon-run --job: a kill -9 of one of two workers, then the
survivor relaunched with the plan's accumulation (4, through hf_trainer.training_args) resumes
from its newest complete checkpoint and trains every step to the loss of the failure-free run
(issue 49: it went on at half the global batch, silently)."""

from __future__ import annotations

import pytest

from .conftest import assert_follows_reference, reference

pytest.importorskip("accelerate", reason="HF Trainer: pip install 'chameleon-elastic[hf,frameworks]'")

SCRIPT = "hf_trainer_lm.py"


def test_a_killed_worker_s_micro_batches_go_to_the_survivor_and_losses_stay(
        tmp_path, killed_run):
    ref = reference(SCRIPT, tmp_path / "ref", "--accumulate", "4")   # one process, 4 x 4
    run = killed_run(SCRIPT)
    worst = assert_follows_reference(run, ref)
    print(f"hf trainer: killed after step 4, exit {run.code}, max |loss diff| {worst:.2e}, "
          f"launch {run.seconds:.1f} s")
