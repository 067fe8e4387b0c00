"""In-place recovery, worker side: only the training loop restarts, in the surviving process.

Who talks to whom. A worker talks to its own agent through the node's channel
(:mod:`chameleon_elastic.channel`): it registers once its trainer is set up, learns of each new
plan generation there, and reports how it resumed. The agents decide the plan among themselves.
The workers of a generation then talk to each other only through that generation's process
group, which meets on the worker store under the prefix ``chameleon/gen/<N>/``.

The chain, run by :meth:`Recovery.recover` when a transfer or collective of the training loop
fails (:class:`~.errors.PeerLost`), or when the agent announces a new generation at a step
boundary. Costs are for the tiny GPT on 2 CPU cores (benchmarks/recovery.py):

========  =====================================================  ============  ==================
step      what                                                   cost          bounded by
========  =====================================================  ============  ==================
notice    a peer's death resets its sockets; a survivor that     < 10 ms       collective_s
          tears its groups down resets them for the next one,
          so every survivor's pending transfer fails at once
abort     destroy (gloo) or abort (nccl/hccl, plugins) every     ~ 10 ms       (never blocks)
          process group of the abandoned step
wait      for the agents' next generation on the channel         ~ 0.1 s       generation_s
regroup   ``init_process_group`` on ``chameleon/gen/<N>/``       ~ 50 ms       store_s
agree     all-gather of one :class:`~.commit.Row` per rank:      ~ 1 ms        collective_s
          resume step, roll forward (commit.py)
migrate   layers + optimizer state, point to point along the     bytes / link  collective_s
          planner's transfers (migrate.py); or the checkpoint
rebuild   bucket groups, executor, 1F1B orders for the plan      ~ 20 ms       collective_s
resume    the loop goes on at the first step not committed
          everywhere
========  =====================================================  ============  ==================

A failure inside the chain (a second device lost while regrouping) aborts again and waits for
the generation after: the chain is idempotent because it starts from what every process holds
and has committed, never from what the previous attempt assumed. Without an agent (plain
torchrun, tests) :class:`~.errors.PeerLost` reaches the caller unchanged.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.channel import Generation, Registration, Resumed
from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.timeouts import Timeouts

from .abort import GroupSockets, Watchdog, new_sockets
from .commit import StateLost
from .errors import PeerLost, PipelineRuntimeError
from .topology import tp_from_env

if TYPE_CHECKING:
    from .trainer import Entry, PipelineTrainer

__all__ = ["Recovery", "WorkerLink", "join_generation", "preload_before_groups"]

log = logging.getLogger("chameleon_elastic.runtime.recovery")


class WorkerLink:
    """A worker's end of its agent's channel (a TCPStore client on loopback). ``device`` is
    the plan's device (a unit of ``tp`` cards under tensor parallelism), ``tp_rank`` this
    worker's place in it; the channel knows the worker by its card."""

    def __init__(self, store: Any, device: int, timeouts: Timeouts, address: str = "",
                 tp_rank: int = 0, tp: int = 1) -> None:
        self.store = store
        self.device = device
        self.timeouts = timeouts
        self.address = address
        self.tp_rank, self.tp = tp_rank, tp

    @property
    def card(self) -> int:
        return self.device * self.tp + self.tp_rank

    @classmethod
    def from_env(cls, timeouts: Timeouts | None = None,
                 env: Mapping[str, str] | None = None) -> WorkerLink | None:
        """The channel named by ``CHAMELEON_AGENT_STORE``; None outside ``chameleon-run --job``."""
        env = os.environ if env is None else env
        address = env.get(channel.AGENT_STORE_ENV)
        if not address:
            return None
        timeouts = timeouts or Timeouts.resolve(env=env)
        host, _, port = address.rpartition(":")
        try:
            device = int(env["CHAMELEON_DEVICE"])
            tp_rank, tp = tp_from_env(env)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=timeouts.delta("store_s"))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise PipelineRuntimeError(
                f"cannot reach this node's chameleon-run agent at {address} ({exc}); the "
                "agent is gone or the variables were copied from another run: start the script "
                f"with chameleon-run, or unset {channel.AGENT_STORE_ENV}."
            ) from exc
        return cls(store, device, timeouts, address, tp_rank, tp)

    def another(self) -> WorkerLink:
        """A second connection to the same channel, for another thread."""
        host, _, port = self.address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=self.timeouts.delta("store_s"))
        return WorkerLink(store, self.device, self.timeouts, self.address, self.tp_rank, self.tp)

    def newest(self) -> int:
        value = channel.read_int(self.store, channel.NEWEST)
        return -1 if value is None else value

    def has(self, number: int) -> bool:
        return bool(self.store.check([channel.generation_key(number)]))

    def generation(self, number: int) -> Generation:
        return Generation.from_dict(channel.read(self.store, channel.generation_key(number)))

    def current(self) -> Generation:
        return self.generation(self.newest())

    def wait_newer(self, than: int) -> Generation:
        """The newest generation after ``than``, waiting up to ``generation_s`` for one."""
        try:
            self.store.wait([channel.generation_key(than + 1)],
                            self.timeouts.delta("generation_s"))
        except RuntimeError as exc:
            raise PipelineRuntimeError(
                f"device {self.device} lost a peer at plan generation {than} but its agent "
                f"published no new plan within {self.timeouts.generation_s:g} s "
                f"(CHAMELEON_GENERATION_TIMEOUT_S); no agent saw a device fail, so a peer may "
                "be hung rather than dead."
            ) from exc
        # the agent writes the generation's key before NEWEST: a worker woken by the key may
        # still read the old NEWEST, and must not join the old generation's (closed) store
        return self.generation(max(self.newest(), than + 1))

    def register(self, generation: int) -> None:
        channel.write(self.store, channel.worker_key(self.card),
                      Registration(self.card, os.getpid(), generation))

    def resumed(self, record: Resumed) -> None:
        channel.write(self.store, channel.resumed_key(record.generation, self.card), record)

    def reported(self, step: int) -> None:
        channel.write(self.store, channel.REPORTED, step)

    def checkpoints(self) -> None:
        channel.write(self.store, channel.CHECKPOINTS, True)

    def checkpointed(self, step: int) -> None:
        channel.write(self.store, channel.CHECKPOINT, step)

    def beat(self) -> None:
        """Progress: the agent declares a worker whose count stops moving (and that is not
        asleep waiting for a peer) hung past ``--hang-timeout``."""
        self.store.add(channel.beat_key(self.card), 1)

    def ended(self, sentence: str) -> None:
        """Training cannot go on (some layer's state exists nowhere): the agent ends the job with
        this sentence instead of reporting a crashed worker."""
        channel.write(self.store, channel.ENDED, sentence)

    def trouble(self, generation: int) -> None:
        """A peer failed us: the agent should look now. Also progress, since a worker busy
        reacting to its peer's loss has not beaten since it blocked on that peer."""
        channel.write(self.store, channel.TROUBLE, generation)
        self.beat()


