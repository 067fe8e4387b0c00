"""Process groups for gradient buckets, created once per plan.

``torch.distributed.new_group`` is collective over the whole world: every rank must call it for
every group, in the same order, even for groups it is not in. :class:`GroupTable` therefore
takes the full list of rank sets (derived from the plan, which every rank has), sorts it, and
creates one group per distinct set. Nothing is global: a table belongs to one plan and can be
destroyed and rebuilt in the same live process when the plan changes (in-place recovery).
Sets of one rank need no group and get none.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from .errors import PeerLost, PipelineRuntimeError

__all__ = ["GroupTable"]


class GroupTable:
    def __init__(self, rank_sets: Iterable[Iterable[int]], timeout=None) -> None:
        self._rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], object] = {}
        distinct = sorted({tuple(sorted(s)) for s in rank_sets if len(set(s)) > 1})
        world = dist.get_world_size()
        for ranks in distinct:
            if ranks == tuple(range(world)):
                self._groups[ranks] = dist.group.WORLD
                continue
            try:
                group = dist.new_group(list(ranks), timeout=timeout)
            except RuntimeError as exc:
                raise PeerLost(
                    f"cannot create the process group for ranks {list(ranks)}: {exc}"
                ) from exc
            if self._rank in ranks:
                self._groups[ranks] = group

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
