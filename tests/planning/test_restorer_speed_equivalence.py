"""The restorer's fast paths choose exactly what the plain definitions choose.

``choose_sources`` keeps busy holders in heaps and walks idle ones in id order, and the
all-reduce rounds are built from pipeline classes with cached colourings; the references here
are the plain versions: a scan over every holder for every item, and buckets and conflicts
computed device by device.
"""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import AllReduceGroup, Pipeline, Transfer
from chameleon_elastic.planning.allreduce import (
    allreduce_round_sizes,
    allreduce_rounds,
    holder_buckets,
)
from chameleon_elastic.planning.restorer import choose_sources
from chameleon_elastic.spec import JobSpec

pytestmark = pytest.mark.timeout(60)


def make_spec(layer_bytes: list[float]) -> JobSpec:
    """A job whose layer ``i`` moves ``layer_bytes[i]`` bytes (all of it parameters)."""
    return JobSpec.from_dict({
        "model": {"layers": len(layer_bytes), "forward_s": 1.0, "backward_s": 2.0,
                  "param_bytes": list(layer_bytes), "optimizer_bytes": 0.0,
                  "activation_bytes": 0.0},
        "cluster": {"devices": 64, "device_memory_bytes": 1e12, "bandwidth_bytes_per_s": 1e9,
                    "restart_s": 1.0, "failure_rate_per_hour": 0.1},
        "training": {"dp": 1, "pp": 1, "global_micro_batches": 1},
    })


# --------------------------------------------------------------------------- sources


def scan_sources(spec: JobSpec, held: dict[int, tuple[int, int]],
                 needs: dict[int, list[int]]) -> tuple[Transfer, ...]:
    """Greedy LPT as the docstring states it: every item, largest first, to the holder with the
    least (time after, growth, sent, id), found by looking at every holder; an item nobody
    holds comes from the checkpoint, after the peer transfers."""
    size = spec.model.transfer_bytes
    items = sorted(((dst, x) for dst, xs in needs.items() for x in xs),
                   key=lambda item: (-size(item[1]), item[1], item[0]))
    received: dict[int, float] = {}
    for dst, x in items:
        received[dst] = received.get(dst, 0.0) + size(x)
    sent = {d: 0.0 for d in held}
    moves: dict[tuple[int, int], list[int]] = {}
    lost: dict[int, list[int]] = {}
    for dst, x in items:
        b = size(x)
        holders = [d for d in held if held[d][0] <= x < held[d][1]]
        if not holders:
            lost.setdefault(dst, []).append(x)
            continue

        def key(h: int, b: float = b) -> tuple[float, float, float, int]:
            r = received.get(h, 0.0)
            after = max(sent[h] + b, r)
            return (after, after - max(sent[h], r), sent[h], h)
        src = min(holders, key=key)
        sent[src] += b
        moves.setdefault((src, dst), []).append(x)
    pairs = [*sorted(moves.items()), *((("checkpoint", d), xs) for d, xs in sorted(lost.items()))]
    return tuple(Transfer(src, dst, tuple(sorted(xs)), float(sum(size(x) for x in xs)))
                 for (src, dst), xs in pairs)


@st.composite
def source_problems(draw, max_devices: int = 40):
    """Devices holding a few distinct ranges (many alike, as at scale), some receiving layers
    they lack; small sizes from a short list so that keys tie often."""
    layers = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, 2.0, 3.0, 4.5]),
                          min_size=layers, max_size=layers))
    ranges = [(0, 0)] + [(a, b) for a in range(layers) for b in range(a + 1, layers + 1)]
    kinds = draw(st.lists(st.sampled_from(ranges), min_size=1, max_size=4, unique=True))
    ids = draw(st.lists(st.integers(0, 99), min_size=1, max_size=max_devices, unique=True))
    held = {d: draw(st.sampled_from(kinds)) for d in ids}
    needs: dict[int, list[int]] = {}
    for d in draw(st.lists(st.sampled_from(ids), unique=True)):
        lacking = [x for x in range(layers) if not held[d][0] <= x < held[d][1]]
        chosen = draw(st.lists(st.sampled_from(lacking), unique=True)) if lacking else []
        if chosen:
            needs[d] = chosen
    return make_spec(sizes), held, needs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_problems())
def test_choose_sources_matches_the_full_scan(problem):
    spec, held, needs = problem
    want = scan_sources(spec, held, needs)
    event("some layer from the checkpoint" if any(t.from_checkpoint for t in want)
          else "every layer from peers")
    assert choose_sources(spec.model.transfer_bytes, held, needs) == want


