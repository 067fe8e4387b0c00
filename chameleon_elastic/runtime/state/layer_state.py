"""One layer's training state (weights and optimizer state), as checkpoints and transfers move it.

A plan change moves layers between devices, so state travels per layer, never per rank. A
layer's state is its ``state_dict`` plus, for each parameter in ``parameters()`` order, the
optimizer's per-parameter state (Adam's moments and step count, SGD's momentum, ...), plus the
``state_dict`` of each per-layer object the script registered (``extra``, :mod:`.user_state`). The same
value is written to checkpoints (``torch.save``, read back with ``weights_only=True``) and sent
between live processes. Under tensor parallelism a transfer carries one card's shards (card
``t`` to card ``t``) and a checkpoint the whole tensors; loading cuts whichever it gets to the
receiving card's piece (:mod:`.tensor_parallel`).

On the wire a layer is a few messages: the length of a JSON header, the header (names, shapes,
dtypes, plain scalars) and one flat buffer per dtype holding every tensor of that dtype end to
end. No pickle crosses the network, and a layer costs three or four messages however many
tensors it has. Buffers live on the trainer's device (so NCCL/HCCL can carry them); a tensor that the
optimizer keeps on the CPU (Adam's ``step``) goes back to the CPU on arrival.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import PipelineRuntimeError
from ..tensor_parallel import full, is_dtensor, local, local_piece

__all__ = ["LayerState", "Packed", "export_layer", "import_layer", "pack_layer", "packed_bytes",
           "recv_layer", "recv_packed", "send_layer", "send_packed", "unpack"]

OptimizerState = list[dict[str, Any]]
#: a layer's state as it travels: a JSON-able header and one flat buffer per dtype
Packed = tuple[dict[str, Any], list[torch.Tensor]]
_TAGS = 16  # tags per layer: header length, header, then one per dtype buffer


@dataclass
class LayerState:
    """Detached copies of one layer's tensors (``params`` by state-dict name); ``extra``: the
    registered per-layer objects' state dicts by name (tensors and JSON values)."""

    layer: int
    params: dict[str, torch.Tensor]
    optimizer: OptimizerState
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [*self.params.values(),
                   *(v for entry in (*self.optimizer, *self.extra.values())
                     for v in entry.values() if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "params": self.params, "optimizer": self.optimizer,
                "extra": self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerState:
        return cls(int(d["layer"]), dict(d["params"]), list(d["optimizer"]),
                   dict(d.get("extra", {})))


def export_layer(layer: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 whole: bool = False, extras: Mapping[str, Any] | None = None,
                 copy: bool = True) -> LayerState:
    """Detached copies of the layer's state (and of its registered objects' ``extras``). A
    tensor-parallel layer gives this card's shards, or, with ``whole``, the whole tensors (a
    collective over its unit: every card of the unit must export the same layers in the same
    order). ``copy=False``: detached views of the live tensors, for a caller that copies them
    at once (:func:`pack_layer`)."""
    take = full if whole else local

    def dup(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = take(v).detach()
        return v.clone() if copy else v

    opt_state = [] if optimizer is None else [
        {k: dup(v) for k, v in optimizer.state.get(p, {}).items()} for p in module.parameters()]
    extra = {name: {k: dup(v) for k, v in obj.state_dict().items()}
             for name, obj in (extras or {}).items()}
    return LayerState(layer, {k: dup(v) for k, v in module.state_dict().items()}, opt_state,
                      extra)


def import_layer(state: LayerState, module: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``state`` (this card's shards, or whole tensors: each is cut to this card's piece)
    into ``module`` and, per parameter, into ``optimizer``'s state."""
    targets = module.state_dict(keep_vars=True)
    if set(targets) != set(state.params):
        raise PipelineRuntimeError(
            f"layer {state.layer}'s saved state has {sorted(state.params)} but the layer has "
            f"{sorted(targets)}; the state was saved from another model."
        )
    with torch.no_grad():
        for name, target in targets.items():
            local(target).copy_(local_piece(state.params[name], target))
    if optimizer is None:
        return
    for p, saved in zip(module.parameters(), state.optimizer):
        if saved:
            optimizer.state[p] = {k: _like(v, p, k) for k, v in saved.items()}


def _like(value: Any, param: torch.Tensor, key: str) -> Any:
    """An optimizer state entry for ``param``: per-element state (moments) as the parameter is
    held (its shard, a ``DTensor`` on its mesh); scalars stay where the optimizer keeps them (the
    CPU, for Adam's step counter)."""
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if value.dim() == 0:
        return value.to(local(param).device)
    piece = local_piece(value, param).to(local(param).device)
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False)
    return piece


# --------------------------------------------------------------------------- the wire


def _flatten(state: LayerState, device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(header, one flat buffer per dtype in header order)."""
    groups: dict[str, list[torch.Tensor]] = {}

    def slot(t: torch.Tensor) -> list[Any]:
        key = str(t.dtype).removeprefix("torch.")
        members = groups.setdefault(key, [])
        members.append(t.reshape(-1))
        return ["t", key, list(t.shape), t.device.type == "cpu"]

    header = {
        "layer": state.layer,
        "params": [[name, *slot(t)] for name, t in state.params.items()],
        "optimizer": [{k: (slot(v) if isinstance(v, torch.Tensor) else ["v", v])
                       for k, v in entry.items()} for entry in state.optimizer],
        "extra": {name: {k: (slot(v) if isinstance(v, torch.Tensor) else ["v", v])
                         for k, v in entry.items()} for name, entry in state.extra.items()},
    }
    header["buffers"] = [[key, sum(t.numel() for t in ts)] for key, ts in groups.items()]
    buffers = [torch.cat(ts).to(device) if ts else torch.empty(0, device=device)
               for ts in groups.values()]
    return header, buffers


def _unflatten(header: dict[str, Any], buffers: list[torch.Tensor],
               device: torch.device) -> LayerState:
    cursors = {key: [buf, 0] for (key, _), buf in zip(header["buffers"], buffers)}

    def take(spec: list[Any]) -> Any:
        if spec[0] == "v":
            return spec[1]
        _, key, shape, on_cpu = spec
        buf, offset = cursors[key]
        n = 1
        for s in shape:
            n *= s
        cursors[key][1] = offset + n
        t = buf[offset:offset + n].view(shape).clone()
        return t.cpu() if on_cpu and device.type != "cpu" else t

    params = {name: take(spec) for name, *spec in header["params"]}
    optimizer = [{k: take(spec) for k, spec in entry.items()} for entry in header["optimizer"]]
    extra = {name: {k: take(spec) for k, spec in entry.items()}
             for name, entry in header["extra"].items()}
    return LayerState(int(header["layer"]), params, optimizer, extra)


def pack_layer(layer: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
               extras: Mapping[str, Any] | None = None, device: torch.device | None = None
               ) -> Packed:
    """One copy of the layer's state, packed for the wire, on ``device`` (host memory by
    default): one buffer per dtype is the only copy made, and it is what a send sends and
    what :func:`unpack` reads back."""
    return _flatten(export_layer(layer, module, optimizer, extras=extras, copy=False),
                    device or torch.device("cpu"))


def packed_bytes(packed: Packed) -> int:
    return sum(b.numel() * b.element_size() for b in packed[1])


def unpack(packed: Packed, device: torch.device) -> LayerState:
    """The state a packed layer holds (copies: the packed buffers stay as they were)."""
    return _unflatten(*packed, device)


def send_layer(state: LayerState, dst: int, tag: int, device: torch.device,
               isend: Callable[..., Any]) -> list[tuple[Any, torch.Tensor]]:
    """Post the three messages of one layer; returns (work, tensor) pairs to wait on."""
    return send_packed(_flatten(state, device), dst, tag, device, isend)


def send_packed(packed: Packed, dst: int, tag: int, device: torch.device,
                isend: Callable[..., Any]) -> list[tuple[Any, torch.Tensor]]:
    """:func:`send_layer` for a layer packed already (on ``device``)."""
    header, buffers = packed
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
    length = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    pending = []
    for part, tensor in enumerate((length, raw, *buffers)):
        pending.append((isend(tensor, dst=dst, tag=tag * _TAGS + part), tensor))
    return pending


def recv_layer(src: int, tag: int, device: torch.device,
               recv: Callable[..., Any]) -> LayerState:
    return _unflatten(*recv_packed(src, tag, device, recv), device)


def recv_packed(src: int, tag: int, device: torch.device, recv: Callable[..., Any]) -> Packed:
    """The messages of one layer, left packed."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    recv(length, src=src, tag=tag * _TAGS)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    recv(raw, src=src, tag=tag * _TAGS + 1)
    header = json.loads(bytes(raw.cpu().numpy()).decode())
    buffers = []
    for part, (key, numel) in enumerate(header["buffers"], start=2):
        buf = torch.empty(numel, dtype=getattr(torch, key), device=device)
        recv(buf, src=src, tag=tag * _TAGS + part)
        buffers.append(buf)
    return header, buffers