def join_generation(gen: Generation, link: WorkerLink, backend: str, timeouts: Timeouts) -> None:
    """Make ``gen``'s world the default process group, on a store prefix of its own, and make
    this process's environment describe it (RANK, WORLD_SIZE, MASTER_*, CHAMELEON_*)."""
    preload_before_groups()
    device, rank = link.device, gen.rank(link.device, link.tp_rank)
    store = dist.TCPStore(gen.master_addr, gen.master_port, is_master=False,
                          timeout=timeouts.delta("store_s"))
    try:
        with new_sockets() as sockets:
            dist.init_process_group(backend, store=dist.PrefixStore(gen.prefix, store),
                                    rank=rank, world_size=gen.world_size,
                                    timeout=timeouts.delta("collective_s"))
    except RuntimeError as exc:
        raise PeerLost(f"device {device} could not join generation {gen.generation}: "
                       f"{exc}") from exc
    GroupSockets[dist.group.WORLD] = frozenset(sockets)
    plan = read_plan(gen.plan_file)
    env = {"RANK": str(rank), "WORLD_SIZE": str(gen.world_size),
           "MASTER_ADDR": gen.master_addr, "MASTER_PORT": str(gen.master_port)}
    roles = {r.device: r for r in plan.roles()}
    if device in roles:
        env.update(channel.chameleon_env(plan, roles[device], gen.plan_file,
                                         gen.unit_ranks(device), link.tp_rank))
    else:  # a spare keeps its worker: only the generation-wide variables change
        env.update(CHAMELEON_PLAN_GENERATION=str(plan.generation),
                   CHAMELEON_POLICY=plan.policy, CHAMELEON_PLAN_FILE=gen.plan_file,
                   CHAMELEON_TP_GROUP_RANKS=",".join(map(str, gen.unit_ranks(device))))
    os.environ.update(env)


