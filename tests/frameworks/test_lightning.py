"""PyTorch Lightning under chameleon-run --job: a kill -9 of one of two DDP workers, then the
survivor relaunched with the plan's world (1) and accumulation (4) resumes from the epoch-end
checkpoint and trains every step to the loss of the failure-free run (issue 49: it failed for
good on Lightning's devices x num_nodes == world size check)."""

from __future__ import annotations

import pytest

from .conftest import assert_follows_reference, reference

pytest.importorskip("pytorch_lightning",
                    reason="Lightning: pip install 'chameleon-elastic[frameworks]'")

SCRIPT = "lightning_ddp.py"


def test_a_killed_worker_s_micro_batches_go_to_the_survivor_and_losses_stay(
        tmp_path, killed_run):
    # Lightning shuffles DDP training data with its DistributedSampler: the reference runs
    # under torchrun too, one process taking the whole global batch
    ref = reference(SCRIPT, tmp_path / "ref", "--devices", "1", "--accumulate", "4",
                    torchrun=True)
    run = killed_run(SCRIPT)
    worst = assert_follows_reference(run, ref)
    print(f"lightning: killed after step 4, exit {run.code}, max |loss diff| {worst:.2e}, "
          f"launch {run.seconds:.1f} s")
