"""Hugging Face ``Trainer`` under a plan: ``TrainingArguments(**training_args(...), ...)``.

Why: the ``Trainer`` takes its world from the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), so a script relaunched by ``chameleon-run --job`` after a lost device starts in
the smaller world without complaint, and trains there at the batch its arguments name: one
survivor of two runs half the global batch, silently (issue 49). The plan keeps the global batch
by giving the survivor the lost worker's micro-batches (``CHAMELEON_MICRO_BATCHES``); the
``Trainer`` follows it only through its own arguments.

How: :func:`training_args` returns ``per_device_train_batch_size`` (the job's
``training.micro_batch_size``) and ``gradient_accumulation_steps`` (the plan's micro-batches)
under a plan, the script's own values otherwise; it announces once that the script follows the
plan. Everything else stays the ``Trainer``'s:

- data: the ``Trainer`` shards batches over the world (accelerate's ``BatchSamplerShard``: rank
  ``r`` takes batches ``r, r + W, ...`` of one order), so ``W`` ranks x ``A`` micro-batches
  cover the same ``W x A`` consecutive batches of that order whatever ``W`` is; the order itself
  (``train_sampling_strategy="sequential"``, or the default shuffle, seeded by ``args.seed`` and
  the epoch) does not depend on the world;
- resuming: the ``Trainer`` skips ``steps done this epoch x gradient_accumulation_steps``
  batches of the resumed epoch, counted with the new plan's accumulation: exactly the batches
  the new world would have run. :func:`last_checkpoint` picks the newest *complete* checkpoint
  (a worker killed while saving leaves a folder without ``trainer_state.json``, which
  ``transformers.trainer_utils.get_last_checkpoint`` would still return);
- unequal quotas: a model that takes the loss keyword arguments (transformers' causal LMs) has
  its loss divided by the token count of the whole step, summed over the world
  (``average_tokens_across_devices``, on by default), so every token weighs alike whatever the
  quotas; any other model's loss is divided by the rank's own accumulation and averaged over
  ranks, so ranks of unequal quotas weigh unequally (docs/frameworks.md).

Importing this module imports neither transformers nor torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chameleon_elastic.frameworks.following import follow

__all__ = ["last_checkpoint", "training_args"]

#: transformers' checkpoint folders (``trainer_utils.PREFIX_CHECKPOINT_DIR``) and what a
#: complete one holds last (``Trainer._save_checkpoint`` writes the state after the weights,
#: the optimizer, the scheduler and the RNG states)
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
COMPLETE = "trainer_state.json"


def training_args(*, per_device_train_batch_size: int = 8, gradient_accumulation_steps: int = 1,
                  env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments: the plan's batch per device and accumulation
    under ``chameleon-run --job``, else the script's own."""
    share = follow(env)
    if share is None:
        return {"per_device_train_batch_size": per_device_train_batch_size,
                "gradient_accumulation_steps": gradient_accumulation_steps}
    return {"per_device_train_batch_size": share.micro_batch_size,
            "gradient_accumulation_steps": share.micro_batches}


def last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir`` (for
    ``trainer.train(resume_from_checkpoint=...)``), None when there is none."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    complete = [(int(m.group(1)), p) for p in folder.iterdir()
                if (m := CHECKPOINT.match(p.name)) and (p / COMPLETE).is_file()]
    return str(max(complete)[1]) if complete else None
