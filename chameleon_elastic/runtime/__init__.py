"""Inside the training process: train under any execution plan, for real.

A script describes its model as an ordered list of layers (:class:`PipelineModel`), joins the
process group (:func:`init_distributed`) and builds a :class:`PipelineTrainer` from the plan
the launcher wrote (``CHAMELEON_PLAN_FILE``). The trainer builds only its stage's layers, runs
the per-device 1F1B order of ``planning/schedule.py`` with point-to-point transfers, sums
gradients over each layer's holders by the plan's colour rounds and steps the optimizer. The
loss and the gradients equal those of single-process training on the same global batch,
whatever the plan (symmetric, asymmetric, rerouted). See docs/runtime.md.

This package exports what a training script needs; everything else (the executor, the gradient
sync, the commit protocol, rank maps, the recovery chain, ...) is imported from its module,
e.g. ``from chameleon_elastic.runtime.topology import dense_rank_map``.
"""

from __future__ import annotations

from .errors import PeerLost, PipelineRuntimeError
from .execution.evaluation import Every
from .execution.step import StepResult
from .model import PipelineModel, Tie
from .precision import PRECISIONS, Precision
from .state.checkpoint import latest_step, load_checkpoint, save_checkpoint
from .topology import plan_from_env
from .trainer import PipelineTrainer
from .world.join import init_distributed

__all__ = [
    "PRECISIONS",
    "Every",
    "PeerLost",
    "PipelineModel",
    "PipelineRuntimeError",
    "PipelineTrainer",
    "Precision",
    "StepResult",
    "Tie",
    "init_distributed",
    "latest_step",
    "load_checkpoint",
    "plan_from_env",
    "save_checkpoint",
]
