"""Moving layers and their optimizer state between live processes after a plan change.

The planner's restorer has already chosen, for every device that needs a layer it does not
hold, which live holder sends it (``plan.transfers``: the least total bytes, the busiest link
first). :func:`plan_moves` follows those transfers whenever they match what the processes
actually hold at the agreed step, which is the normal case. They can disagree when a second
failure hit an earlier regroup half-way (some processes switched plans, others did not); then
the same restorer choice is made again over the actual holdings, so recovery never depends on
every earlier recovery having completed.

:func:`move_layers` executes the moves point to point on the new world: every send is posted
without blocking, then every receive blocks in a fixed order, then the sends are awaited. Since
no receive can wait on a send that was not yet posted, this cannot deadlock. A broken link
raises :class:`~.errors.PeerLost`, so a failure during recovery starts the next recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chameleon_elastic.plan import ExecutionPlan

from ..errors import PeerLost
from ..topology import RankMap
from ..world import wire
from .commit import Agreement
from .layer_state import LayerState, export_layer, recv_layer, send_layer

__all__ = ["Move", "move_layers", "move_states", "needs", "plan_moves", "stage_layers"]


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    layers: tuple[int, ...]


def stage_layers(plan: ExecutionPlan, device: int) -> tuple[int, ...]:
    """The layers ``device`` holds under ``plan`` (none for a spare or a dead device)."""
    if device not in plan.working_devices:
        return ()
    pipeline, stage = plan.locate(device)
    return tuple(range(*plan.pipelines[pipeline].layers[stage]))


def needs(plan: ExecutionPlan, held: Mapping[int, tuple[int, int]]) -> dict[int, list[int]]:
    """Working device -> layers of its new stage it does not hold at the agreed step."""
    out: dict[int, list[int]] = {}
    for device in plan.working_devices:
        start, end = held.get(device, (0, 0))
        lacking = [x for x in stage_layers(plan, device) if not start <= x < end]
        if lacking:
            out[device] = lacking
    return out


def plan_moves(plan: ExecutionPlan, agreement: Agreement,
               held: Mapping[int, tuple[int, int]]) -> tuple[tuple[Move, ...], bool]:
    """(moves, whether they are the plan's own transfers). ``held``: device -> range it holds
    at the agreed step, for the processes that hold state."""
    wanted = needs(plan, held)
    planned = [t for t in plan.transfers if t.from_peer]
    covered = sorted((t.dst, x) for t in planned for x in t.layers)
    expected = sorted((d, x) for d, layers in wanted.items() for x in layers)
    if covered == expected and all(
            t.src in agreement.holders.get(x, ()) for t in planned for x in t.layers):
        return tuple(Move(int(t.src), t.dst, t.layers) for t in planned), True
    from chameleon_elastic.planning.restorer import choose_sources

    chosen = choose_sources(lambda layer: 1.0, dict(held), wanted)
    if any(t.from_checkpoint for t in chosen):
        raise AssertionError("plan_moves is only called when every needed layer has a holder")
    return tuple(Move(int(t.src), t.dst, t.layers) for t in chosen), False


def move_layers(moves: Sequence[Move], device: int, ranks: RankMap,
                layers: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None,
                torch_device: torch.device, tp_rank: int = 0,
                extras: Mapping[int, Mapping[str, Any]] | None = None) -> dict[int, LayerState]:
    """Send what ``device`` must send (from ``layers`` with their ``optimizer`` state and
    their registered objects, ``extras``: layer -> name -> object),
    receive what it must receive; returns layer -> state. Under tensor parallelism every card
    moves its own shards, to and from the cards of the same tensor-parallel rank."""
    return move_states(moves, device, ranks, lambda layer: export_layer(
        layer, layers[layer], optimizer, extras=(extras or {}).get(layer)), torch_device, tp_rank)


def move_states(moves: Sequence[Move], device: int, ranks: RankMap,
                state_of: Callable[[int], LayerState], torch_device: torch.device,
                tp_rank: int = 0) -> dict[int, LayerState]:
    """:func:`move_layers` for states at hand: what ``device`` sends comes from
    ``state_of(layer)`` (its live layers, or an in-memory snapshot of them)."""
    pending = []
    try:
        for m in moves:
            if m.src == device:
                for layer in m.layers:
                    pending += send_layer(state_of(layer), ranks.rank(m.dst, tp_rank), layer,
                                          torch_device, wire.isend)
        received = {}
        for m in sorted(moves, key=lambda m: (m.src, m.layers)):
            if m.dst == device:
                for layer in m.layers:
                    received[layer] = recv_layer(ranks.rank(m.src, tp_rank), layer, torch_device,
                                                 wire.recv)
        for work, _ in pending:
            work.wait()
    except RuntimeError as exc:
        raise PeerLost(f"device {device} lost a peer while moving layers: {exc}") from exc
    return received
