"""The script's own training state (an EMA of the weights, a counter), carried like the model's.

A script registers objects with the trainer (``PipelineTrainer(layer_state=..., job_state=...)``)
that follow torch's ``state_dict`` / ``load_state_dict`` protocol, and optionally have
``after_step(step)``, which the trainer calls on every holder after the optimizer step of each
committed step (a rank that rolls a step forward calls it too, so every copy sees every step):

- **per layer**: ``layer_state[name](layer, module)`` builds the object of one layer wherever the
  layer is built. Its state travels with the layer: to the device that receives the layer at a
  plan change, into the layer's checkpoint entry, and back. Only holders of the layer have one.
- **job-wide**: ``job_state[name]`` is one object per process, updated alike on every rank. A
  process that joins a running job gets the state from the lowest rank that holds training
  state; a checkpoint stores it once; a start from the seeds puts back its state at
  registration.

State dicts hold tensors and plain values (numbers, strings, lists, dicts of them): they cross
the network in the layers' wire format and are read from checkpoints without unpickling.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PeerLost, PipelineRuntimeError
from ..topology import RankMap
from ..world import wire
from .layer_state import LayerState, recv_layer, send_layer

__all__ = ["LayerStateFactory", "Stateful", "after_step", "build_extras", "copy_state",
           "load_states", "share_job_state"]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


#: (layer index, the layer's module) -> that layer's object
LayerStateFactory = Callable[[int, nn.Module], Stateful]


def copy_state(objects: Mapping[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Detached copies of the objects' state dicts, by name."""
    return {name: {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                   for k, v in obj.state_dict().items()} for name, obj in objects.items()}


def load_states(objects: Mapping[str, Stateful], states: Mapping[str, dict[str, Any]],
                   where: str) -> None:
    """Load each object's state from ``states`` (from ``where``: said if one is missing)."""
    for name, obj in objects.items():
        if name not in states:
            raise PipelineRuntimeError(
                f"{where} holds no state for the registered object {name!r}; it was saved "
                "without it: register the same objects as the run that saved it.")
        obj.load_state_dict(states[name])


def build_extras(factories: Mapping[str, LayerStateFactory], layer: int, module: nn.Module,
                 received: LayerState | None) -> dict[str, Stateful]:
    """Layer ``layer``'s objects, built for ``module`` and, when the layer arrived with state
    (a peer, a checkpoint), loaded from it."""
    objects = {name: make(layer, module) for name, make in factories.items()}
    if received is not None:
        load_states(objects, received.extra, f"the state of layer {layer}")
    return objects


def after_step(objects: Iterable[Stateful], step: int) -> None:
    for obj in objects:
        hook = getattr(obj, "after_step", None)
        if hook is not None:
            hook(step)


def share_job_state(objects: Mapping[str, Stateful], ranks: RankMap,
                    holding: Iterable[bool], tag: int, device: torch.device) -> None:
    """Send the job-wide state from the lowest rank that holds training state to every rank
    that holds none (a process that joined); ``holding``: per rank, in rank order. Every rank
    calls it; nothing moves when every rank holds state or nothing is registered."""
    holding = list(holding)
    if not objects or all(holding) or not any(holding):
        return
    source = holding.index(True)
    me = dist.get_rank()
    try:
        if me == source:
            state = LayerState(-1, {}, [], copy_state(objects))
            pending = [work for r, has in enumerate(holding) if not has
                       for work, _ in send_layer(state, r, tag, device, wire.isend)]
            for work in pending:
                work.wait()
        elif not holding[me]:
            received = recv_layer(source, tag, device, wire.recv)
            load_states(objects, received.extra, f"rank {source}'s job-wide state")
    except PipelineRuntimeError:
        raise
    except RuntimeError as exc:
        raise PeerLost(f"device {ranks.device_of_rank[me]} lost a peer while sharing the "
                       f"job-wide state: {exc}") from exc
