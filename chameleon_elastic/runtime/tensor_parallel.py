"""Tensor parallelism inside a stage: a plan's device is a unit of ``tp`` cards.

The layers of a stage are sharded over the unit's cards with torch's own tensor parallelism
(``parallelize_module`` on a one-dimensional ``DeviceMesh`` over the unit's process group, with
the model's per-layer plan of ``ColwiseParallel`` / ``RowwiseParallel`` styles); nothing here
shards a tensor by hand except to cut a checkpoint's whole tensor into this card's piece.

What crosses a stage boundary is replicated inside a unit (a row-wise layer's output is
all-reduced), so card ``t`` of one unit sends to card ``t`` of the next, and every card of a
unit runs the same micro-batches. Everything data-parallel happens per tensor-parallel rank:
card ``t`` of every holder of a layer sums that layer's gradients with the other cards ``t``
(shard with shard; a replicated parameter with its replicas), moves go card ``t`` to card
``t``, and a card's share of the gradient norm counts its shards, plus the replicated
parameters on card 0 only. Checkpoints hold whole tensors (gathered by the unit, written by its
card 0), so they load under any degree.

Plan changes rebuild the sharded modules: a ``DTensor`` keeps the mesh it was made on, and the
mesh's group belongs to one plan generation's world, so every held layer is exported as local
shards, built again, sharded on the new generation's mesh and given its shards back.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .errors import PipelineRuntimeError

__all__ = ["aligned", "full", "is_dtensor", "local", "local_piece", "make_mesh", "replicated",
           "shard_layer"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``, without importing ``torch.distributed.tensor``: that
    import costs about a second per process (it pulls in sympy and torch.export), which every
    agent and worker paid at start-up although only a plan with ``tp`` > 1 makes one. Before
    anything imported the module, nothing can be an instance of its class."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """This card's part of ``t`` (``t`` itself when it is not a ``DTensor``)."""
    return t.to_local() if is_dtensor(t) else t


def full(t: Any) -> Any:
    """The whole tensor (a collective over the unit for a sharded ``DTensor``), as a plain
    tensor (torch may hand back a wrapper still waiting on the gather: copying waits)."""
    return t.full_tensor().clone() if is_dtensor(t) else t


def aligned(t: Any, like: Any) -> Any:
    """``t`` placed as ``like`` is (a replicated tensor cut to this card's shard, locally)."""
    if is_dtensor(t) and is_dtensor(like) and t.placements != like.placements:
        return t.redistribute(like.device_mesh, like.placements)
    return t


def replicated(t: Any) -> bool:
    """Whether every card of a unit holds all of ``t`` (a plain tensor, or a ``DTensor``
    with no ``Shard`` placement)."""
    if not is_dtensor(t):
        return True
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in t.placements)


def local_piece(value: torch.Tensor, like: Any) -> torch.Tensor:
    """``value`` as ``like`` holds it on this card: unchanged when it has the local shape
    already (a transfer from the same tensor-parallel rank), cut from the whole tensor when it
    has the global shape (a checkpoint, written under any degree)."""
    mine = local(like)
    if not is_dtensor(like) or tuple(value.shape) == tuple(mine.shape):
        return value
    if tuple(value.shape) != tuple(like.shape):
        raise PipelineRuntimeError(
            f"a saved tensor of shape {tuple(value.shape)} fits neither the whole parameter "
            f"{tuple(like.shape)} nor this card's shard {tuple(mine.shape)}; the checkpoint "
            "or the transfer was made for another model."
        )
    from torch.distributed.tensor import Shard

    piece = value
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            piece = piece.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_local_rank(dim)]
    if tuple(piece.shape) != tuple(mine.shape):
        raise PipelineRuntimeError(
            f"parameter of shape {tuple(like.shape)} is sharded unevenly over "
            f"{mesh.size()} cards; give every sharded dimension a size divisible by "
            "training.tp."
        )
    return piece


def make_mesh(group: Any, device_type: str) -> Any:
    """The one-dimensional mesh of a unit, over the unit's existing process group.

    Named after the group: torch compares meshes by their ranks and names, not their groups,
    and caches sharding decisions that hold a mesh; a mesh equal to the previous generation's
    would then run collectives on that generation's destroyed group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"tp-{group.group_name}",))


def shard_layer(module: nn.Module, layer: int, plan: dict | None, mesh: Any) -> nn.Module:
    """``module`` (layer ``layer``, whole and identical on every card) sharded over ``mesh`` by
    ``plan``. Every card slices its own copy (``src_data_rank=None``): no communication."""
    if not plan:
        return module
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        return parallelize_module(module, mesh, plan, src_data_rank=None)
    except (AttributeError, KeyError, ValueError, RuntimeError) as exc:
        raise PipelineRuntimeError(
            f"cannot shard layer {layer} with its tensor-parallel plan {sorted(plan)} ({exc}); "
            "name submodules as layer.named_modules() does, with torch's ColwiseParallel / "
            "RowwiseParallel styles."
        ) from exc
