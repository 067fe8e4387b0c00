"""How this process makes its process groups: the world, and the subgroups of a plan.

One home, because how depends on the backend and the torch release (docs/runtime.md,
*Process groups*):

- **The world** (:func:`init_world`): ``init_process_group``, bound to this process's GPU
  (``device_id``) when the backend has a cuda part. nccl2 (``nccl`` from torch 2.15) otherwise
  guesses the GPU from LOCAL_RANK ("Duplicate GPU detected" when the guess is wrong), and a
  bound world forms its communicator at once and splits its subgroups from it
  (``ncclCommSplit``) instead of bootstrapping each one through the store. gloo binds nothing.
- **Subgroups** (:class:`GroupTable`): ``new_group`` is collective over the whole world (every
  rank calls it for every group, in one order, members or not) and is what gloo, hccl and the
  classic NCCL (``nccl`` up to 2.14, ``nccl-legacy``) get. nccl2 lacked the eager
  ``new_group`` path for a rank outside the group in its first versions (sglang and
  Megatron-LM moved to ``split_group``), and ``split_group`` makes any number of disjoint
  groups in one collective; so on nccl2 every subgroup is split from the world, one call per
  *round* of disjoint rank sets (:func:`disjoint_rounds`): the tensor-parallel units of a plan
  are one split, not one collective per unit. :func:`subgroup_method` decides.
- **Side groups** (:func:`side_group`): a gloo group over the whole world for work beside the
  steps (background checkpoints, snapshots), which no backend refuses (every rank is a member).
- **Options** (:func:`group_options`): the NCCL part of the world and of every ``new_group``
  is made with the cuda plugin's options (non-blocking communicators, which an abort after a
  lost peer needs; plugins/cuda.py); a split inherits its parent's, each backend its own (2.15
  hands a split's options to every backend of a compound group, and gloo's refuses NCCL's).
  Gloo and hccl groups get torch's defaults, as before.

Nothing is global: a table belongs to one plan and is destroyed and rebuilt in the same live
process when the plan changes (in-place recovery). Sets of one rank need no group and get none.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from chameleon_elastic import torch_compat
from chameleon_elastic.plugins import device_backends, get_backend

from ..errors import PeerLost, PipelineRuntimeError
from .abort import new_sockets

__all__ = ["REFUSE_NEW_GROUP", "GroupTable", "SubgroupMethod", "disjoint_rounds",
           "group_options", "init_world", "side_group", "subgroup_method", "world_device"]

SubgroupMethod = Literal["new_group", "split_group"]

#: backends whose subgroups are split from the world rather than made by ``new_group``
REFUSE_NEW_GROUP = frozenset({"nccl2"})


def world_device(backend: str) -> torch.device | None:
    """The GPU this process binds its world to: the one of its LOCAL_RANK, when ``backend``
    has a cuda part and this host has GPUs; None otherwise (gloo, hccl, no GPU)."""
    if "cuda" not in device_backends(backend) or not torch.cuda.is_available():
        return None
    return get_backend("cuda").device(int(os.environ.get("LOCAL_RANK", "0")))


def group_options(backend: str, timeout: timedelta | None) -> dict[str, Any]:
    """The ``pg_options`` keyword a group on ``backend`` is made with: the cuda plugin's
    options when the backend has a cuda part (non-blocking NCCL communicators), nothing
    otherwise (gloo, hccl: torch's defaults). Fresh each call: torch writes into them."""
    if "cuda" not in device_backends(backend):
        return {}
    seconds = 1800.0 if timeout is None else timeout.total_seconds()
    options = get_backend(backend).group_options(seconds)
    return {} if options is None else {"pg_options": options}


def init_world(backend: str, timeout: timedelta, store: dist.Store | None = None,
               rank: int = -1, world_size: int = -1) -> None:
    """``init_process_group`` for the job's world (from torchrun's environment without
    ``store``), bound to this process's GPU on cuda (:func:`world_device`), its NCCL part made
    with the cuda plugin's options (:func:`group_options`)."""
    device = world_device(backend)
    extra = {} if device is None else {"device_id": device}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **extra, **group_options(backend, timeout))


def subgroup_method(backend: str, refuse: frozenset[str] = REFUSE_NEW_GROUP) -> SubgroupMethod:
    """How a world on ``backend`` (as ``init_process_group`` took it) makes its subgroups:
    ``split_group`` when one of its device backends is in ``refuse`` (nccl2, which plain
    ``nccl`` means from torch 2.15 unless ``TORCH_DIST_USE_NCCL2=0``), else ``new_group``."""
    names = set(device_backends(backend).values())
    if "nccl" in names and torch_compat.nccl_means_nccl2():
        names.add("nccl2")
    return "split_group" if names & refuse else "new_group"