def test_choose_sources_matches_the_full_scan_at_a_larger_scale():
    # 3 ranges x 60 devices, a third of them receiving: the heaps and the idle cursor interleave
    # over many sends, as at 2048 devices.
    spec = make_spec([3.0, 1.0, 2.0, 2.0, 5.0, 1.0])
    split = [(0, 2), (2, 4), (4, 6)]
    held = {d: split[d % 3] for d in range(180)}
    needs = {d: [x for x in range(6) if not held[d][0] <= x < held[d][1]][: 1 + d % 4]
             for d in range(0, 180, 3)}
    assert choose_sources(spec.model.transfer_bytes, held, needs) == scan_sources(spec, held, needs)


# --------------------------------------------------------------------------- all-reduce


def device_rounds(pipelines: list[Pipeline], failed: tuple[int, ...]
                  ) -> tuple[tuple[AllReduceGroup, ...], ...]:
    """Buckets from every device's every layer, conflicts from shared devices, DSatur rounds."""
    holders: dict[int, set[int]] = {}
    for p in pipelines:
        for d, (a, b) in zip(p.devices, p.layers):
            if d not in failed:
                for x in range(a, b):
                    holders.setdefault(x, set()).add(d)
    buckets: dict[tuple[int, ...], list[int]] = {}
    for x in sorted(holders):
        buckets.setdefault(tuple(sorted(holders[x])), []).append(x)
    groups = sorted((AllReduceGroup(tuple(xs), devices) for devices, xs in buckets.items()
                     if len(devices) > 1), key=lambda g: g.layers)
    graph = nx.Graph()
    graph.add_nodes_from(range(len(groups)))
    graph.add_edges_from((u, v) for u, v in itertools.combinations(range(len(groups)), 2)
                         if set(groups[u].devices) & set(groups[v].devices))
    colour = nx.greedy_color(graph, strategy="saturation_largest_first")
    rounds: dict[int, list[AllReduceGroup]] = {}
    for k, g in enumerate(groups):
        rounds.setdefault(colour[k], []).append(g)
    return tuple(tuple(rounds[c]) for c in sorted(rounds))


@st.composite
def layouts(draw):
    """Pipelines over a few layer splits (repeated, as in a real layout), shuffled device ids,
    and some failed devices."""
    layers = draw(st.integers(1, 12))
    splits = []
    for _ in range(draw(st.integers(1, 4))):
        stages = draw(st.integers(1, min(5, layers)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1,
                                   max_size=stages - 1))) if stages > 1 else []
        splits.append(tuple(itertools.pairwise([0, *cuts, layers])))
    chosen = draw(st.lists(st.sampled_from(splits), min_size=1, max_size=10))
    ids = draw(st.permutations(range(sum(len(s) for s in chosen))))
    pipelines, k = [], 0
    for split in chosen:
        pipelines.append(Pipeline(tuple(ids[k:k + len(split)]), split, 1))
        k += len(split)
    failed = tuple(draw(st.sets(st.sampled_from(ids), max_size=len(ids) // 2)))
    return pipelines, failed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_rounds_and_round_sizes_match_the_device_level_definition(layout):
    pipelines, failed = layout
    want = device_rounds(pipelines, failed)
    assert allreduce_rounds(pipelines, failed) == want
    assert allreduce_round_sizes(pipelines, failed) == tuple(
        tuple((g.layers, len(g.devices)) for g in rnd) for rnd in want)
    buckets = holder_buckets(pipelines, failed)
    assert {g.devices: g.layers for rnd in want for g in rnd} == {
        devices: xs for devices, xs in buckets.items() if len(devices) > 1}


def test_round_sizes_follow_class_counts_when_the_structure_recurs():
    # The same two splits with different numbers of pipelines: one cached colouring, sizes
    # from the counts.
    two, three = ((0, 4), (4, 8)), ((0, 3), (3, 6), (6, 8))
    for n_two, n_three in [(2, 1), (5, 3), (1, 4)]:
        pipelines, k = [], 0
        for split in [two] * n_two + [three] * n_three:
            pipelines.append(Pipeline(tuple(range(k, k + len(split))), split, 1))
            k += len(split)
        sizes = allreduce_round_sizes(pipelines)
        assert sizes == tuple(tuple((g.layers, len(g.devices)) for g in rnd)
                              for rnd in device_rounds(pipelines, ()))
        assert dict(x for rnd in sizes for x in rnd)[(3,)] == n_two + n_three
