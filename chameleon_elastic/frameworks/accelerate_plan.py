"""Hugging Face ``accelerate`` under a plan: ``Accelerator(**accelerator_kwargs(...), ...)``.

Why: ``accelerate`` takes its world from the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), so after a lost device a script relaunched by ``chameleon-run --job`` starts in
the smaller world and trains there at the accumulation it was written with: one survivor of two
runs half the global batch, silently (issue 49). The plan gives the survivor the lost worker's
micro-batches (``CHAMELEON_MICRO_BATCHES``); ``accelerate`` follows it only through the
``Accelerator``'s gradient accumulation and the script's ``DataLoader``.

How: :func:`accelerator_kwargs` returns the ``Accelerator``'s gradient accumulation, the plan's
under a plan (as a ``GradientAccumulationPlugin``, which ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``
cannot override), the script's own otherwise, and announces once that the script follows the
plan. :func:`micro_batch_size` gives the ``DataLoader``'s batch size (the job's
``training.micro_batch_size``). What the script keeps doing itself:

- ``with accelerator.accumulate(model): ...; accelerator.backward(loss)`` as usual;
- data: ``accelerator.prepare(loader)`` shards batches over the world (``BatchSamplerShard``:
  rank ``r`` takes batches ``r, r + W, ...`` of one order), so ``W`` ranks x ``A`` micro-batches
  cover the same consecutive batches whatever ``W`` is, provided the order does not depend on
  the world: a sequential loader, or a shuffled one with
  ``DataLoaderConfiguration(use_seedable_sampler=True)`` (one permutation per seed and epoch);
  ``split_batches`` must stay False (the loader's batch is one micro-batch);
- resuming: count optimizer steps, not batches (a batch is a micro-batch, and a re-plan changes
  how many make a step), and skip ``optimizer steps done this epoch x
  accelerator.gradient_accumulation_steps`` batches with ``accelerator.skip_first_batches``.
  ``accelerator.load_state`` restores the ``Accelerator``'s own count of micro-batches into the
  accumulation window, in the old plan's micro-batches: 2 (one step of 2) resumed under an
  accumulation of 4 closes the first window after 2 micro-batches. :func:`load_state` loads the
  state and starts the next window afresh, as a state saved after an optimizer step should;
- unequal quotas: ``accelerator.backward`` divides by the rank's own accumulation and DDP
  averages over ranks, so ranks of unequal quotas weigh unequally unless the script multiplies
  its loss by :func:`loss_weight` (1.0 when the quotas are equal, and without a plan).

Importing this module imports neither accelerate nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chameleon_elastic.frameworks.following import follow, loss_weight, micro_batch_size

__all__ = ["accelerator_kwargs", "load_state", "loss_weight", "micro_batch_size"]


def accelerator_kwargs(*, gradient_accumulation_steps: int = 1,
                       env: Mapping[str, str] | None = None,
                       **plugin_kwargs: Any) -> dict[str, Any]:
    """``Accelerator`` keyword arguments: the plan's gradient accumulation under
    ``chameleon-run --job``, else the script's own. ``plugin_kwargs`` (``sync_with_dataloader``,
    ``sync_each_batch``, ...) go to accelerate's ``GradientAccumulationPlugin``."""
    share = follow(env)
    if share is None and not plugin_kwargs:
        return {"gradient_accumulation_steps": gradient_accumulation_steps}
    steps = gradient_accumulation_steps if share is None else share.micro_batches
    from accelerate.utils import GradientAccumulationPlugin

    return {"gradient_accumulation_plugin":
            GradientAccumulationPlugin(num_steps=steps, **plugin_kwargs)}


def load_state(accelerator: Any, input_dir: str, **kwargs: Any) -> None:
    """``accelerator.load_state(input_dir, **kwargs)`` for a state saved after an optimizer
    step, resumed under any plan: the accumulation window starts afresh (accelerate's
    ``step``, its count of micro-batches into the window, counts the saving plan's)."""
    accelerator.load_state(input_dir, **kwargs)
    accelerator.step = 0
