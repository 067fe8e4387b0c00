"""In-memory snapshots: each device's state in host memory, its own and another node's.

Why: in-place recovery takes a lost device's layers from their live replicas. When a loss takes
every holder of some layers (a stage with one replica, a node holding the last one, two losses
in a row), a snapshot kept on another node still holds them: the survivors go back to it and
train the steps since again, instead of reading a checkpoint from disk or ending the job.

Who talks to whom, in what order (every rank, K = ``every``):

1. Before step S, when S is a multiple of K (step 0 included: the seeded start) or the first
   step of a plan generation (so that the copies sit at the partners of the plan in force,
   which the planner counts on), the training thread starts snapshot S
   (:meth:`Snapshots.before_step`) and goes on training.
2. A background thread copies this device's layers (weights, optimizer state, registered
   objects) and the job's state (its objects, the loss scale) into host memory, then sends the
   copy to its *partner* (``planning.snapshots.partners`` of the plan: a device on another
   node holding none of these layers) and receives the copies of the devices whose partner it
   is. Point to point on a gloo group of its own (one per plan, made at its first snapshot by
   the training thread), so it never shares a group with the step's collectives: every send
   is posted, then every receive blocks in device order, then the sends are awaited.
3. Before step S's vote the training thread waits for that thread (:meth:`fence`): the copy
   reads what only the apply changes, and once any rank commits step S, every rank's exchange
   of snapshot S is complete (the vote needs every rank). Snapshot S is then *sealed*, and the
   next snapshot drops those before it: a device keeps two (three when a recovery cut the
   sealing of one short).

On failure: the copy always ends; an exchange with a lost peer fails (its sockets reset, or the
recovery's abort shuts them down). Entering the next plan first settles the thread
(:meth:`settle`), before anything changes the state. When some layers have no live holder,
:func:`newest_common` finds, from every rank's inventory (all-gathered), the newest step of
which every layer has a copy somewhere, and :func:`restore_snapshot` moves the copies to the
devices that need them under the new plan; the steps after it are trained again.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.planning.snapshots import partners

from ..errors import PeerLost, PipelineRuntimeError
from ..topology import RankMap
from ..world.abort import Freeing
from ..world.groups import side_group
from .layer_state import Packed, pack_layer, packed_bytes, recv_packed, send_packed, unpack
from .migrate import Move, move_states, stage_layers
from .user_state import copy_state

__all__ = ["EVERY_ENV", "Found", "Inventory", "Slot", "Snapshots", "gather_inventories",
           "newest_common", "restore_snapshot", "snapshot_moves", "snapshots_from_env"]

log = logging.getLogger("chameleon_elastic.runtime.state.snapshots")

#: the job's snapshot interval, set by chameleon-run (``--snapshot-every``, ``[recovery]``)
EVERY_ENV = "CHAMELEON_SNAPSHOT_EVERY"
#: snapshots an inventory row can name (two are kept, a third may be under way)
MAX_SLOTS = 3
_HEAD = 4   # step, loss scale, clean steps, holds the job's state
_CPU = torch.device("cpu")


def snapshots_from_env(tp_size: int = 1) -> tuple[int, int | None]:
    """(interval, plan devices per node) from chameleon-run's environment: interval 0 (off)
    without it; a node holds ``LOCAL_WORLD_SIZE`` cards, units of ``tp_size``."""
    every = int(os.environ.get(EVERY_ENV, "0") or 0)
    cards = os.environ.get("LOCAL_WORLD_SIZE")
    return every, (int(cards) // tp_size if cards else None)


#: a settle longer than this is reported on the worker's stderr
SLOW_SETTLE_S = 1.0
#: how long entering a plan waits for a snapshot's exchange once its copy is made. The recovery
#: cut the exchange's sockets before, which fails it at once, except where gloo misses the cut:
#: a pair with sends queued to a frozen peer that had sent us part of a message waits out the
#: group's timeout (once in 200 chaos trials: 13.75 s in entering a plan; docs/runtime.md).
#: Such an exchange is left behind, and its snapshot not counted.
EXCHANGE_GRACE_S = 2.0


@dataclass
class _Run:
    """One run of the snapshot thread: what it reports, apart from any later run's (a run left
    behind by :meth:`Snapshots.settle` may end long after)."""

    step: int
    copied: threading.Event = field(default_factory=threading.Event)   # or failed copying
    error: BaseException | None = None


@dataclass
class Slot:
    """One snapshot on this rank: copies of the state after ``step`` steps."""

    step: int
    scale: tuple[float, int]
    job: dict[str, dict[str, Any]] | None = None   # the job-wide objects' states
    layers: dict[int, Packed] = field(default_factory=dict)   # complete copies only, packed
    sealed: bool = False   # complete on every rank (a later vote passed)


@dataclass(frozen=True)
class Inventory:
    """What one rank holds: step -> (loss scale, clean steps, holds the job's state, layers)."""

    device: int
    slots: Mapping[int, tuple[tuple[float, int], bool, frozenset[int]]]

    def to_tensor(self, num_layers: int) -> torch.Tensor:
        row = torch.full((MAX_SLOTS, _HEAD + num_layers), 0.0, dtype=torch.float64)
        row[:, 0] = -1.0
        for i, (step, (scale, job, layers)) in enumerate(
                sorted(self.slots.items(), reverse=True)[:MAX_SLOTS]):
            row[i, :_HEAD] = torch.tensor([step, scale[0], scale[1], float(job)])
            for x in layers:
                row[i, _HEAD + x] = 1.0
        return row.reshape(-1)

    @classmethod
    def from_tensor(cls, device: int, flat: torch.Tensor, num_layers: int) -> Inventory:
        rows = flat.reshape(MAX_SLOTS, _HEAD + num_layers).tolist()
        slots = {int(r[0]): ((r[1], int(r[2])), r[3] > 0,
                             frozenset(x for x in range(num_layers) if r[_HEAD + x] > 0))
                 for r in rows if r[0] >= 0}
        return cls(device, slots)


@dataclass(frozen=True)
class Found:
    """The newest snapshot every layer shares: its step, loss scale, the devices holding
    each layer's copy, and those holding the job's state (``newest_common``)."""

    step: int
    scale: tuple[float, int]
    holders: Mapping[int, tuple[int, ...]]
    job: tuple[int, ...]


def newest_common(inventories: Sequence[Inventory], num_layers: int) -> Found | None:
    """The newest step of which some rank holds every layer's copy (and, when any rank has
    one, the job's state); None when there is none. Pure: the same on every rank."""
    steps = sorted({s for inv in inventories for s in inv.slots}, reverse=True)
    for step in steps:
        holders: dict[int, list[int]] = {}
        job, scale = [], None
        for inv in inventories:
            entry = inv.slots.get(step)
            if entry is None:
                continue
            scale = entry[0] if scale is None else scale
            if entry[1]:
                job.append(inv.device)
            for x in entry[2]:
                holders.setdefault(x, []).append(inv.device)
        if len(holders) == num_layers and job:
            return Found(step, scale or (1.0, 0),
                         {x: tuple(sorted(h)) for x, h in sorted(holders.items())},
                         tuple(sorted(job)))
    return None


def snapshot_moves(plan: ExecutionPlan, found: Found) -> tuple[Move, ...]:
    """Who sends which copy to whom so that every working device of ``plan`` holds its
    layers at ``found.step``: a device that keeps a copy itself moves nothing; otherwise the
    holder that has sent the fewest layers so far, then the lowest. Pure."""
    sent: dict[int, int] = {}
    moves: dict[tuple[int, int], list[int]] = {}
    for device in plan.working_devices:
        for layer in stage_layers(plan, device):
            holders = found.holders[layer]
            if device in holders:
                continue
            src = min(holders, key=lambda h: (sent.get(h, 0), h))
            sent[src] = sent.get(src, 0) + 1
            moves.setdefault((src, device), []).append(layer)
    return tuple(Move(src, dst, tuple(layers)) for (src, dst), layers in sorted(moves.items()))


@dataclass
class Stats:
    """The last snapshot's costs on this rank (for benchmarks/snapshots.py)."""

    step: int = -1
    copy_s: float = 0.0       # into host memory, in the background
    exchange_s: float = 0.0   # to the partner and from its senders, in the background
    fence_s: float = 0.0      # what the training thread waited for it before the vote
    bytes: int = 0            # of this device's own copy


class Snapshots:
    """This rank's snapshots and the thread that takes them. ``every``: the interval (0:
    none); ``devices_per_node``: the plan's devices per node, for the partner choice."""

    def __init__(self, every: int = 0, devices_per_node: int | None = None) -> None:
        if every < 0:
            raise PipelineRuntimeError(
                f"snapshot_every = {every}; pass an interval >= 1, or 0 for no snapshots.")
        self.every = every
        self.devices_per_node = devices_per_node
        self.slots: dict[int, Slot] = {}
        self.stats = Stats()
        self._group: Any = None
        self._freeing = Freeing()
        self._thread: threading.Thread | None = None
        self._run: _Run | None = None   # what the thread is doing
        self._fenced: int | None = None    # taken and fenced; sealed when its vote passes
        self._taken: tuple[int, int] | None = None   # (generation, step) of the last one

    # ------------------------------------------------------------------ the training thread

    def before_step(self, t: Any) -> None:
        """At a step boundary of the loop: the snapshot fenced in the step before is sealed
        (its vote passed); one is started when the committed step is a multiple of the
        interval, and at the first boundary of every plan generation, so that the copies sit
        at the partners of the plan in force (the planner counts on those) from its first
        step on. Every rank of a generation passes the same boundaries, survivors and
        processes that joined alike, so all decide alike (the plan's group is made
        collectively at its first snapshot). A survivor that kept that step's snapshot from
        the generation before takes it again into the same slot: the same state."""
        if self._fenced is not None and self._fenced in self.slots:
            self.slots[self._fenced].sealed = True
        self._fenced = None
        step, generation = t.committed, t.plan.generation
        fresh = self._taken is None or self._taken[0] != generation
        if self.every and (step % self.every == 0 or fresh) \
                and self._taken != (generation, step):
            self._taken = (generation, step)
            self._start(t, step)

    def fence(self, step: int) -> None:
        """Before step ``step``'s vote: the snapshot under way is complete on this rank."""
        if self._thread is None:
            return
        began = time.perf_counter()
        self._thread.join()
        self.stats.fence_s = time.perf_counter() - began
        self._thread, taken, error = None, self._run.step, self._run.error
        if error is not None:
            if isinstance(error, RuntimeError):
                raise PeerLost(f"a peer was lost during snapshot {taken}: {error}") from error
            raise error
        self._fenced = taken

    def settle(self, timeout_s: float | None = None) -> None:
        """Before anything changes the state after a failure (entering a plan): the thread
        has ended (a copy always ends; an exchange with a lost peer fails once the abort
        shut its sockets) or been left behind, and the plan's group is let go."""
        if self._thread is not None:
            self._wait_for_thread(timeout_s)
            self._thread = None
        self._fenced = None
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError):
                pass   # taken out of torch's books by an abort already
            self._freeing.later([self._group])
            self._group = None

    def close(self, timeout_s: float | None = None) -> None:
        """When the trainer closes: settled, and the plan's group freed before the process
        may end (:class:`.abort.Freeing`)."""
        self.settle(timeout_s)
        self._freeing.join()

    def _wait_for_thread(self, timeout_s: float | None) -> None:
        """For the copy (at most ``timeout_s``), then ``EXCHANGE_GRACE_S`` for the exchange;
        a thread still running is left behind, and its snapshot not counted (the thread may
        still add to it). A long wait is named on the worker's stderr."""
        run, began = self._run, time.perf_counter()
        copied = run.copied.wait(timeout_s)
        self._thread.join(EXCHANGE_GRACE_S if copied else 0)
        waited = time.perf_counter() - began
        if self._thread.is_alive():
            self.slots.pop(run.step, None)
            log.warning("snapshot %s: %s after %.1f s; not waiting longer (not counted)",
                        run.step, "its exchange with a lost peer did not end at the cut"
                        if copied else "still copying", waited)
        elif waited > SLOW_SETTLE_S:
            log.warning("snapshot %s: took %.1f s to end after the failure (%s)", run.step,
                        waited, str(run.error).splitlines()[0] if run.error else "completed")

    def inventory(self, device: int) -> Inventory:
        return Inventory(device, {s.step: (s.scale, s.job is not None, frozenset(s.layers))
                                  for s in self.slots.values()})

    def job_state(self, step: int) -> dict[str, dict[str, Any]] | None:
        """A copy of the job's state in snapshot ``step`` (None when this rank has none)."""
        slot = self.slots.get(step)
        if slot is None or slot.job is None:
            return None
        return {name: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                       for k, v in entry.items()} for name, entry in slot.job.items()}

    def restored(self, step: int) -> None:
        """The state went back to snapshot ``step``: newer ones are partial, drop them; it
        stands as sealed (every layer's copy exists)."""
        for s in [s for s in self.slots if s > step]:
            del self.slots[s]
        if step in self.slots:
            self.slots[step].sealed = True

    # ------------------------------------------------------------------ taking one

    def _start(self, t: Any, step: int) -> None:
        """Keep the newest sealed snapshot and, when a recovery cut the sealing of a newer one
        short, the newest such (its copies may still serve): with this one, at most three."""
        keep = max((s.step for s in self.slots.values() if s.sealed), default=-1)
        unsealed = sorted(s for s in self.slots if s > keep and s != step)
        for s in [s for s in self.slots if s < keep] + unsealed[:-1]:
            del self.slots[s]
        pairs = partners(t.plan, self.devices_per_node)
        send_to = pairs.get(t.device)
        senders = [d for d, p in sorted(pairs.items()) if p == t.device]
        group = self._ensure_group(t) if pairs else None   # the same on every rank
        slot = self.slots.setdefault(step, Slot(step, (t.loss_scale.scale, t.loss_scale.good)))
        work = [(x, t.layers[x], t.extras.get(x)) for x in sorted(t.layers)]
        incoming = [(d, stage_layers(t.plan, d)) for d in senders]
        self._run = _Run(step)
        self._thread = threading.Thread(
            target=self._take, name=f"chameleon-snapshot-{step}", daemon=True,
            args=(self._run, slot, work, t.optimizer, t.job_state, t.ranks, send_to, incoming,
                  group))
        self._thread.start()

    def _ensure_group(self, t: Any) -> Any:
        """The plan's gloo group for snapshots, over the whole world (collective: every rank
        takes the same snapshots); its sockets join those the watchdog and an abort shut."""
        if self._group is None:
            self._group = side_group(t, "snapshot")
        return self._group

    def _take(self, run: _Run, slot: Slot, work: list, optimizer: Any,
              job_state: Mapping[str, Any], ranks: RankMap, send_to: int | None,
              incoming: list, group: Any) -> None:
        """The background thread: copy, then exchange, at the lowest CPU priority (on Linux a
        thread has its own nice value, as DCP's save thread has: runtime/state/dcp_parts.py), so it
        takes the cores training leaves idle rather than slowing its steps."""
        with contextlib.suppress(AttributeError, OSError):   # not Linux: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            began = time.perf_counter()
            states = {x: pack_layer(x, module, optimizer, extras, _CPU)
                      for x, module, extras in work}
            slot.job = {name: {k: v.cpu() if isinstance(v, torch.Tensor) else v
                               for k, v in entry.items()}
                        for name, entry in copy_state(job_state).items()}
            slot.layers.update(states)
            copied = time.perf_counter()
            run.copied.set()
            self._exchange(slot, states, ranks, send_to, incoming, group)
            self.stats = Stats(slot.step, copied - began, time.perf_counter() - copied,
                               0.0, sum(map(packed_bytes, states.values())))
        except BaseException as exc:   # noqa: BLE001 - raised in the training thread
            run.error = exc
        finally:
            run.copied.set()

    @staticmethod
    def _exchange(slot: Slot, states: Mapping[int, Packed], ranks: RankMap,
                  send_to: int | None, incoming: list, group: Any) -> None:
        isend = functools.partial(dist.isend, group=group)
        recv = functools.partial(dist.recv, group=group)
        pending = []
        if send_to is not None:
            dst = ranks.rank(send_to)
            for x, packed in sorted(states.items()):
                pending += send_packed(packed, dst, x, _CPU, isend)
        for src, layers in incoming:
            for x in layers:
                slot.layers[x] = recv_packed(ranks.rank(src), x, _CPU, recv)
        for work, _ in pending:
            work.wait()


