"""Gradient sums start during the backward, as each chunk's gradients become final, in the
order every holder shares; a chunk waits for the chunks before it; the sums are exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from chameleon_elastic.plan import AllReduceGroup
from chameleon_elastic.runtime.execution.grad_sync import (
    GradientSums,
    bind_flat,
    norm_holder,
    square_share,
    sum_order,
    sync_gradients,
)
from chameleon_elastic.runtime.topology import RankMap
from chameleon_elastic.runtime.world.groups import GroupTable
from chameleon_elastic.runtime.world.local_world import run_local_world

WIDTH, LAYERS = 8, 4
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 8  # float64 weight and bias


class Skipping(nn.Module):
    """A layer with a parameter no backward reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.unused = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _layers(skip_last: bool) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    out: dict[int, nn.Module] = {i: nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
                                 for i in range(LAYERS)}
    if skip_last:
        out[LAYERS - 1] = Skipping()
    return out


def _backward(layers: dict[int, nn.Module], rank: int, micro_batch: int) -> None:
    gen = torch.Generator().manual_seed(100 * rank + micro_batch)
    x = torch.randn(3, WIDTH, dtype=torch.float64, generator=gen)
    for i in sorted(layers):
        x = torch.tanh(layers[i](x))
    x.square().sum().backward()


