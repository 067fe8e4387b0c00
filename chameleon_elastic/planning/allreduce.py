"""All-reduce rounds: which devices reduce which layers' gradients together, and when.

A re-plan's placement (``restorer``: who takes which slot, who sends which layer) depends on what
every device holds now; the gradient reduction of the new layout depends only on its pipelines
and the dead devices. It is the third decision every asymmetric plan needs, and the search, the
simulator's baselines and the runtime (for hand-built plans) ask it of layouts the restorer
never placed, so it lives here, apart from the placement.

**Rounds (graph colouring).** After an asymmetric re-plan a layer lives at different stages of
different pipelines, so gradients are reduced per *bucket*: a maximal set of layers held by
exactly the same devices. Buckets with a single holder need no reduction. Two buckets that share
a device cannot be reduced at the same time, so buckets are the vertices of a conflict graph and
a greedy colouring (networkx, DSatur: ``saturation_largest_first``) gives the rounds: same
colour, same round, run in parallel. All buckets of one device form a clique, so the number of
rounds is at least the most buckets any device holds. DSatur colours next the bucket that
already conflicts with the most distinct rounds, which is exact on many graph families with such
clique structure; on 3,000 random asymmetric pipeline layouts (up to 8 pipelines, 40 layers) it
met that lower bound every time, while degree order (``largest_first``) needed one extra round
in 3 of them (one is a test in ``tests/planning/test_restorer.py``). Both are O(V^2) at worst,
on V = buckets <= a few hundred; the order is deterministic because vertices are inserted sorted
by layer. Buckets and conflicts are found between *classes* of pipelines (same layer split, same
dead stages), never device by device, and both depend only on the classes, not on how many
pipelines each has, so they are cached: a search prices many layouts of the same few classes per
event, and ``allreduce_round_sizes`` prices one with device counts instead of device lists
(``class_round_sizes`` from a count per class, before any pipeline is built).

Everything here is a pure function of its arguments: the same pipelines give the same rounds.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache

from chameleon_elastic.plan import AllReduceGroup, Pipeline

from .restorer import LayerRange

__all__ = [
    "RoundSizes",
    "allreduce_round_sizes",
    "allreduce_rounds",
    "class_round_sizes",
    "holder_buckets",
]

#: One class of pipelines: their layer split and the stages whose device is dead.
_ClassKey = tuple[tuple[LayerRange, ...], tuple[int, ...]]
#: One stage of one class: (class index, stage); every live device sits in exactly one cell.
_Cell = tuple[int, int]
#: A bucket at class level: the live cells holding its layers, and its layers (sorted).
_CellBucket = tuple[frozenset[_Cell], tuple[int, ...]]


def _classes(pipelines: Sequence[Pipeline], failed: Collection[int]
             ) -> dict[_ClassKey, list[Pipeline]]:
    """Pipelines grouped by layer split and dead stages, classes in order of first appearance.

    A layout of 512 pipelines has a handful of classes; everything after this pass works on
    the classes (and their sizes), never on the devices.
    """
    dead = set(failed)
    classes: dict[_ClassKey, list[Pipeline]] = {}
    for p in pipelines:
        dead_stages = () if dead.isdisjoint(p.devices) else tuple(
            s for s, d in enumerate(p.devices) if d in dead)
        classes.setdefault((p.layers, dead_stages), []).append(p)
    return classes


@lru_cache(maxsize=128)
def _cell_buckets(structure: tuple[_ClassKey, ...]) -> tuple[_CellBucket, ...]:
    """Every bucket of layers with a live holder, ordered by layers.

    A layer's holders are the union of the live cells holding it, so two layers share a bucket
    exactly when they sit in the same live cells, and two buckets share a device exactly when
    they share a cell. This depends on the class structure only, not on how many pipelines each
    class has, and the same structures recur from one re-plan to the next: hence the cache.
    """
    num_layers = max(split[-1][1] for split, _ in structure)
    cells_of_layer: list[list[_Cell]] = [[] for _ in range(num_layers)]
    for c, (split, dead_stages) in enumerate(structure):
        for s, (start, end) in enumerate(split):
            if s not in dead_stages:
                for layer in range(start, end):
                    cells_of_layer[layer].append((c, s))
    by_cells: dict[tuple[_Cell, ...], list[int]] = {}
    for layer, cells in enumerate(cells_of_layer):
        if cells:
            by_cells.setdefault(tuple(cells), []).append(layer)
    # Layers are visited in order and buckets are disjoint, so this is already layer order.
    return tuple((frozenset(cells), tuple(layers)) for cells, layers in by_cells.items())


@lru_cache(maxsize=256)
def _colours(cell_sets: tuple[frozenset[_Cell], ...]) -> tuple[int, ...]:
    """DSatur colour of each bucket, two buckets conflicting when they share a cell.

    Quadratic in the buckets, so cached on the cell structure, which recurs across events.
    """
    n = len(cell_sets)
    near: list[list[int]] = [[] for _ in range(n)]
    for u in range(n):
        for v in range(u + 1, n):
            if not cell_sets[u].isdisjoint(cell_sets[v]):
                near[u].append(v)
                near[v].append(u)
    return dsatur(near)


def dsatur(near: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """``networkx.greedy_color(graph, strategy="saturation_largest_first")`` of the graph with
    nodes ``0 .. n-1`` and neighbours ``near[u]``, colour for colour, in O(n^2 + edges).

    Next is the uncoloured node with the most distinct colours among its neighbours, then the
    highest degree, then the lowest number (the first maximum in node order, as networkx
    finds it); it takes the least colour no neighbour has. networkx recomputes every
    saturation at every step (0.7 ms for 40 buckets); this keeps them up to date instead."""
    n = len(near)
    seen: list[set[int]] = [set() for _ in range(n)]  # the colours among each node's neighbours
    colour = [-1] * n
    for _ in range(n):
        best, best_key = -1, (-1, -1)
        for v in range(n):
            if colour[v] < 0 and (len(seen[v]), len(near[v])) > best_key:
                best, best_key = v, (len(seen[v]), len(near[v]))
        taken = seen[best]
        c = 0
        while c in taken:
            c += 1
        colour[best] = c
        for v in near[best]:
            seen[v].add(c)
    return tuple(colour)


def _class_rounds(structure: tuple[_ClassKey, ...], counts: Sequence[int]
                  ) -> tuple[tuple[_CellBucket, ...], ...]:
    """The buckets needing a reduction (more than one live holder), by round."""
    shared = [(cells, layers) for cells, layers in _cell_buckets(structure)
              if sum(counts[c] for c, _ in cells) > 1]
    colours = _colours(tuple(cells for cells, _ in shared))
    rounds: dict[int, list[_CellBucket]] = {}
    for colour, bucket in zip(colours, shared):
        rounds.setdefault(colour, []).append(bucket)
    return tuple(tuple(rounds[c]) for c in sorted(rounds))


def _devices(members: list[list[Pipeline]], cells: frozenset[_Cell]) -> tuple[int, ...]:
    return tuple(sorted([p.devices[s] for c, s in cells for p in members[c]]))


def holder_buckets(pipelines: Sequence[Pipeline],
                   failed: Collection[int] = ()) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Sorted holder set -> sorted layers it holds exactly; every layer with any live holder."""
    classes = _classes(pipelines, failed)
    members = list(classes.values())
    return {_devices(members, cells): layers for cells, layers in _cell_buckets(tuple(classes))}