def gather_inventories(snapshots: Snapshots, device: int, num_layers: int,
                       ranks: RankMap) -> list[Inventory]:
    """Every rank's inventory (an all-gather over the world, in rank order)."""
    mine = snapshots.inventory(device).to_tensor(num_layers)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(out, mine)
    except RuntimeError as exc:
        raise PeerLost(f"device {device} lost a peer while gathering snapshots: {exc}") from exc
    return [Inventory.from_tensor(ranks.device_of_rank[r], flat, num_layers)
            for r, flat in enumerate(out)]


def restore_snapshot(snapshots: Snapshots, found: Found, plan: ExecutionPlan, device: int,
                     ranks: RankMap, torch_device: torch.device
                     ) -> tuple[dict[int, Any], int, float]:
    """This device's layers of ``plan`` at ``found.step``: its own copies, and the others'
    moved point to point (collective). Returns (layer -> state, layers moved in the job,
    bytes received here)."""
    slot = snapshots.slots.get(found.step)
    kept = {} if slot is None else slot.layers
    moves = snapshot_moves(plan, found)
    received = move_states(moves, device, ranks, lambda x: unpack(kept[x], _CPU),
                           torch_device)
    # unpacked copies: training on them leaves the snapshot as it was
    local = {x: unpack(kept[x], _CPU) for x in stage_layers(plan, device) if x not in received}
    snapshots.restored(found.step)
    moved = float(sum(s.nbytes for s in received.values()))
    return {**local, **received}, sum(len(m.layers) for m in moves), moved