def _grads(layers: dict[int, nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for i in sorted(layers) for p in layers[i].parameters()]


def _expected(world: int, skip_last: bool) -> list[torch.Tensor]:
    """Every rank's two micro-batches, accumulated in one process, rank by rank summed."""
    total = None
    for rank in range(world):
        layers = _layers(skip_last)
        for mb in range(2):
            _backward(layers, rank, mb)
        grads = _grads(layers)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


def _sum(rank: int, world: int, skip_last: bool) -> tuple[list, int, int, list]:
    ranks = RankMap(tuple(range(world)))
    rounds = ((AllReduceGroup(tuple(range(LAYERS)), tuple(range(world))),),)
    groups = GroupTable([tuple(range(world))])
    layers = _layers(skip_last)
    order = sum_order(layers, rank, ranks, rounds, cap_bytes=LAYER_BYTES)
    sums = GradientSums(layers, order, groups)
    _backward(layers, rank, 0)  # not the last micro-batch: nothing is final yet
    before = sums.started
    with sums.armed():
        _backward(layers, rank, 1)
        during = sums.started
    sync_gradients(layers, rank, ranks, groups, rounds=rounds, sums=sums)
    return [g.numpy() for g in _grads(layers)], before, during, [c.params for c in order]


@pytest.mark.timeout(60)
def test_sums_start_during_the_last_backward_in_reverse_layer_order_and_are_exact():
    out = run_local_world(_sum, 2, False, timeout_s=50)
    expected = _expected(2, False)
    for grads, before, during, chunks in out:
        assert before == 0
        assert during == len(chunks) == LAYERS  # one chunk per layer, all started in backward
        assert [c[0][0] for c in chunks] == list(reversed(range(LAYERS)))
        assert all(np.array_equal(g, e.numpy()) for g, e in zip(grads, expected))
    assert out[0][3] == out[1][3]


@pytest.mark.timeout(60)
def test_a_chunk_never_final_holds_back_the_chunks_after_it_and_is_summed_at_the_end():
    out = run_local_world(_sum, 2, True, timeout_s=50)
    expected = _expected(2, True)
    for grads, before, during, chunks in out:
        assert chunks[0][-1][0] == LAYERS - 1  # the skipping layer comes first
        assert before == 0 and during == 0
        assert all(np.array_equal(g, e.numpy()) for g, e in zip(grads, expected))


def _two_steps_in_place(rank: int, world: int) -> tuple[list, list, bool]:
    """Two steps with kept buffers; between them one gradient is replaced by a fresh tensor
    (as code outside the sums may do), which must be copied in and rebound, not lost."""
    ranks = RankMap(tuple(range(world)))
    rounds = ((AllReduceGroup(tuple(range(LAYERS)), tuple(range(world))),),)
    groups = GroupTable([tuple(range(world))])
    layers = _layers(False)
    buffers: dict = {}
    out = []
    for step in range(2):
        for m in layers.values():
            m.zero_grad(set_to_none=False)
        if step == 1:
            layers[0].weight.grad = layers[0].weight.grad.clone()
        sums = GradientSums(layers, sum_order(layers, rank, ranks, rounds,
                                              cap_bytes=LAYER_BYTES), groups, buffers)
        _backward(layers, rank, 0)
        with sums.armed():
            _backward(layers, rank, 1)
        sync_gradients(layers, rank, ranks, groups, rounds=rounds, sums=sums)
        out.append([g.numpy() for g in _grads(layers)])
    flats = {flat.untyped_storage().data_ptr() for flat, _ in buffers.values()}
    views = all(p.grad.untyped_storage().data_ptr() in flats
                for m in layers.values() for p in m.parameters())
    return out[0], out[1], views and len(buffers) == LAYERS


@pytest.mark.timeout(60)
def test_sums_in_kept_flat_buffers_are_exact_and_survive_a_replaced_gradient():
    out = run_local_world(_two_steps_in_place, 2, timeout_s=50)
    expected = _expected(2, False)
    for first, second, views in out:
        assert views  # every gradient is a view of a kept buffer, the replaced one rebound
        for got in (first, second):
            assert all(np.array_equal(g, e.numpy()) for g, e in zip(got, expected))


def test_bind_flat_keeps_values_and_leaves_mixed_dtypes_alone():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(2, 2)
    params = [a.weight, a.bias, b.weight]
    a.weight.grad = torch.randn(2, 3)
    before = a.weight.grad.clone()
    bound = bind_flat(params, None)
    assert bound is not None and bound[0].numel() == 6 + 2 + 4
    assert torch.equal(a.weight.grad, before) and torch.equal(b.weight.grad, torch.zeros(2, 2))
    bound[0].fill_(1.0)  # the gradients are views: a sum in place reaches them
    assert all(bool((p.grad == 1).all()) for p in params)
    assert bind_flat(params, bound) is bound  # still bound: kept as it is
    b.weight.grad = torch.full((2, 2), 3.0)  # replaced: copied into the same buffer, rebound
    again = bind_flat(params, bound)
    assert again is not None and again[0] is bound[0] and bool((bound[0][-4:] == 3).all())
    half = nn.Linear(2, 2, dtype=torch.float64)
    assert bind_flat([a.weight, half.weight], None) is None


def test_the_norm_is_counted_once_per_layer_and_split_among_the_holders():
    holders = {i: (0, 1) for i in range(LAYERS)}
    assert [norm_holder(i, holders[i]) for i in range(LAYERS)] == [0, 1, 0, 1]
    layers = _layers(False)
    for m in layers.values():
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
    shares = [square_share(layers, d, holders) for d in (0, 1)]
    every = sum(float(p.grad.square().sum()) for m in layers.values() for p in m.parameters())
    assert shares[0] > 0 and shares[1] > 0
    assert shares[0] + shares[1] == pytest.approx(every, rel=1e-12)


def _train_watching_sums(rank: int, world: int, width: int) -> tuple[list, list, bool]:
    """Data parallelism over ``world`` ranks; at each step's ``sync`` phase (the backward
    done, the sums not yet awaited) how many chunks had started."""
    from chameleon_elastic.models.toy import mlp_model
    from chameleon_elastic.runtime import PipelineTrainer
    from chameleon_elastic.runtime.execution.layout import data_parallel_plan

    model = mlp_model(layers=3, width=width)
    box: dict = {}

    def watch(step: int, phase: str) -> None:
        if phase == "sync":
            box.setdefault("started", []).append(box["trainer"].sums.started)

    trainer = PipelineTrainer(model, data_parallel_plan(world, 3, 4), rank,
                              micro_batch_size=2, on_phase=watch)
    box["trainer"] = trainer
    losses = [trainer.step(t).loss for t in range(3)]
    overlaps = trainer.sums.overlaps
    trainer.close()
    return losses, box["started"], overlaps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("width", [16, 160])
def test_the_trainer_starts_sums_in_the_backward_only_where_that_pays(width):
    """Width 160 (float64: 100 KiB per parameter): the sums start during the last backward;
    width 16 (1 KiB): hooks would cost more than they hide, every sum starts after it. The
    losses equal single-process training either way."""
    from chameleon_elastic.models.toy import mlp_model, reference_training
    from chameleon_elastic.runtime.execution.grad_sync import OVERLAP_MIN_BYTES

    out = run_local_world(_train_watching_sums, 2, width, timeout_s=50)
    expected, _ = reference_training(mlp_model(layers=3, width=width), 3, 4, 2)
    wide = (width * width + width) * 8 / 2 >= OVERLAP_MIN_BYTES
    for losses, started, overlaps in out:
        np.testing.assert_allclose(losses, expected, rtol=1e-9, atol=1e-11)
        assert overlaps == wide
        assert all(n > 0 for n in started) if wide else started == [0, 0, 0]
