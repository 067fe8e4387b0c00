"""This worker's share of the global batch under the plan in force, read from its environment.

The plan preserves the global batch: its pipelines' micro-batch quotas sum to
``CHAMELEON_GLOBAL_MICRO_BATCHES``. A data-parallel script follows it by running
``micro_batches`` micro-batches of ``micro_batch_size`` samples per optimizer step (gradient
accumulation), with the world's ranks and size as the launcher gave them. When the quotas of the
world's ranks differ (8 micro-batches over 3 workers: 3, 3, 2), an average over ranks (DDP's)
weighs each rank's samples by ``1 / (world_size x micro_batches)``; scaling each rank's loss by
:attr:`PlanShare.loss_weight` makes it ``1 / global_micro_batches`` for every sample, as one
process training on the whole global batch would.

:func:`announce` tells this node's agent (its channel, ``CHAMELEON_AGENT_STORE``) that the script
follows its share: the launcher then has nothing to warn about when a re-plan changes it
(launcher/observation/reporter.py says it otherwise, in one line).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from chameleon_elastic import channel

__all__ = ["PlanShare", "ShareError", "announce"]


class ShareError(RuntimeError):
    """The environment describes no share this adapter can follow; the message says why."""


@dataclass(frozen=True)
class PlanShare:
    """One worker's part of a data-parallel step under plan generation ``generation``."""

    generation: int
    rank: int
    world_size: int
    local_rank: int
    micro_batches: int           # this worker's micro-batches per step (accumulation steps)
    micro_batch_size: int        # samples per micro-batch (the job's training.micro_batch_size)
    global_micro_batches: int    # the whole job's micro-batches per step: the plan keeps it
    restart_count: int = 0       # TORCHELASTIC_RESTART_COUNT: relaunches so far

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, job-wide: the same under every plan."""
        return self.global_micro_batches * self.micro_batch_size

    @property
    def samples_per_step(self) -> int:
        """This worker's samples per optimizer step."""
        return self.micro_batches * self.micro_batch_size

    @property
    def loss_weight(self) -> float:
        """What this rank's mean loss is multiplied by so that an average over ranks of
        per-rank means weighs every sample of the global batch alike (1.0 when every rank has
        the same quota)."""
        return self.world_size * self.micro_batches / self.global_micro_batches

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PlanShare | None:
        """The share in ``env`` (default: this process's environment); None when the script
        does not run under ``chameleon-run --job`` (no plan: nothing to follow)."""
        env = os.environ if env is None else env
        if "CHAMELEON_PLAN_GENERATION" not in env:
            return None
        if "CHAMELEON_MICRO_BATCHES" not in env:
            raise ShareError("this worker's device has no role in the plan in force (a spare "
                             "or a standby): it has no share of the batch to train on.")
        stages = int(env.get("CHAMELEON_NUM_STAGES", "1"))
        if stages != 1 or int(env.get("CHAMELEON_TP_SIZE", "1")) != 1:
            raise ShareError(
                f"the plan puts this worker in a pipeline of {stages} stages (or a tensor-"
                "parallel unit); a framework's data-parallel script can follow only plans of "
                "one stage per pipeline: set training.pp = 1 and training.tp = 1 in the job "
                "file, or train on chameleon_elastic.runtime.")
        try:
            return cls(int(env["CHAMELEON_PLAN_GENERATION"]), int(env["RANK"]),
                       int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       int(env["CHAMELEON_MICRO_BATCHES"]),
                       int(env["CHAMELEON_MICRO_BATCH_SIZE"]),
                       int(env["CHAMELEON_GLOBAL_MICRO_BATCHES"]),
                       int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        except (KeyError, ValueError) as exc:
            raise ShareError(f"the plan's environment is incomplete or malformed ({exc!r}); "
                             "start the script with chameleon-run --job.") from None


def announce(share: PlanShare, env: Mapping[str, str] | None = None,
             timeout_s: float = 10.0) -> bool:
    """Tell this node's agent that the script follows ``share`` (so a re-plan that changes it
    needs no warning). Returns False, saying nothing, where there is no agent to tell."""
    env = os.environ if env is None else env
    address = env.get(channel.AGENT_STORE_ENV)
    if not address or "CHAMELEON_DEVICE" not in env:
        return False
    from datetime import timedelta

    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    card = int(env["CHAMELEON_DEVICE"])
    channel.write(store, channel.follows_key(card), share.generation)
    return True
