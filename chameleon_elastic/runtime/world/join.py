"""Joining the job's process group: at start (:func:`init_distributed`) and at every new plan
generation (:func:`join_generation`).

Under ``chameleon-run --job`` a generation's world meets on the worker store under a prefix of
its own, ``chameleon/gen/<N>/``, so a worker can never read an abandoned attempt's keys; the
process's environment is then rewritten to describe the generation (RANK, WORLD_SIZE, MASTER_*,
CHAMELEON_*). The sockets opened while forming the group are recorded (:mod:`.abort`) so the
watchdog can unblock them. A large gloo world is formed with lazy pairs and connects only the
peers its rank will use (:mod:`.regroup`): the full mesh's N^2 store reads and N(N-1)/2
connections made a 1024-rank regroup too slow to finish. Why ``torch._dynamo`` is imported first: see
:func:`preload_before_groups`. One module for both entries, so a fresh process and a survivor
join the same way.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from chameleon_elastic import channel, torch_compat
from chameleon_elastic.channel import Generation
from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.timeouts import Timeouts

from ..errors import PeerLost, PipelineRuntimeError
from ..topology import tp_from_env
from . import regroup
from .abort import GroupSockets, new_sockets
from .groups import init_world
from .link import WorkerLink

__all__ = ["generation_env", "init_distributed", "join_generation", "note_waited",
           "preload_before_groups", "read_plan", "waited_s"]

#: how long one attempt to reach a generation's store lasts before checking for a newer one
_CONNECT_SLICE_S = 1.0
#: seconds this process spent waiting on others, not working: in joins (for every rank of a
#: world to come), and a standby's wait for a place (:func:`waited_s`)
_WAITED_S = [0.0]


def waited_s() -> float:
    """Seconds this process waited on others so far: a process's start-up, which the
    survivors' regroup deadline allows for 5 times when one starts (chameleon_elastic/hang.py),
    is its own work, not the wait for the last rank of its first world (a node started a
    minute late), nor the hours a former standby waited warm for a place."""
    return _WAITED_S[0]


def note_waited(seconds: float) -> None:
    _WAITED_S[0] += max(0.0, seconds)


def join_generation(gen: Generation, link: WorkerLink, backend: str, timeouts: Timeouts) -> None:
    """Make ``gen``'s world the default process group, on a store prefix of its own, and make
    this process's environment describe it (RANK, WORLD_SIZE, MASTER_*, CHAMELEON_*)."""
    preload_before_groups()
    device, rank = link.device, gen.rank(link.device, link.tp_rank)
    began = time.perf_counter()
    lazy = regroup.lazy_wins(backend, gen.world_size)
    peers = (regroup.join_peers(read_plan(gen.plan_file), gen, device, link.tp_rank) if lazy
             else set())
    # the store client's socket is the world's too: groups formed later (a checkpoint's)
    # wait on the store, and a superseded generation's store may be frozen with its host
    forming = regroup.lazy_pairs(backend) if lazy else contextlib.nullcontext()
    with forming, new_sockets() as sockets:
        store = _connect(gen, link, timeouts)
        try:
            torch_compat.forget_failed_group_names()
            init_world(backend, timeouts.delta("collective_s"),
                       dist.PrefixStore(gen.prefix, store), rank, gen.world_size)
            if lazy:   # the pairs this rank will use, open while their sockets are recorded
                regroup.connect_peers(peers)
        except RuntimeError as exc:
            raise PeerLost(f"device {device} could not join generation {gen.generation}: "
                           f"{exc}") from exc
        finally:
            note_waited(time.perf_counter() - began)
    GroupSockets[dist.group.WORLD] = frozenset(sockets)
    os.environ.update(generation_env(gen, link))


def generation_env(gen: Generation, link: WorkerLink) -> dict[str, str]:
    """The environment that describes ``gen`` to this worker: torchrun's world (RANK,
    WORLD_SIZE, MASTER_*) and its ``CHAMELEON_*`` variables (a spare's: no role)."""
    device, plan = link.device, read_plan(gen.plan_file)
    rank = gen.rank(device, link.tp_rank)
    env = {"RANK": str(rank), "WORLD_SIZE": str(gen.world_size),
           "MASTER_ADDR": gen.master_addr, "MASTER_PORT": str(gen.master_port)}
    roles = {r.device: r for r in plan.roles()}
    if device in roles:
        env.update(channel.chameleon_env(plan, roles[device], gen.plan_file,
                                         gen.unit_ranks(device), link.tp_rank))
    else:  # a spare keeps its worker: only the generation-wide variables change
        env.update(channel.spare_env(plan, device, gen.plan_file, gen.unit_ranks(device),
                                     link.tp_rank, link.tp))
    return env


