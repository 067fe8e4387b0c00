"""The commit protocol's agreement, the moves that follow it and the wire format of a layer:
pure functions and single-process round trips (runtime/state/commit.py, migrate.py, layer_state.py)."""

from __future__ import annotations

import math

import pytest
import torch

from chameleon_elastic.models.toy import mlp_model
from chameleon_elastic.plan import CHECKPOINT, ExecutionPlan, Pipeline, Transfer
from chameleon_elastic.runtime.model import build_layers
from chameleon_elastic.runtime.state.commit import ProtocolError, Row, agree
from chameleon_elastic.runtime.state.layer_state import (
    export_layer,
    import_layer,
    recv_layer,
    send_layer,
)
from chameleon_elastic.runtime.state.migrate import plan_moves

NAN = math.nan


def row(device, committed, synced=None, held=(0, 0), loss=NAN, reported=-1, ckpt=None):
    return Row(device, committed, synced, held, loss, reported, ckpt)


def test_rows_round_trip_through_the_exchanged_tensor():
    r = Row(5, 12, 11, (3, 7), 0.25, 11, 10, last_norm=0.75, scale=1024.0, scale_good=3)
    assert Row.from_tensor(r.to_tensor()) == r
    fresh = row(2, None)
    back = Row.from_tensor(fresh.to_tensor())
    assert back.committed is None and back.checkpoint is None and math.isnan(back.last_loss)


def test_the_ranks_ahead_tell_the_rolled_forward_ones_the_norm_and_the_loss_scale():
    ahead = Row(0, 8, None, (0, 4), 0.5, 7, None, last_norm=2.5, scale=512.0, scale_good=9)
    behind = Row(1, 7, 7, (4, 8), 0.6, 6, None, last_norm=1.0, scale=1024.0, scale_good=8)
    a = agree([behind, ahead])
    assert a.roll_forward == {(1, 0)}
    assert (a.last_loss, a.last_norm, a.scale) == (0.5, 2.5, (512.0, 9))


def test_resume_at_the_newest_commit_and_roll_forward_the_ranks_one_behind():
    rows = [row(0, 8, None, (0, 4), 0.5, 7), row(1, 7, 7, (4, 8)), row(2, 8, None, (0, 4), 0.5),
            row(3, None)]
    a = agree(rows)
    assert a.resume == 8 and a.roll_forward == {(1, 0)} and a.last_loss == 0.5
    assert a.holders[0] == (0, 2) and a.holders[5] == (1,)
    assert a.orphans(8) == [] and a.reported == 7


def test_a_rank_one_behind_without_that_steps_gradients_breaks_the_protocol():
    with pytest.raises(ProtocolError, match="device 1"):
        agree([row(0, 8, None, (0, 4)), row(1, 7, None, (4, 8))])
    with pytest.raises(ProtocolError, match="device 1"):
        agree([row(0, 9, None, (0, 4)), row(1, 7, 7, (4, 8))])   # two steps behind


def test_nobody_holding_state_and_orphans():
    fresh = agree([row(0, None, ckpt=4), row(1, None)])
    assert fresh.resume is None and fresh.checkpoint == 4
    half = agree([row(0, 3, None, (0, 4)), row(1, None)])
    assert half.orphans(8) == [4, 5, 6, 7]


def _plan(transfers=()):
    return ExecutionPlan("replan", 1, (Pipeline((0, 2), ((0, 4), (4, 8)), 4),
                                       Pipeline((1,), ((0, 8),), 4)),
                         transfers=tuple(transfers)).validate()


def test_moves_follow_the_plans_transfers_when_they_match_what_is_held():
    held = {0: (0, 4), 1: (4, 8), 2: (4, 8)}
    agreement = agree([row(d, 3, None, r) for d, r in held.items()])
    plan = _plan([Transfer(0, 1, (0, 1, 2, 3), 4.0)])
    moves, planned = plan_moves(plan, agreement, held)
    assert planned and [(m.src, m.dst, m.layers) for m in moves] == [(0, 1, (0, 1, 2, 3))]


def test_moves_are_chosen_again_when_holdings_differ_from_the_plans_assumption():
    # the plan thought device 2 held layers 0-3, but an earlier regroup left it with 4-7
    held = {0: (0, 4), 1: (4, 8), 2: (4, 8)}
    agreement = agree([row(d, 3, None, r) for d, r in held.items()])
    plan = _plan([Transfer(2, 1, (0, 1, 2, 3), 4.0)])
    moves, planned = plan_moves(plan, agreement, held)
    assert not planned
    assert {(m.dst, x) for m in moves for x in m.layers} == {(1, x) for x in range(4)}
    assert all(m.src == 0 for m in moves)
    checkpointed = _plan([Transfer(CHECKPOINT, 1, (0, 1, 2, 3), 4.0)])
    assert plan_moves(checkpointed, agreement, held)[0] == moves


def test_a_layer_with_its_optimizer_state_survives_the_wire_format():
    model = mlp_model(layers=2)
    layer = build_layers(model, 1, 2)[0]
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(3, 16, dtype=torch.float64)).sum().backward()
    optimizer.step()
    state = export_layer(1, layer, optimizer)
    sent: dict[int, torch.Tensor] = {}

    def isend(tensor, dst, tag):
        sent[tag] = tensor.clone()

    def recv(tensor, src, tag):
        tensor.copy_(sent[tag])

    send_layer(state, dst=1, tag=1, device=torch.device("cpu"), isend=isend)
    assert len(sent) == 4  # length, header, one buffer of float64, one of float32 (Adam's step)
    got = recv_layer(src=0, tag=1, device=torch.device("cpu"), recv=recv)
    other = build_layers(mlp_model(layers=2, seed=5), 1, 2)[0]
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    import_layer(got, other, other_opt)
    for p, q in zip(layer.parameters(), other.parameters()):
        assert torch.equal(p, q)
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, other_opt.state[q][key])
    assert got.nbytes == state.nbytes