def disjoint_rounds(rank_sets: Iterable[Sequence[int]]) -> list[list[tuple[int, ...]]]:
    """The distinct rank sets (each sorted) packed into rounds of pairwise disjoint sets, in
    sorted order, each set into the first round it fits: one ``split_group`` call per round.
    Every rank computes the same rounds from the same plan."""
    rounds: list[list[tuple[int, ...]]] = []
    taken: list[set[int]] = []
    for ranks in sorted({tuple(sorted(set(s))) for s in rank_sets}):
        for members, used in zip(rounds, taken):
            if used.isdisjoint(ranks):
                members.append(ranks)
                used.update(ranks)
                break
        else:
            rounds.append([ranks])
            taken.append(set(ranks))
    return rounds


def side_group(trainer: Any, purpose: str) -> object:
    """A gloo group over the whole world for ``purpose`` (background checkpoints, snapshots),
    made where first needed (collective: every rank needs it at the same step), so entering a
    plan never pays for it. ``new_group`` on every backend: every rank is a member, so nccl2's
    trouble with ranks outside a group cannot arise, and a split of an nccl world could not
    change its backend. Its sockets join the trainer's, which the watchdog and an abort shut
    (:mod:`.abort`)."""
    with new_sockets() as sockets:
        try:
            group = dist.new_group(list(range(dist.get_world_size())),
                                   timeout=trainer.timeouts.delta("collective_s"),
                                   backend="gloo")
        except RuntimeError as exc:
            raise PeerLost(f"cannot create the {purpose} group: {exc}") from exc
    trainer.group_sockets = trainer.group_sockets | frozenset(sockets)
    if trainer.recovery is not None:
        trainer.recovery.arm()
    return group


class GroupTable:
    """The groups of one plan: one per distinct rank set, made by every rank in sorted order
    (``method`` None: :func:`subgroup_method` of the world's backend)."""

    def __init__(self, rank_sets: Iterable[Iterable[int]], timeout: timedelta | None = None,
                 method: SubgroupMethod | None = None) -> None:
        self._rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], object] = {}
        world = tuple(range(dist.get_world_size()))
        sets = [set(s) for s in rank_sets]
        distinct = sorted({tuple(sorted(s)) for s in sets if len(s) > 1})
        if world in distinct:
            self._groups[world] = dist.group.WORLD
        subsets = [ranks for ranks in distinct if ranks != world]
        method = method or subgroup_method(str(dist.get_backend()))
        if method == "split_group":
            self._split(subsets, timeout)
        else:
            self._new(subsets, timeout)

    def _new(self, subsets: list[tuple[int, ...]], timeout: timedelta | None) -> None:
        backend = str(dist.get_backend())
        for ranks in subsets:
            try:
                group = dist.new_group(list(ranks), timeout=timeout,
                                       **group_options(backend, timeout))
            except RuntimeError as exc:
                raise PeerLost(f"cannot create the process group for ranks {list(ranks)}: "
                               f"{exc}") from exc
            if self._rank in ranks:
                self._groups[ranks] = group

    def _split(self, subsets: list[tuple[int, ...]], timeout: timedelta | None) -> None:
        for members in disjoint_rounds(subsets):
            try:
                group = dist.split_group(split_ranks=[list(r) for r in members],
                                         timeout=timeout)
            except RuntimeError as exc:
                raise PeerLost(f"cannot split the process groups of ranks "
                               f"{[list(r) for r in members]} from the world: {exc}") from exc
            mine = [ranks for ranks in members if self._rank in ranks]
            if mine:
                self._groups[mine[0]] = group

    def get(self, ranks: Iterable[int]) -> object | None:
        """The group of exactly ``ranks`` (must include this rank), None for a single rank."""
        key = tuple(sorted(set(ranks)))
        if len(key) <= 1:
            return None
        try:
            return self._groups[key]
        except KeyError:
            raise PipelineRuntimeError(
                f"no process group for ranks {list(key)} on rank {self._rank}; the group table "
                "was built for another plan."
            ) from None

    def destroy(self) -> list[object]:
        """Take the groups out of torch's books; never raises (after a failure a group may be
        half broken). Returns them: a group is freed with its last reference, and its
        destructor can wait (:func:`.abort.free_later`), so the caller says where that
        happens."""
        groups = [g for g in self._groups.values() if g is not dist.group.WORLD]
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass
        self._groups.clear()
        return groups
