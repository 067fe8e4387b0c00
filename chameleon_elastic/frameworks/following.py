"""What every framework adapter does first: read this worker's share and tell the agent, once.

Each adapter (``lightning_plan``, ``hf_trainer``, ``accelerate_plan``) starts with
:func:`follow`: it returns the worker's :class:`~.share.PlanShare` (None without ``--job``: the
adapter then hands the script's own settings back unchanged, so the same script runs under
plain torchrun or alone) and, the first time a process sees a plan generation, announces that the
script follows it. The announcement only spares the user the launcher's warning line; a worker
that cannot reach its agent trains on, with one warning, rather than failing a step for it.

:func:`micro_batch_size` and :func:`loss_weight` are the two figures a script passes on itself
where the framework takes them from the script's own objects (a ``DataLoader``'s batch size, the
loss it back-propagates).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from chameleon_elastic.frameworks.share import PlanShare, announce

__all__ = ["follow", "loss_weight", "micro_batch_size"]

#: (process-wide) the plan generations this process has announced: one announcement each
_ANNOUNCED: set[int] = set()


def follow(env: Mapping[str, str] | None = None) -> PlanShare | None:
    """This worker's share (None without a plan), announced to the agent once per generation.

    Raises :class:`~.share.ShareError` when the environment holds a plan this worker cannot
    follow (a spare device, a pipeline of several stages, a malformed variable)."""
    share = PlanShare.from_env(env)
    if share is None or share.generation in _ANNOUNCED:
        return share
    _ANNOUNCED.add(share.generation)
    try:
        announce(share, env)
    except Exception as exc:  # noqa: BLE001 - the agent is told as a courtesy; training goes on
        warnings.warn(f"chameleon-elastic: could not tell the agent that this script follows "
                      f"plan generation {share.generation} ({exc!r}); training goes on, and the "
                      "launcher may print a line about a share it thinks unfollowed",
                      RuntimeWarning, stacklevel=2)
    return share


def micro_batch_size(default: int, env: Mapping[str, str] | None = None) -> int:
    """Samples per micro-batch: the job's ``training.micro_batch_size`` under a plan, else
    ``default`` (the script's own)."""
    share = follow(env)
    return default if share is None else share.micro_batch_size


def loss_weight(env: Mapping[str, str] | None = None) -> float:
    """What this rank's mean loss is multiplied by so that unequal quotas weigh every sample
    of the global batch alike (:attr:`~.share.PlanShare.loss_weight`); 1.0 without a plan."""
    share = follow(env)
    return 1.0 if share is None else share.loss_weight
