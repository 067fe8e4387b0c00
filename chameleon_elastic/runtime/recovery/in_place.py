"""In-place recovery, worker side: only the training loop restarts, in the surviving process.

Who talks to whom. A worker talks to its own agent through the node's channel (:mod:`.link`):
it registers once its trainer trains in ``run``, learns of each new plan generation there, and
reports how it resumed. The agents decide the plan among themselves. The workers of a
generation then talk to each other only through that generation's process group, which meets
on the worker store under the prefix ``chameleon/gen/<N>/`` (:mod:`.join`).

Calls go one way: the trainer calls the chain, the chain calls down into joining
(:mod:`.join`) and entering the plan (:mod:`.entering`), never back into the trainer.

The chain, run by :meth:`Recovery.recover` when a transfer or collective of the training loop
fails (:class:`~.errors.PeerLost`), or when the agent announces a new generation at a step
boundary. Costs are for the tiny GPT on 2 CPU cores (benchmarks/recovery.py):

========  =====================================================  ============  ==================
step      what                                                   cost          bounded by
========  =====================================================  ============  ==================
notice    a peer's death resets its sockets; a survivor that     < 10 ms       collective_s
          shuts its groups' sockets down fails the next one,
          so every survivor's pending transfer fails at once
abort     shut down every socket of the abandoned step's         ~ 10 ms       (never blocks)
          groups, then destroy (gloo) the groups, or abort
          every NCCL communicator at once and take the groups
          out of torch's books unshut (plugins/cuda.py); no
          garbage collection (0.2 s)
wait      for the agents' next generation on the channel (a      ~ 30 ms       generation_s
          store wait: the publication wakes it)
regroup   ``init_process_group`` on ``chameleon/gen/<N>/``       ~ 50 ms       store_s
agree     all-gather of one :class:`~.commit.Row` per rank:      ~ 1 ms        collective_s
          resume step, roll forward (commit.py)
migrate   layers + optimizer state, point to point along the     bytes / link  collective_s
          planner's transfers (migrate.py); or the checkpoint
rebuild   bucket groups, executor, 1F1B orders for the plan      ~ 20 ms       collective_s
resume    the loop goes on at the first step not committed
          everywhere
========  =====================================================  ============  ==================

A process whose device context is poisoned (a CUDA sticky error in the cause) does not recover
in place: it raises :class:`~.errors.DeviceContextLost` and exits, and its agent restarts it
alone, as it does a crashed worker, while its peers recover in place.

A failure inside the chain (a second device lost while regrouping) aborts again and waits for
the generation after: the chain is idempotent because it starts from what every process holds
and has committed, never from what the previous attempt assumed. Without an agent (plain
torchrun, tests) :class:`~.errors.PeerLost` reaches the caller unchanged.

Bounded (chameleon_elastic/retries.py): each generation abandoned before it committed a step
counts, and past the agent's cap (``--max-failed-generations``) in a row the worker gives up with
:class:`GaveUp`, after telling its agent the sentence that ends the job; a failure that
repeats deterministically would otherwise regroup forever, its beats fooling the hang detector.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.channel import Resumed
from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.retries import DEFAULT_CAP, FailureStreak

from ..errors import DeviceContextLost, PipelineRuntimeError, keep_message_only
from ..state.commit import StateLost
from ..world.abort import Freeing, Watchdog, world_sockets
from ..world.join import join_generation, read_plan, waited_s
from ..world.link import WorkerLink
from .deadlines import RecoveryClock, transfer_bytes
from .entering import Entry, enter, release_groups

__all__ = ["GaveUp", "Recovery"]

log = logging.getLogger("chameleon_elastic.runtime.recovery.in_place")

#: how long the watchdog's wait for a generation lasts before it is renewed (a generation
#: may be hours away)
WATCH_WAIT = timedelta(hours=1)


class GaveUp(PipelineRuntimeError):
    """Too many generations in a row failed before committing a step; the message says why."""


class Recovery:
    """Runs the recovery chain for one trainer and reports each recovery to the agent.
    ``trainer``: the PipelineTrainer whose state the chain rebuilds (its fields; the chain
    calls :mod:`.entering`, never the trainer's methods)."""

    def __init__(self, trainer: Any, link: WorkerLink, backend: Any) -> None:
        self.trainer = trainer
        self.link = link
        self.backend = backend   # a chameleon_elastic.plugins DeviceBackend
        cap = channel.read_int(link.store, channel.MAX_FAILED)   # the agent's
        self.streak = FailureStreak(DEFAULT_CAP if cap is None else cap)
        self._pending: Resumed | None = None
        self._resumed_at = 0.0
        self.registered = False
        self.watchdog: Watchdog | None = None
        self._entering = time.time()   # the trainer enters its first plan next
        self._freeing = Freeing()   # the aborted groups
        self.clock = RecoveryClock(
            backend.unblock, lambda: trainer.group_sockets | trainer.unit_sockets
            | world_sockets(), trainer.phases.allow, spare_port=link.port)

    def announced(self) -> bool:
        """True when the agent has published a newer generation (checked at step starts: one
        loopback round trip)."""
        return self.link.has(self.trainer.plan.generation + 1)

    def abort(self) -> None:
        """Tear every group down. Their sockets are cut first (``DeviceBackend.unblock``), so
        whatever of this process still uses a group fails now, whatever still holds it: a
        group closes its sockets only when it is freed, and one held by a reference cycle
        would wait for a garbage collection (a full one costs 0.2-0.3 s with torch loaded, on
        the path of every recovery). Callers hold no exception of the broken step any more. The
        groups are then only taken out of torch's books; they are freed on a thread
        (:func:`.abort.free_later`: a gloo group's destructor waits 20-30 ms), and a
        checkpoint still being written is settled when the next plan is entered."""
        if self.watchdog is not None:
            self.watchdog.disarm()   # the groups' descriptors are about to be closed
        # the world's own, too: a generation that failed while being entered has its world
        # but not yet the groups that _build records with it
        self.backend.unblock(self.trainer.group_sockets | self.trainer.unit_sockets
                             | world_sockets())
        # NCCL: every group out of torch's books unshut, its communicators aborted (a shutdown
        # after an abort can hang); gloo: none, its groups are destroyed below as ever
        groups = self.backend.forget_groups()
        groups += release_groups(self.trainer)
        if dist.is_initialized():
            groups.append(dist.group.WORLD)
        self.backend.abort_process_groups()
        self._freeing.later(groups)

    def check_device(self, cause: str) -> None:
        """Raise :class:`~.errors.DeviceContextLost` when ``cause`` says this process's device
        context is poisoned (``DeviceBackend.context_lost``: a CUDA sticky error): in place, it
        would fail every generation it entered until the cap ended the whole job; exiting, it
        is restarted alone, as a crashed worker is, and its peers recover in place."""
        if self.backend.context_lost(cause):
            first = cause.splitlines()[0][:300]
            raise DeviceContextLost(
                f"device {self.link.device} lost its {self.backend.name} context ({first}); "
                "it exits so that chameleon-run restarts it alone while its peers recover in "
                "place; if it comes back, find the failing kernel (an index out of range: "
                "CUDA_LAUNCH_BLOCKING=1 names it).")

    def recover(self, cause: str) -> None:
        """notice -> abort -> wait -> regroup -> agree -> migrate -> rebuild; returns when the
        trainer runs the new generation and ``trainer.committed`` is the step to resume at."""
        noticed_at = time.time()
        self.check_device(cause)
        cause = self.clock.explain(cause)   # the first step's deadline may have been missed
        self.clock.cancel()
        log.info("device %d: recovering (%s)", self.link.device, cause.splitlines()[0])
        self.failed(self.trainer.plan.generation, cause)   # before its peers fail too
        self.abort()
        self.link.trouble(self.trainer.plan.generation)
        after = self.trainer.plan.generation
        while True:
            gen = self.link.wait_newer(after)
            woke_at, began = time.time(), time.perf_counter()
            try:
                with keep_message_only() as again:
                    entry, regroup_s = self._enter(gen, began)
            except StateLost as lost:   # a requeue would start over from step 0: 93
                self.clock.cancel()
                self.link.ended(str(lost), ExitStatus.DO_NOT_REQUEUE)
                raise
            if again.message is None:
                break
            self.check_device(again.message)
            message = self.clock.explain(again.message)
            self.clock.cancel()
            log.info("device %d: generation %d failed too (%s)", self.link.device,
                     gen.generation, message.splitlines()[0])
            self.failed(gen.generation, message)
            self.abort()
            # say so: if no worker died (a peer that could not connect in time), no agent
            # would otherwise form the next generation, and everyone would wait for it
            self.link.trouble(gen.generation)
            after = gen.generation
        self.clock.enter_phase("first step")
        self.started(entry, regroup_s, noticed_at=noticed_at, woke_at=woke_at)

    def _enter(self, gen: channel.Generation, began: float) -> tuple[Entry, float]:
        """Regroup into ``gen`` and enter its plan, each phase against its deadline
        (runtime/recovery/deadlines.py); returns the entry and the regroup's seconds."""
        plan = read_plan(gen.plan_file)
        self.clock.begin(transfer_bytes(plan, self.link.device), gen.world_size,
                         starting=bool(gen.starting))
        self.clock.enter_phase("regroup")   # its deadline first: the stretch announces it
        self.trainer.phases(self.trainer.committed, "regroup")
        self.arm(gen.generation)   # a generation published meanwhile ends this one at once
        join_generation(gen, self.link, self.backend.dist_backend, self.link.timeouts)
        regroup_s = time.perf_counter() - began
        self.clock.enter_phase("enter")
        entering = time.perf_counter()
        entry = enter(self.trainer, plan, gen.reported)
        self.clock.regrouped(regroup_s)
        self.clock.entered(time.perf_counter() - entering, entry.moved_bytes, entry.transfer_s)
        return entry, regroup_s

    def failed(self, generation: int, cause: str) -> None:
        """``generation`` was abandoned; past the cap of such in a row, end the job."""
        self.link.failed(generation, cause)
        if self.streak.failed(cause):
            sentence = f"device {self.link.device}: {self.streak.sentence()}"
            self.link.ended(sentence)
            raise GaveUp(sentence)

    def first_entry(self, entry: Entry) -> None:
        """The plan this process entered as it started: it learned of the generation when it
        started, and its start-up (imports, joining the world) is its regroup. What the clock
        keeps as its start-up leaves out the waits (:func:`..world.join.waited_s`): a process
        that starts for a later generation does its own work, not the others'."""
        created = psutil.Process().create_time()
        start_s = max(0.0, self._entering - created)
        self.clock.started_up(max(0.0, start_s - waited_s()))
        self.started(entry, start_s, noticed_at=None, woke_at=created)

    def started(self, entry: Entry, regroup_s: float, noticed_at: float | None,
                woke_at: float) -> None:
        """Remember how this generation was entered (``woke_at``: when this process learned
        of it; ``regroup_s``: from then until it entered the plan); reported after its first
        step commits."""
        self._pending = Resumed(
            device=self.link.card, pid=os.getpid(), generation=self.trainer.plan.generation,
            resumed_step=entry.resume, source=entry.source, regroup_s=regroup_s,
            transfer_s=entry.transfer_s, first_step_s=0.0, moved_layers=entry.moved_layers,
            moved_bytes=entry.moved_bytes, rolled_forward=entry.rolled_forward,
            redone_steps=entry.redone_steps, noticed_at=noticed_at, woke_at=woke_at,
            agree_s=entry.agree_s, rebuild_s=entry.rebuild_s)
        self._resumed_at = time.perf_counter()
        if self.registered:
            self.link.register(self.trainer.plan.generation)
            self.arm()

    def register(self) -> None:
        """Tell the agent that this worker trains in ``trainer.run``, so a lost peer is
        recovered in place (a script that drives ``trainer.step`` itself is relaunched), and
        start the watchdog that unblocks the loop when the agents move on without it."""
        self.registered = True
        self.link.register(self.trainer.plan.generation)
        if self.watchdog is None:
            side = self.link.another(timeout=WATCH_WAIT)   # it waits for the next generation
            self.watchdog = Watchdog(side.wait_for_bell, self.link.ring,
                                     lambda g: side.has(g + 1), self.backend.unblock)
            self.trainer.superseded = self.watchdog.superseded
        self.arm()

    def arm(self, generation: int | None = None) -> None:
        """Arm the watchdog for ``generation`` (default: the plan's), with the sockets of its
        groups as they are when it fires: a survivor entering a generation (regrouping,
        agreeing, moving layers) gives it up at once when a newer one is published, as one
        training does; waiting for a peer that the newer generation left out would last until
        a deadline, and the agent would take it for hung."""
        if self.watchdog is None:
            return
        if generation is None:   # training: the plan's groups (never a socket of the script's)
            self.watchdog.arm(self.trainer.plan.generation, self.trainer.group_sockets)
        else:                    # entering: whatever the generation has opened so far
            self.watchdog.arm(generation, self.clock.generation_sockets)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.link.stop_beats()
        self._freeing.join()

    def step_committed(self, step_s: float) -> None:
        """A step committed here in ``step_s``: the end of a recovery's first step, if one
        was pending."""
        if self.streak.count:
            self.streak.progressed()
        if self._pending is None:
            self.clock.stepped(step_s)
            return
        self.clock.done()
        self.link.resumed(replace(self._pending,
                                  first_step_s=time.perf_counter() - self._resumed_at,
                                  committed_at=time.time()))
        self._pending = None
