"""PyTorch Lightning under a plan: ``Trainer(**trainer_kwargs(devices=2, strategy="ddp"), ...)``.

Why: under ``chameleon-run --job`` a lost device is planned around and the survivors are
relaunched with a smaller world, each running more micro-batches per step. Lightning as it
stands cannot take that world: its torchelastic environment insists that ``WORLD_SIZE`` equals
``devices x num_nodes`` (issue 49: ``You set devices=2 and num_nodes=1 in Lightning, but the
product (2 * 1) does not match the world size (1)``), and its DDP strategy shards the data over
``devices x num_nodes`` replicas rather than over the world. Even where it ran, it would keep the
script's ``accumulate_grad_batches`` and train on a fraction of the global batch.

How: :func:`trainer_kwargs` returns the Trainer's ``devices``, ``num_nodes``,
``accumulate_grad_batches`` and ``strategy``:

- ``devices`` is the node's slots (``LOCAL_WORLD_SIZE``, torchrun's ``--nproc-per-node``), so
  that ``LOCAL_RANK``, which keeps the card's slot after a re-plan, still picks the worker's own
  card (``cuda:LOCAL_RANK``) even when fewer workers are left on the node;
- ``num_nodes`` is the round's node count (``GROUP_WORLD_SIZE``);
- ``accumulate_grad_batches`` is the plan's ``CHAMELEON_MICRO_BATCHES``;
- ``strategy`` is a ``DDPStrategy`` with a cluster environment that reads ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``GROUP_RANK`` as the launcher gives them and checks only
  what must hold (the rank inside the world, the slot among the devices), whose distributed
  sampler spans the world (``WORLD_SIZE`` replicas, ``RANK``), and which multiplies each
  training step's loss by :attr:`~.share.PlanShare.loss_weight` when the ranks' quotas differ.

The per-device batch is the script's ``DataLoader``'s: ``batch_size=micro_batch_size(8)``
gives it the job's ``training.micro_batch_size`` under a plan. Without a plan every function
returns the script's own settings, so the same script runs under plain torchrun.

Resuming: Lightning counts an epoch's progress in per-rank batches, which a re-plan changes
(6 of a rank's batches end an epoch under 2 ranks x 2 micro-batches, 12 under 1 x 4). The
strategy records the plan a checkpoint was taken under and restates those counts in the new
plan's micro-batches when it loads one; without that an epoch-end checkpoint resumed by a
survivor reads as mid-epoch and its steps cut across accumulation windows. Lightning restarts an
epoch's data loader from its first batch when it resumes mid-epoch (it warns so, and so does the
strategy when the plan changed), so a relaunch resumes exactly from a checkpoint taken at the
end of an epoch on the train batch's end (``ModelCheckpoint(every_n_train_steps=<steps per
epoch>)``, epochs of whole global batches): the steps since are trained again, on the same
samples (docs/frameworks.md).

Only DDP is adapted (``strategy`` ``"ddp"``, ``"auto"`` or ``"ddp_find_unused_parameters_*"``;
DDPStrategy's own keyword arguments pass through); FSDP, DeepSpeed and the others raise
:class:`~.share.ShareError` under a plan. ``pytorch_lightning`` is used, or the unified
``lightning`` package when only that one is imported or installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from chameleon_elastic.frameworks.following import follow, loss_weight, micro_batch_size
from chameleon_elastic.frameworks.share import PlanShare, ShareError

__all__ = ["loss_weight", "micro_batch_size", "plan_strategy", "trainer_kwargs"]

#: the checkpoint key under which the strategy records the plan a checkpoint was taken under
PLAN_KEY = "chameleon_plan"
#: the ``strategy`` strings the adapter turns into its DDP strategy, with find_unused_parameters
DDP_STRINGS = {"auto": None, "ddp": None, "ddp_find_unused_parameters_false": False,
               "ddp_find_unused_parameters_true": True}


def trainer_kwargs(*, devices: int | str | list[int] = "auto", num_nodes: int = 1,
                   accumulate_grad_batches: int = 1, strategy: Any = "ddp",
                   env: Mapping[str, str] | None = None, **ddp_kwargs: Any) -> dict[str, Any]:
    """``Trainer`` keyword arguments: the plan's under ``chameleon-run --job``, else the
    script's own (``devices``, ``num_nodes``, ``accumulate_grad_batches``, ``strategy``; any
    ``ddp_kwargs`` then go to ``DDPStrategy`` when ``strategy`` names DDP)."""
    share = follow(env)
    if share is None:
        own = {"devices": devices, "num_nodes": num_nodes,
               "accumulate_grad_batches": accumulate_grad_batches, "strategy": strategy}
        if ddp_kwargs and isinstance(strategy, str) and strategy in DDP_STRINGS:
            own["strategy"] = _lightning_module("strategies").DDPStrategy(
                **_with_unused(strategy, ddp_kwargs))
        return own
    if not isinstance(strategy, str) or strategy not in DDP_STRINGS:
        raise ShareError(f"strategy={strategy!r}: under a plan only DDP is adapted "
                         f"({', '.join(map(repr, DDP_STRINGS))}; DDPStrategy's own keyword "
                         "arguments pass through trainer_kwargs)")
    env = os.environ if env is None else env
    slots = int(env.get("LOCAL_WORLD_SIZE", devices if isinstance(devices, int) else 1))
    return {"devices": slots, "num_nodes": int(env.get("GROUP_WORLD_SIZE", "1")),
            "accumulate_grad_batches": share.micro_batches,
            "strategy": plan_strategy(share, **_with_unused(strategy, ddp_kwargs))}


def _with_unused(strategy: str, ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    unused = DDP_STRINGS[strategy]
    return ddp_kwargs if unused is None else {"find_unused_parameters": unused, **ddp_kwargs}


def plan_strategy(share: PlanShare, **ddp_kwargs: Any) -> Any:
    """A ``DDPStrategy`` for ``share``'s world (see the module's docstring)."""
    environment, strategy = _plan_classes(_package())
    return strategy(share, cluster_environment=environment(), **ddp_kwargs)


def _package() -> str:
    """``pytorch_lightning``, or ``lightning.pytorch`` where the script uses that one (their
    classes differ: a strategy of one is no strategy to the other's Trainer)."""
    if "pytorch_lightning" in sys.modules:
        return "pytorch_lightning"
    if "lightning.pytorch" in sys.modules or importlib.util.find_spec("pytorch_lightning") is None:
        return "lightning.pytorch"
    return "pytorch_lightning"


def _lightning_module(name: str) -> Any:
    return importlib.import_module(f"{_package()}.{name}")


def _fabric_environments(package: str) -> Any:
    fabric = "lightning_fabric" if package == "pytorch_lightning" else "lightning.fabric"
    return importlib.import_module(f"{fabric}.plugins.environments")


@functools.cache
def _plan_classes(package: str) -> tuple[type, type]:
    """The cluster environment and the strategy, built on ``package``'s classes (imported
    here: importing this module imports no framework)."""
    environments = _fabric_environments(package)
    strategies = importlib.import_module(f"{package}.strategies")

    class PlanEnvironment(environments.TorchElasticEnvironment):
        """torchelastic's variables as chameleon-run gives them under a plan: a world that
        need not be devices x num_nodes."""

        @staticmethod
        def detect() -> bool:
            return "CHAMELEON_PLAN_GENERATION" in os.environ

        def validate_settings(self, num_devices: int, num_nodes: int) -> None:
            _check_world(self.global_rank(), self.world_size(), self.local_rank(), num_devices)

    class PlanDDPStrategy(strategies.DDPStrategy):
        """DDP over the plan's world: its sampler spans WORLD_SIZE ranks, unequal quotas are
        weighed by the loss, checkpoints record the plan they were taken under."""

        def __init__(self, share: PlanShare, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.plan_share = share

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return _weighted(super().training_step(*args, **kwargs), self.plan_share.loss_weight)

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None) -> None:
            share = self.plan_share
            checkpoint[PLAN_KEY] = {"generation": share.generation,
                                    "world_size": share.world_size,
                                    "micro_batches": share.micro_batches}
            super().save_checkpoint(checkpoint, filepath, storage_options)

        def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
            _follow_plan_change(checkpoint, self.plan_share, checkpoint_path)
            return checkpoint

    return PlanEnvironment, PlanDDPStrategy


def _check_world(rank: int, world: int, slot: int, num_devices: int) -> None:
    """What must hold under a plan: this rank inside the world, this slot among the node's
    devices (the world itself may be any size up to devices x num_nodes)."""
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}: start the script with "
                         "chameleon-run --job")
    if not 0 <= slot < num_devices:
        raise ValueError(f"LOCAL_RANK={slot} is no slot of devices={num_devices}: under a plan "
                         "Lightning's devices must be the node's slots (--nproc-per-node); "
                         "pass devices through trainer_kwargs")


