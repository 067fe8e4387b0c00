"""The NCCL path of a survivor's recovery (plugins/cuda.py, torch_compat.py's NCCL section,
runtime/recovery/in_place.py), on LABELLED FAKES: this machine has no GPU, so no test here
runs NCCL. What they check is the order of the calls our code makes, recorded by fakes that
stand where torch's NCCL objects would:

- **FAKE NCCL groups**: a real one-rank gloo world in this process, whose groups ``has_nccl``
  is told to take for NCCL groups, and whose ``ProcessGroup.abort`` / ``shutdown`` record
  their calls instead of running (torch's books, ``_world``, stay real);
- **FAKE NCCL backends / options**: plain objects that record ``_group_start``, aborts,
  ``_group_end``, a coalescing region, and what a group is made with.

A GPU run (benchmarks/cuda_smoke.py) is where the real calls are exercised. What the GPU path
shares with gloo (the recovery chain, the socket cut, regrouping) stays covered by the gloo
tests (test_abort.py, test_regroup.py, test_runtime_join.py, tests/launcher/test_inplace.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from chameleon_elastic import torch_compat
from chameleon_elastic.plugins import cuda as cuda_plugin
from chameleon_elastic.plugins import get_backend
from chameleon_elastic.plugins.cuda import CudaBackend
from chameleon_elastic.runtime.errors import DeviceContextLost
from chameleon_elastic.runtime.recovery.in_place import Recovery
from chameleon_elastic.runtime.world import abort as abort_module
from chameleon_elastic.runtime.world import groups as groups_module
from chameleon_elastic.runtime.world.abort import Freeing
from chameleon_elastic.runtime.world.groups import GroupTable, init_world

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_nccl_world(monkeypatch):
    """FAKE (no GPU here): a one-rank gloo world with two plan groups, played as an NCCL world.
    ``has_nccl`` says yes for every group; ``ProcessGroup.abort`` and ``shutdown`` record their
    calls in ``calls`` instead of running. Yields (calls, world, [plan groups])."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(torch_compat, "has_nccl", lambda group: True)
    monkeypatch.setattr(dist.ProcessGroup, "abort",
                        lambda self: calls.append(("abort", self.group_name)))
    monkeypatch.setattr(dist.ProcessGroup, "shutdown",
                        lambda self: calls.append(("shutdown", self.group_name)))
    monkeypatch.setattr(cuda_plugin, "_ABORTED", cuda_plugin.weakref.WeakSet())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    plan = [dist.new_group([0]), dist.new_group([0])]
    try:
        yield calls, dist.group.WORLD, plan
    finally:
        monkeypatch.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch_compat.forget_failed_group_names()


def _recovery(backend, plan_groups) -> Recovery:
    """A Recovery with only what its abort reads: a trainer whose plan table holds
    ``plan_groups`` (no sockets, no save), no watchdog."""
    table = GroupTable.__new__(GroupTable)
    table._rank, table._groups = 0, {(0, i): g for i, g in enumerate(plan_groups)}
    trainer = SimpleNamespace(group_sockets=frozenset(), unit_sockets=frozenset(),
                              groups=table, tp_groups=None, save_group=None)
    recovery = Recovery.__new__(Recovery)
    recovery.trainer, recovery.backend, recovery.watchdog = trainer, backend, None
    recovery._freeing = Freeing()
    recovery.link = SimpleNamespace(device=3)
    return recovery


def _freed(monkeypatch) -> list[list[object]]:
    """FAKE free_later: records what the abort hands over to be freed."""
    freed: list[list[object]] = []

    def record(groups):
        freed.append(list(groups))
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread

    monkeypatch.setattr(abort_module, "free_later", record)
    return freed


def test_a_survivor_aborts_every_communicator_once_and_shuts_none_down(fake_nccl_world,
                                                                       monkeypatch):
    """FAKE NCCL groups (no GPU here): a survivor's abort on the cuda back-end aborts every
    group's communicators, the newest first and the world last, each once; no group is shut
    down (``destroy_process_group`` after an abort can hang); every group leaves torch's books
    and goes to be freed off the training thread; a second abort (a second loss while
    regrouping) finds nothing left to abort."""
    calls, world, plan = fake_nccl_world
    freed = _freed(monkeypatch)
    recovery = _recovery(CudaBackend(), plan)
    recovery.abort()
    names = [g.group_name for g in sorted(plan, key=lambda g: g.group_name, reverse=True)]
    assert calls == [("abort", n) for n in names] + [("abort", world.group_name)]
    assert not dist.is_initialized()
    assert {id(g) for g in freed[0]} >= {id(world), *(id(g) for g in plan)}
    recovery.abort()
    assert len(calls) == 3, "a communicator was aborted twice"


