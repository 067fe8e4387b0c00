"""Inside the training process: train under any execution plan, for real.

A script describes its model as an ordered list of layers (:class:`PipelineModel`), joins the
process group (:func:`init_distributed`) and builds a :class:`PipelineTrainer` from the plan
the launcher wrote (``CHAMELEON_PLAN_FILE``). The trainer builds only its stage's layers, runs
the per-device 1F1B order of ``planning/schedule.py`` with point-to-point transfers, sums
gradients over each layer's holders by the plan's colour rounds and steps the optimizer. The
loss and the gradients equal those of single-process training on the same global batch,
whatever the plan (symmetric, asymmetric, rerouted). See docs/runtime.md.
"""

from __future__ import annotations

from .checkpoint import latest_step, load_checkpoint, load_layers, save_checkpoint
from .commit import Agreement, ProtocolError, Row, StateLost, agree
from .data import global_micro_batch, sample_ids, step_sample_ids
from .errors import PeerLost, PipelineRuntimeError
from .executor import (
    BoundarySpec,
    OpTiming,
    PipelineExecutor,
    StepOutcome,
    TensorSpec,
    boundary_spec,
)
from .grad_sync import SyncMode, sync_gradients
from .groups import GroupTable
from .layer_state import LayerState, export_layer, import_layer
from .model import PipelineModel, Tie, build_layers, collate
from .precision import PRECISIONS, LossScale, Precision
from .recovery import Recovery, WorkerLink
from .topology import (
    RankMap,
    check_world,
    dense_rank_map,
    device_from_env,
    init_distributed,
    plan_from_env,
)
from .trainer import (
    Entry,
    PipelineTrainer,
    StepResult,
    data_parallel_plan,
    layer_holders,
    plan_rounds,
)

__all__ = [
    "PRECISIONS",
    "Agreement",
    "BoundarySpec",
    "Entry",
    "GroupTable",
    "LayerState",
    "LossScale",
    "OpTiming",
    "PeerLost",
    "PipelineExecutor",
    "PipelineModel",
    "PipelineRuntimeError",
    "PipelineTrainer",
    "Precision",
    "ProtocolError",
    "RankMap",
    "Recovery",
    "Row",
    "StateLost",
    "StepOutcome",
    "StepResult",
    "SyncMode",
    "TensorSpec",
    "Tie",
    "WorkerLink",
    "agree",
    "boundary_spec",
    "build_layers",
    "check_world",
    "collate",
    "data_parallel_plan",
    "dense_rank_map",
    "device_from_env",
    "export_layer",
    "global_micro_batch",
    "import_layer",
    "init_distributed",
    "latest_step",
    "layer_holders",
    "load_checkpoint",
    "load_layers",
    "plan_from_env",
    "plan_rounds",
    "sample_ids",
    "save_checkpoint",
    "step_sample_ids",
    "sync_gradients",
]