def _connect(gen: Generation, link: WorkerLink, timeouts: Timeouts) -> dist.TCPStore:
    """A client of ``gen``'s worker store. A generation superseded before this worker reached
    it (a second loss right after the first) has its store closed already, and torch's client
    would retry the refused connection for the whole store timeout; so it tries in short
    slices and gives up on the generation as soon as a newer one is published."""
    deadline = time.monotonic() + timeouts.store_s
    while True:
        try:
            store = dist.TCPStore(gen.master_addr, gen.master_port, is_master=False,
                                  timeout=timedelta(seconds=_CONNECT_SLICE_S))
        except RuntimeError as exc:   # DistNetworkError, DistStoreError: refused, timed out
            if link.has(gen.generation + 1):
                raise PeerLost(f"generation {gen.generation} was superseded while device "
                               f"{link.device} joined it") from exc
            if time.monotonic() > deadline:
                raise PeerLost(f"device {link.device} could not reach the store of generation "
                               f"{gen.generation} at {gen.master_addr}:{gen.master_port} "
                               f"within {timeouts.store_s:g} s: {exc}") from exc
            continue
        store.set_timeout(timeouts.delta("store_s"))
        return store


def preload_before_groups() -> None:
    """Import what torch imports lazily on the first meta-device or optimizer operation, before
    the first process group exists. Importing ``torch._dynamo`` while a group is alive makes
    dynamo keep references to that group for good; a group that cannot be freed keeps its
    sockets open after it is destroyed, and then a peer blocked on this process waits for its
    collective timeout instead of failing at once. The import is paid by the trainer anyway.

    Tensor-parallel workers also import ``torch.distributed.tensor`` here, as every worker did
    before it became lazy (tensor_parallel.is_dtensor): imported at the first sharding, while
    the plan's groups were alive, a unit's card was left blocked in a sharded backward's wait
    after its partner had moved to the next generation (1 run in 4 of
    tests/launcher/test_inplace.py's tensor-parallel loss). What is left of that (1 run in 5
    to 10 beside two busy loops) is gloo's: a send that no shutdown fails (:mod:`.abort`)."""
    import torch._dynamo

    if tp_from_env()[1] > 1:
        import torch.distributed.tensor.parallel  # noqa: F401


def read_plan(path: str) -> ExecutionPlan:
    try:
        return ExecutionPlan.from_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PipelineRuntimeError(f"cannot read the plan file {path!r}: {exc}") from exc


def _launched() -> bool:
    """Whether a launcher (torchrun, chameleon-run, Slurm's srun wrappers) set the variables
    torch's ``env://`` rendezvous reads; with none of them the process is alone."""
    return any(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT"))


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the job's process group with the back-end of the device plugin (gloo on CPU;
    ``CHAMELEON_BACKEND`` names another, e.g. ``nccl-legacy``), bound to this process's GPU on
    cuda (:func:`.groups.init_world`), and the resolved collective timeout. Under
    ``chameleon-run --job`` the group is the newest plan generation's, taken from this node's
    agent (so a process started to join a running job meets the survivors); otherwise
    ``init_process_group`` from torchrun's environment, or, with no launcher's variables at all
    (``python train.py``), a world of one on an in-memory store, which is what a person
    starting a script alone means. No-op when already initialised."""
    if dist.is_initialized():
        return
    from chameleon_elastic.plugins import get_backend

    timeouts = Timeouts.resolve(collective_s=timeout_s)
    name = backend or get_backend(os.environ.get("CHAMELEON_BACKEND")).dist_backend
    link = WorkerLink.from_env(timeouts)
    try:
        if link is not None:
            join_generation(link.current(), link, name, timeouts)
        else:
            preload_before_groups()
            alone = {} if _launched() else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
            init_world(name, timeouts.delta("collective_s"), **alone)
    except (RuntimeError, ValueError) as exc:
        raise PipelineRuntimeError(
            f"cannot join the process group with backend {name!r}: {exc}; start the script "
            "with chameleon-run or torchrun so MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE "
            "are set."
        ) from exc
