"""How groups are made (runtime/world/groups.py): the decision per backend and torch release, the
rounds of disjoint rank sets that ``split_group`` takes, and both ways of making a plan's
groups on real processes.

nccl2 needs a GPU, which this suite never has. Its part is played by **FAKE_NCCL2**, a backend
registered here that is clearly not nccl2: a real gloo backend underneath, which refuses every
group made by ``new_group`` as nccl2 refuses the eager ``new_group`` path, and which ``split_group``
splits as it splits nccl2. It checks our side of the decision, never NCCL itself: that is
benchmarks/cuda_smoke.py's job on a GPU.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_elastic import torch_compat
from chameleon_elastic.plugins import PluginError, device_backends, get_backend
from chameleon_elastic.runtime.world.groups import (
    REFUSE_NEW_GROUP,
    GroupTable,
    disjoint_rounds,
    subgroup_method,
    world_device,
)
from chameleon_elastic.runtime.world.local_world import run_local_world

#: FAKE: a stand-in for nccl2 (no GPU here); see the module docstring
FAKE_NCCL2 = "fake-nccl2-for-tests"

needs_cpu_split = pytest.mark.skipif(
    not torch_compat.split_group_on_cpu(),
    reason="split_group cannot split a CPU world before torch 2.15")

# 4 ranks: two tensor-parallel units (disjoint: one split), the data-parallel pairs of their
# cards (a second round), an overlapping pair (a third) and the whole world (WORLD itself)
PLAN_SETS = [(0, 1), (2, 3), (0, 2), (1, 3), (1, 2), (0, 1, 2, 3)]


# ---------------------------------------------------------------- the decision

@pytest.mark.parametrize("backend, method", [
    ("gloo", "new_group"),
    ("cpu:gloo", "new_group"),
    ("hccl", "new_group"),
    ("cpu:gloo,cuda:nccl-legacy", "new_group"),
    ("nccl-legacy", "new_group"),
    ("cpu:gloo,cuda:nccl2", "split_group"),
    ("nccl2", "split_group"),
])
def test_each_backend_gets_its_way_of_making_subgroups(backend, method):
    assert subgroup_method(backend) == method


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_plain_nccl_splits_exactly_where_torch_builds_nccl2_for_the_name(backend):
    """2.15: nccl2 (split_group); 2.13, 2.14: the classic NCCL (new_group). The CI runs this on
    both ends of the range."""
    expected = "split_group" if torch_compat.nccl_means_nccl2() else "new_group"
    assert subgroup_method(backend) == expected


def test_the_fake_is_split_only_when_named_as_refusing_new_group():
    assert subgroup_method(FAKE_NCCL2) == "new_group"
    assert subgroup_method(FAKE_NCCL2, REFUSE_NEW_GROUP | {FAKE_NCCL2}) == "split_group"


def test_no_gpu_is_bound_without_a_cuda_backend_or_without_a_gpu():
    import torch

    assert world_device("gloo") is None and world_device("hccl") is None
    if not torch.cuda.is_available():
        assert world_device("cpu:gloo,cuda:nccl") is None


# ---------------------------------------------------------------- backend names

@pytest.mark.parametrize("name, device, dist_backend", [
    ("cpu:gloo,cuda:nccl", "cuda", "cpu:gloo,cuda:nccl"),     # what dist.get_backend() says
    ("cpu:gloo,cuda:nccl-legacy", "cuda", "cpu:gloo,cuda:nccl-legacy"),
    ("nccl-legacy", "cuda", "cpu:gloo,cuda:nccl-legacy"),
    ("nccl2", "cuda", "cpu:gloo,cuda:nccl2"),
    ("nccl", "cuda", "cpu:gloo,cuda:nccl"),
    ("cpu:gloo", "cpu", "gloo"),
    ("gloo", "cpu", "gloo"),
])
def test_a_worlds_backend_name_leads_back_to_its_plugin(name, device, dist_backend):
    backend = get_backend(name)
    assert (backend.name, backend.dist_backend) == (device, dist_backend)
    assert get_backend(backend.dist_backend).dist_backend == dist_backend   # a fixed point


def test_an_unknown_nccl_implementation_is_refused_with_the_choices():
    with pytest.raises(PluginError, match="nccl, nccl2, nccl-legacy"):
        get_backend("nccl-lazy")


def test_device_backends_reads_compound_and_plain_names():
    assert device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends("nccl2") == {"cuda": "nccl2"}
    assert device_backends("hccl") == {"npu": "hccl"}
    assert device_backends("gloo") == {"cpu": "gloo"}


# ---------------------------------------------------------------- rounds of disjoint sets

def test_tensor_parallel_units_are_one_round():
    assert disjoint_rounds([(2, 3), (0, 1), (6, 7), (4, 5)]) == [[(0, 1), (2, 3), (4, 5),
                                                                   (6, 7)]]


def test_overlapping_sets_go_to_later_rounds():
    assert disjoint_rounds([(0, 1), (1, 2), (0, 2), (3, 4)]) == [[(0, 1), (3, 4)], [(0, 2)],
                                                                 [(1, 2)]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 15), min_size=2, max_size=6), max_size=24),
       st.randoms(use_true_random=False))
def test_rounds_hold_every_set_once_are_disjoint_and_ignore_the_input_order(sets, rnd):
    rounds = disjoint_rounds(sets)
    flat = [s for members in rounds for s in members]
    assert sorted(flat) == sorted({tuple(sorted(s)) for s in sets})
    for members in rounds:
        ranks = [r for s in members for r in s]
        assert len(ranks) == len(set(ranks))
    shuffled = [list(s) for s in sets]
    rnd.shuffle(shuffled)
    assert disjoint_rounds(shuffled) == rounds


# ---------------------------------------------------------------- real processes

def _register_fake_nccl2() -> None:
    import torch.distributed as dist

    def create(opts, _options):
        if opts.global_ranks_in_group:   # a subgroup, made by new_group
            raise RuntimeError(f"{FAKE_NCCL2} (a stand-in for nccl2, no GPU here) refuses "
                               "new_group; split the group from the world")
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)

    if FAKE_NCCL2.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(FAKE_NCCL2, create, extended_api=True, devices=["cpu"])


def _sums_in_each_group(rank: int, world: int, method: str | None, store_path: str | None,
                        sets: list[tuple[int, ...]]) -> dict:
    """Every rank builds the table twice (a plan change in place) and all-reduces its rank + 1
    in each of its groups; returns what it saw. With ``store_path`` the world is re-formed on
    FAKE_NCCL2 first, after checking that the fake refuses new_group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    refused = None
    if store_path is not None:
        dist.destroy_process_group()   # run_local_world's gloo world
        _register_fake_nccl2()
        dist.init_process_group(FAKE_NCCL2, store=dist.FileStore(store_path, world),
                                rank=rank, world_size=world, timeout=timedelta(seconds=30))
        try:
            dist.new_group(list(range(world)))
        except RuntimeError as exc:
            refused = str(exc)
        method = subgroup_method(str(dist.get_backend()), REFUSE_NEW_GROUP | {FAKE_NCCL2})
    seen = []
    for _ in range(2):
        table = GroupTable(sets, timeout=timedelta(seconds=30), method=method)
        sums = {}
        for ranks in sorted({tuple(sorted(s)) for s in sets}):
            group = table.get(ranks) if rank in ranks else None
            if group is not None:
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t, group=group)
                sums[ranks] = t.item()
        seen.append(sums)
        table.destroy()
    return {"method": method, "refused": refused, "sums": seen}


def _expected(rank: int, sets: list[tuple[int, ...]]) -> dict:
    return {s: float(sum(r + 1 for r in s)) for s in sets if rank in s}


def test_a_plans_groups_by_new_group_on_gloo():
    out = run_local_world(_sums_in_each_group, 4, None, None, PLAN_SETS, timeout_s=90)
    for rank, got in enumerate(out):
        assert got["sums"] == [_expected(rank, PLAN_SETS)] * 2


@needs_cpu_split
def test_a_plans_groups_split_from_a_world_that_refuses_new_group(tmp_path):
    out = run_local_world(_sums_in_each_group, 4, None, str(tmp_path / "store"), PLAN_SETS,
                          timeout_s=90)
    for rank, got in enumerate(out):
        assert got["refused"] is not None and "refuses new_group" in got["refused"]
        assert got["method"] == "split_group"
        assert got["sums"] == [_expected(rank, PLAN_SETS)] * 2