def test_the_watchdogs_abort_leaves_torchs_books_to_the_training_thread(fake_nccl_world,
                                                                        monkeypatch):
    """FAKE NCCL groups (no GPU here): the watchdog's thread (a newer generation published)
    aborts every communicator and leaves the groups in torch's books, so the training thread
    meets an aborted communicator, not a group torch forgot; the training thread's abort then
    takes them out without aborting any a second time and without a shutdown."""
    calls, _, plan = fake_nccl_world
    _freed(monkeypatch)
    backend = CudaBackend()
    side = threading.Thread(target=backend.unblock, args=(frozenset(),))
    side.start()
    side.join(10)
    assert [c for c, _ in calls] == ["abort"] * 3
    assert dist.is_initialized() and all(dist.get_backend(g) == "gloo" for g in plan)
    _recovery(backend, plan).abort()
    assert [c for c, _ in calls] == ["abort"] * 3
    assert not dist.is_initialized()


def test_gloo_keeps_its_teardown(monkeypatch):
    """Gloo's abort is unchanged (no FAKE): the back-end forgets nothing itself, the plan's
    groups and then the world are destroyed as before, and a new world forms after it."""
    freed = _freed(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = [dist.new_group([0])]
        backend = get_backend("cpu")
        assert backend.forget_groups() == []
        _recovery(backend, plan).abort()
        assert not dist.is_initialized() and len(freed[0]) == 2
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_forgetting_groups_leaves_what_torchs_abort_leaves():
    """Real gloo (what the NCCL path shares with it): ``forget_process_groups`` takes every
    group out of torch's books, the order being torch's own (newest first), leaves no default
    group and the group counter at 0, so the next world is named as on a fresh process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        order = [g.group_name for g in torch_compat.process_groups()]
        assert order == sorted([sub.group_name, dist.group.WORLD.group_name], reverse=True)
        gone = torch_compat.forget_process_groups()
        assert len(gone) == 2 and not dist.is_initialized()
        assert distributed_c10d._world.group_count == 0 and not distributed_c10d._world.pg_map
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.group.WORLD.group_name == "0"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _FakeGroup:
    """FAKE NCCL process group (no GPU here): records its abort; ``fail`` makes it raise as
    nccl2 does when the abort itself times out."""

    def __init__(self, name: str, calls: list, backend: object, fail: bool = False) -> None:
        self.group_name, self._calls, self._backend, self._fail = name, calls, backend, fail

    def _get_backend(self, device):
        return self._backend

    def abort(self) -> None:
        self._calls.append(("abort", self.group_name))
        if self._fail:
            raise RuntimeError("NCCL Abort failed: timed out")


def test_aborts_form_one_nccl_group_call_before_torch_2_15(monkeypatch):
    """FAKE NCCL backend (no GPU here): on torch 2.13 and 2.14, the aborts run between the
    leading group's ``_group_start`` and ``_group_end``, as torch's ``_abort_process_group``
    runs them (one by one they can deadlock); one that fails is reported, the others still
    run and the group call is closed."""
    calls: list = []

    class FakeClassicNccl:   # FAKE: the classic ProcessGroupNCCL backend
        def _group_start(self):
            calls.append(("group_start", ""))

        def _group_end(self):
            calls.append(("group_end", ""))

    backend = FakeClassicNccl()
    monkeypatch.setattr(torch_compat, "torch_release", lambda: (2, 13))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeClassicNccl, raising=False)
    groups = [_FakeGroup("2", calls, backend), _FakeGroup("1", calls, backend, fail=True),
              _FakeGroup("0", calls, backend)]
    failed = torch_compat.abort_communicators(groups)
    assert calls == [("group_start", ""), ("abort", "2"), ("abort", "1"), ("abort", "0"),
                     ("group_end", "")]
    assert len(failed) == 1 and failed[0].startswith("1: ")


def test_aborts_form_one_coalescing_region_from_torch_2_15(monkeypatch):
    """FAKE NCCL backend (no GPU here): from torch 2.15 the aborts run inside one coalescing
    region of the leading group (``_coalescing_manager``), as 2.15's ``_abort_process_group``
    runs them."""
    calls: list = []
    backend = SimpleNamespace(supports_coalescing=True)   # FAKE: a backend that coalesces

    @contextlib.contextmanager
    def coalescing(group, device):   # FAKE: records the region torch would open
        calls.append(("coalesce", group.group_name))
        yield
        calls.append(("end", group.group_name))

    monkeypatch.setattr(torch_compat, "torch_release", lambda: (2, 15))
    monkeypatch.setattr(distributed_c10d, "_coalescing_manager", coalescing)
    groups = [_FakeGroup("1", calls, backend), _FakeGroup("0", calls, backend)]
    assert torch_compat.abort_communicators(groups) == []
    assert calls == [("coalesce", "0"), ("abort", "1"), ("abort", "0"), ("end", "0")]


class _FakeOptions:
    """FAKE ``ProcessGroupNCCL.Options`` (this torch has no NCCL): says how it was made."""

    def __init__(self, nonblocking: bool) -> None:
        self.nonblocking = nonblocking


@pytest.fixture
def fake_nccl_creation(monkeypatch):
    """FAKE NCCL group creation (no GPU here): ``init_process_group`` / ``new_group`` /
    ``split_group`` record their keyword arguments; NCCL is 2.28; the options are
    :class:`_FakeOptions`. Yields the list of (call, kwargs)."""
    made: list[tuple[str, dict]] = []
    for name in ("init_process_group", "new_group", "split_group"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: made.append((_n, k)))
    monkeypatch.setattr(torch_compat, "nccl_options", _FakeOptions)
    monkeypatch.setattr(CudaBackend, "_nccl_version", lambda self: (2, 28, 3))
    monkeypatch.setattr(groups_module, "world_device", lambda backend: None)
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    return made


def _table(monkeypatch, backend: str, method: str, sets) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    GroupTable(sets, timeout=timedelta(seconds=90), method=method)


def test_nccl_communicators_are_made_non_blocking(fake_nccl_creation, monkeypatch):
    """FAKE NCCL creation (no GPU here): the world's NCCL part and every ``new_group``'s get
    fresh non-blocking options (torch writes into them), the classic backend's non-blocking
    wait is bounded by the collective timeout, and a split passes none (it inherits its
    parent's, each backend its own)."""
    made = fake_nccl_creation
    init_world("cpu:gloo,cuda:nccl", timedelta(seconds=90), store=None, rank=0, world_size=8)
    _table(monkeypatch, "cpu:gloo,cuda:nccl", "new_group", [(0, 1), (2, 3)])
    _table(monkeypatch, "cpu:gloo,cuda:nccl2", "split_group", [(0, 1), (2, 3)])
    options = [k["pg_options"] for name, k in made if name != "split_group"]
    assert [name for name, _ in made] == ["init_process_group", "new_group", "new_group",
                                          "split_group"]
    assert all(o.nonblocking for o in options) and len({id(o) for o in options}) == 3
    assert "pg_options" not in made[-1][1]
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "90"


def test_gloo_groups_get_torchs_defaults(fake_nccl_creation, monkeypatch):
    """FAKE creation calls (no GPU needed): a gloo world and its groups get no options, as
    before."""
    made = fake_nccl_creation
    init_world("gloo", timedelta(seconds=90), store=None, rank=0, world_size=8)
    _table(monkeypatch, "gloo", "new_group", [(0, 1)])
    assert all("pg_options" not in kwargs for _, kwargs in made)


@pytest.mark.parametrize(("user", "nccl", "nonblocking"),
                         [("0", (2, 28, 3), False), ("1", (2, 28, 3), False),
                          (None, (2, 26, 2), False), (None, (2, 30, 7), True)])
def test_a_users_choice_and_an_old_nccl_keep_torchs_default(monkeypatch, user, nccl,
                                                            nonblocking):
    """FAKE NCCL version and options (no GPU here): ``TORCH_NCCL_USE_COMM_NONBLOCKING`` set by
    the user is left to torch (the options leave the choice open), and NCCL before 2.27 (2.26
    hangs non-blocking) keeps blocking communicators."""
    monkeypatch.setattr(torch_compat, "nccl_options", _FakeOptions)
    monkeypatch.setattr(CudaBackend, "_nccl_version", lambda self: nccl)
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    if user is None:
        monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_USE_COMM_NONBLOCKING", user)
    assert CudaBackend().group_options(60.0).nonblocking is nonblocking


@pytest.mark.parametrize("error", ["CUDA error: device-side assert triggered",
                                   "CUDA error: an illegal memory access was encountered"])
def test_a_poisoned_cuda_context_exits_instead_of_recovering_in_place(error):
    """FAKE cause (no GPU here): a lost peer whose message carries a CUDA sticky error (as a
    broken receive wraps it) is not recovered in place: the worker raises DeviceContextLost
    before telling its agent anything or tearing a group down, so it exits and is restarted
    alone while its peers recover in place."""
    told: list = []
    recovery = _recovery(CudaBackend(), [])
    recovery.link = SimpleNamespace(device=3, failed=lambda *a: told.append(a))
    cause = f"device 3 timed out or failed receiving from device 2 (tag 7): {error}"
    with pytest.raises(DeviceContextLost, match="restarts it alone"):
        recovery.recover(cause)
    assert told == []


def test_a_lost_peer_is_not_a_poisoned_context():
    """No GPU needed: a broken link is not a sticky error, on either back-end, and nothing is
    a poisoned context on the CPU."""
    message = "device 1 timed out or failed receiving from device 2: Connection closed by peer"
    assert not CudaBackend().context_lost(message)
    assert not get_backend("cpu").context_lost("CUDA error: device-side assert triggered")
