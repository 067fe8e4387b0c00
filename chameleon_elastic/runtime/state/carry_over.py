"""Optimizer and learning-rate schedule across a change of held layers.

A plan change adds and drops layers, so the trainer builds one new optimizer over exactly the
layers it now holds. Nothing of the training state may be lost on the way: every kept
parameter keeps its optimizer state, a received layer brings its own (:mod:`.layer_state`),
and the schedule moves onto the new optimizer with the hyper-parameters it had set. A process
that has no schedule at that step (a joiner, a restore from a checkpoint) builds one and steps
it up to the committed step, which gives the same values for chainable schedules too. Both are
what one optimizer and one schedule stepped once per committed step would hold; this module is
the one place that guarantees it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import PipelineRuntimeError
from ..model import PipelineModel, build_layers, make_optimizer
from ..tensor_parallel import shard_layer
from .layer_state import LayerState, export_layer, import_layer
from .user_state import LayerStateFactory, build_extras

__all__ = ["Held", "hold_layers", "move_schedule"]

Optimizer = torch.optim.Optimizer
Scheduler = torch.optim.lr_scheduler.LRScheduler
#: (layers, optimizer, schedule, the layers' registered objects: layer -> name -> object)
Held = tuple[dict[int, nn.Module], "Optimizer | None", "Scheduler | None",
             dict[int, dict[str, Any]]]


def hold_layers(model: PipelineModel, wanted: Sequence[int], received: Mapping[int, LayerState],
                held: Held, *, step: int, device: int, torch_device: torch.device | None,
                mesh: Any = None, fresh: bool = False,
                layer_state: Mapping[str, LayerStateFactory] | None = None) -> Held:
    """(layers, optimizer, schedule, objects) holding exactly ``wanted`` at ``step`` committed
    steps: keep what ``held`` holds, add what arrived, drop the rest; one new optimizer over
    them that keeps every kept parameter's state, and the schedule moved onto it; each new
    layer gets its registered objects (``layer_state``, :mod:`.user_state`), loaded from what
    arrived. ``fresh``: start from nothing held (layers not received are built from their seed:
    the state of step 0). ``mesh``: this unit's mesh under tensor parallelism, on which every
    layer is built again."""
    kept, old, scheduler, objects = ({}, None, None, {}) if fresh else held
    if mesh is not None:
        # a sharded layer lives on one generation's mesh: build every held layer again on
        # the new one, with the shards this card holds
        received = {**{x: export_layer(x, m, old, extras=objects.get(x))
                       for x, m in kept.items() if x in wanted and x not in received},
                    **received}
        kept = {}
    modules: dict[int, nn.Module] = {}
    extras: dict[int, dict[str, Any]] = {}
    for layer in wanted:
        if layer in kept and layer not in received:
            modules[layer] = kept[layer]
            extras[layer] = objects.get(layer, {})
            continue
        if not fresh and layer not in received:
            raise PipelineRuntimeError(
                f"internal: device {device} needs layer {layer}, holds it not and was sent "
                "nothing")
        module = build_layers(model, layer, layer + 1)[0]
        if torch_device is not None:
            module = module.to(torch_device)
        if mesh is not None and model.tp_plan is not None:
            module = shard_layer(module, layer, model.tp_plan(layer), mesh)
        modules[layer] = module
        extras[layer] = build_extras(layer_state or {}, layer, module, received.get(layer))
    optimizer = make_optimizer(model, modules) if wanted else None
    for layer, module in modules.items():
        if layer in received:
            import_layer(received[layer], module, optimizer)
        elif old is not None and optimizer is not None:
            for p in module.parameters():
                if p in old.state:
                    optimizer.state[p] = old.state[p]
    return modules, optimizer, move_schedule(model, scheduler, optimizer, old, step), extras


def move_schedule(model: PipelineModel, current: Scheduler | None, optimizer: Optimizer | None,
                  old: Optimizer | None, step: int) -> Scheduler | None:
    """The learning-rate schedule on ``optimizer`` at ``step`` committed steps: ``current``
    carried over (its state and the hyper-parameters it set on the old optimizer's groups),
    or, in a process that has none at that step, a new one stepped ``step`` times. Both give
    what one schedule stepped once per committed step would."""
    if model.make_scheduler is None or optimizer is None:
        return None
    with warnings.catch_warnings():  # torch warns of a schedule stepped without a step
        warnings.simplefilter("ignore", UserWarning)
        scheduler = model.make_scheduler(optimizer)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise PipelineRuntimeError(
                "ReduceLROnPlateau depends on the losses seen, not on the step, so a process "
                "that joins cannot rebuild it; use a schedule that is a function of the step "
                "(LambdaLR, CosineAnnealingLR, SequentialLR, ...).")
        if (current is not None and old is not None and current.last_epoch == step
                and len(old.param_groups) == len(optimizer.param_groups)):
            scheduler.load_state_dict(current.state_dict())
            for new_group, old_group in zip(optimizer.param_groups, old.param_groups):
                new_group.update({k: v for k, v in old_group.items()
                                  if k not in ("params", "param_names")})
        else:
            for _ in range(step):
                scheduler.step()
    return scheduler