def _weighted(out: Any, weight: float) -> Any:
    """A training step's output with its loss multiplied by ``weight`` (as it is at 1.0)."""
    if weight == 1.0 or out is None:
        return out
    if isinstance(out, Mapping):
        return {**out, "loss": out["loss"] * weight}
    return out * weight


def _follow_plan_change(checkpoint: dict[str, Any], share: PlanShare, path: Any) -> None:
    """Restate a checkpoint taken under another accumulation in this plan's units: Lightning
    counts an epoch's progress in per-rank batches (micro-batches), ``A`` of them per step, so
    a count of ``n`` under ``A_old`` is ``n x A_new / A_old`` under ``A_new``. Without it, an
    epoch-end checkpoint resumed by a survivor of a larger world looks mid-epoch (6 of 12
    batches done) and its steps cut across accumulation windows."""
    saved = checkpoint.get(PLAN_KEY)
    if not saved or saved["micro_batches"] == share.micro_batches:
        return
    try:
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    except (KeyError, TypeError):
        return
    old, new = saved["micro_batches"], share.micro_batches
    for part in ("total", "current"):
        counts = progress[part]   # ready >= started >= processed >= completed, a batch apart
        ready = counts["ready"]   # at most (a checkpoint taken in on_train_batch_end)
        counts.update({field: round(ready * new / old) - (ready - count)
                       for field, count in counts.items()})
    if progress["current"]["completed"] > 0 and not progress["is_last_batch"]:
        warnings.warn(f"chameleon-elastic: {path} was taken mid-epoch under "
                      f"{saved['world_size']} ranks x {old} micro-batches and is resumed under "
                      f"{share.world_size} x {new}: Lightning restarts an epoch's loader (or "
                      "restores a stateful one's per-rank position), so the rest of this epoch "
                      "will not see the samples it would have; checkpoint at epoch ends "
                      "(docs/frameworks.md)", RuntimeWarning, stacklevel=2)