def allreduce_rounds(pipelines: Sequence[Pipeline],
                     failed: Collection[int] = ()) -> tuple[tuple[AllReduceGroup, ...], ...]:
    """Gradient all-reduce groups by round: no device twice in a round, every bucket once.

    Under reroute the dead devices' data-parallel peers already hold the same layers, so
    excluding ``failed`` loses nothing. Single-holder buckets need no reduction and are left out.
    Groups are ordered by layers within a round.
    """
    classes = _classes(pipelines, failed)
    members = list(classes.values())
    rounds = _class_rounds(tuple(classes), [len(m) for m in members])
    return tuple(
        tuple(AllReduceGroup(layers=layers, devices=_devices(members, cells))
              for cells, layers in rnd)
        for rnd in rounds
    )


#: Per round, per group: (layers, number of devices).
RoundSizes = tuple[tuple[tuple[tuple[int, ...], int], ...], ...]


def allreduce_round_sizes(pipelines: Sequence[Pipeline], failed: Collection[int] = ()
                          ) -> RoundSizes:
    """Exactly the rounds ``allreduce_rounds(pipelines, failed)`` returns, as (layers, number
    of devices) per group, without the device lists: a ring's time needs nothing more."""
    return class_round_sizes({key: len(m) for key, m in _classes(pipelines, failed).items()})


def class_round_sizes(counts: Mapping[_ClassKey, int]) -> RoundSizes:
    """``allreduce_round_sizes`` of pipelines given as a count per class ((layer split, dead
    stages) -> how many, in order of first appearance). A search prices candidate layouts of
    thousands of pipelines this way, from a handful of classes, before building any of them."""
    structure, n = tuple(counts), tuple(counts.values())
    return tuple(tuple((layers, sum(n[c] for c, _ in cells)) for cells, layers in rnd)
                 for rnd in _class_rounds(structure, n))