def preload_before_groups() -> None:
    """Import what torch imports lazily on the first meta-device or optimizer operation, before
    the first process group exists. Importing ``torch._dynamo`` while a group is alive makes
    dynamo keep references to that group for good; a group that cannot be freed keeps its
    sockets open after it is destroyed, and then a peer blocked on this process waits for its
    collective timeout instead of failing at once. The import is paid by the trainer anyway."""
    import torch._dynamo  # noqa: F401


def read_plan(path: str) -> ExecutionPlan:
    try:
        return ExecutionPlan.from_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PipelineRuntimeError(f"cannot read the plan file {path!r}: {exc}") from exc


class Recovery:
    """Runs the recovery chain for one trainer and reports each recovery to the agent."""

    def __init__(self, trainer: PipelineTrainer, link: WorkerLink, backend: Any) -> None:
        self.trainer = trainer
        self.link = link
        self.backend = backend   # a chameleon_elastic.plugins DeviceBackend
        self._pending: Resumed | None = None
        self._resumed_at = 0.0
        self.registered = False
        self.watchdog: Watchdog | None = None

    def announced(self) -> bool:
        """True when the agent has published a newer generation (checked at step starts: one
        loopback round trip)."""
        return self.link.has(self.trainer.plan.generation + 1)

    def abort(self) -> None:
        """Tear every group down. Callers hold no exception of the broken step any more (its
        traceback would keep pending work, hence the group and its sockets, alive); what a
        cycle still holds is collected, so the sockets close and blocked peers fail now."""
        if self.watchdog is not None:
            self.watchdog.disarm()   # the groups' descriptors are about to be closed
        self.trainer.release_groups()
        self.backend.abort_process_groups()
        gc.collect()

    def recover(self, cause: str) -> None:
        """notice -> abort -> wait -> regroup -> agree -> migrate -> rebuild; returns when the
        trainer runs the new generation and ``trainer.committed`` is the step to resume at."""
        noticed_at = time.time()
        log.info("device %d: recovering (%s)", self.link.device, cause.splitlines()[0])
        self.abort()
        self.link.trouble(self.trainer.plan.generation)
        after = self.trainer.plan.generation
        while True:
            gen = self.link.wait_newer(after)
            began = time.perf_counter()
            failed = None
            try:
                join_generation(gen, self.link, self.backend.dist_backend, self.link.timeouts)
                entry = self.trainer.enter(read_plan(gen.plan_file), gen.reported)
            except PeerLost as again:
                failed = str(again)
            except StateLost as lost:
                self.link.ended(str(lost))
                raise
            if failed is None:
                break
            log.info("device %d: generation %d failed too (%s)", self.link.device,
                     gen.generation, failed.splitlines()[0])
            self.abort()
            # say so: if no worker died (a peer that could not connect in time), no agent
            # would otherwise form the next generation, and everyone would wait for it
            self.link.trouble(gen.generation)
            after = gen.generation
        self.started(entry, regroup_s=time.perf_counter() - began - entry.transfer_s,
                     noticed_at=noticed_at)

    def started(self, entry: Entry, regroup_s: float, noticed_at: float | None) -> None:
        """Remember how this generation was entered; reported after its first step commits."""
        self._pending = Resumed(
            device=self.link.card, pid=os.getpid(), generation=self.trainer.plan.generation,
            resumed_step=entry.resume, source=entry.source, regroup_s=regroup_s,
            transfer_s=entry.transfer_s, first_step_s=0.0, moved_layers=entry.moved_layers,
            moved_bytes=entry.moved_bytes, rolled_forward=entry.rolled_forward,
            redone_steps=entry.redone_steps, noticed_at=noticed_at)
        self._resumed_at = time.perf_counter()
        if self.registered:
            self.link.register(self.trainer.plan.generation)
            self._arm()

    def register(self) -> None:
        """Tell the agent that this worker trains in ``trainer.run``, so a lost peer is
        recovered in place (a script that drives ``trainer.step`` itself is relaunched), and
        start the watchdog that unblocks the loop when the agents move on without it."""
        self.registered = True
        self.link.register(self.trainer.plan.generation)
        if self.watchdog is None:
            side = self.link.another()
            self.watchdog = Watchdog(lambda g: side.has(g + 1), self.backend.unblock)
        self._arm()

    def _arm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.arm(self.trainer.plan.generation, self.trainer.group_sockets)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def step_committed(self) -> None:
        if self._pending is None:
            return
        self.link.resumed(replace(self._pending,
                                  first_step_s=time.perf_counter() - self._resumed_at,
                                  committed_at=time.time()))
        self._pending = None
