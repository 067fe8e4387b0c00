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

The exported names load on first use (:pep:`562`): importing one small module of the runtime
(``chameleon_elastic.runtime.recording``, which the launcher re-exports) must not import the
trainer and everything under it (torch, the planner, networkx): every ``chameleon-run`` paid
~0.3 s of imports for it, and torch's rendezvous, which walks ``sys.modules`` for each of its
log lines, paid again per module loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import PeerLost, PipelineRuntimeError
    from .execution.evaluation import Every
    from .execution.step import StepResult
    from .model import PipelineModel, Tie
    from .precision import PRECISIONS, Precision
    from .state.checkpoint import latest_step, load_checkpoint, save_checkpoint
    from .topology import plan_from_env
    from .trainer import PipelineTrainer
    from .world.join import init_distributed

#: each exported name, and the module (below this package) that defines it
_HOMES = {
    "PRECISIONS": "precision",
    "Every": "execution.evaluation",
    "PeerLost": "errors",
    "PipelineModel": "model",
    "PipelineRuntimeError": "errors",
    "PipelineTrainer": "trainer",
    "Precision": "precision",
    "StepResult": "execution.step",
    "Tie": "model",
    "init_distributed": "world.join",
    "latest_step": "state.checkpoint",
    "load_checkpoint": "state.checkpoint",
    "plan_from_env": "topology",
    "save_checkpoint": "state.checkpoint",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value   # the next lookup is an ordinary one
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
