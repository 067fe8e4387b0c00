"""The agent <-> worker channel: a small store on each node, hosted by that node's agent.

Who talks to whom. With ``--job``, every ``chameleon-run`` agent hosts a TCPStore on loopback and
names it to its workers in ``CHAMELEON_AGENT_STORE=host:port``. A worker talks to its own agent
only; agents talk to each other through the rendezvous. The store outlives any worker, and a
worker never outlives its agent (``orphan_guard``), so neither side can be left talking to a
store that is gone.

Keys (values are JSON; nothing is unpickled):

====================  =======  ===================================================================
key                   writer   meaning
====================  =======  ===================================================================
``gen/<N>``           agent    :class:`Generation` N: where its world meets and who has which rank
``gen``               agent    N of the newest ``gen/<N>``; written after it, so a reader that
                               sees N can read ``gen/<N>``
``worker/<device>``   worker   :class:`Registration`: this worker runs on the runtime, so it can
                               recover in place (unregistered scripts are relaunched)
``resumed/<N>/<d>``   worker   :class:`Resumed`: how device d entered generation N (timings)
``follows/<card>``    worker   the generation whose share of the batch a script not on the
                               runtime follows (a framework adapter, frameworks/share.py): a
                               re-plan that changes its share then needs no warning
``wake/<card>``       agent    a doorbell, rung after each generation published while the
                               worker lives, so its watchdog wakes at once (runtime/world/abort.py);
                               the worker rings it too, to stop the watchdog
``beat/<device>``     worker   a counter moved at every phase of every step (hang detection)
``pace/<device>``     worker   :class:`Pace`: this generation's steps and their times so far,
                               sent with the beats (the agent's straggler watch)
``gap/<device>``      worker   its typical gap between phases in seconds (the auto hang timeout)
``slow/<device>``     worker   present while it is in a stretch expected to be slow (hang.py):
                               in a recovery its phase's :class:`~.hang.PhaseDeadline`
                               (``deadline_s``, ``give_up_s``), else true (the ceiling)
``steps/<device>``    worker   ``{"recent": [[step, seconds], ...]}``: its last committed steps
                               and their times (``--metrics-port``), sent with the beats
``max_failed``        agent    the cap on failed generations in a row (retries.py)
``reported``          worker   last step the job's reporter handed to the user's callback
``checkpoint``        worker   last step a committed checkpoint holds (none: no checkpoint)
``checkpoints``       worker   set when the job writes checkpoints (even before its first one)
``stop``              agent    the signal that preempts the job (``SIGTERM``, ...): stop at the
                               next step boundary with a checkpoint (runtime/recovery/preemption.py)
``trouble``           worker   a plan generation in which a worker lost a peer (so the agent
                               learns of peers on other nodes that it does not run)
``cause/<N>``         worker   the first line of the first failure a worker met in generation N
                               (named when failures keep coming back, retries.py)
``ended``             worker   training cannot go on: the sentence that ends the job (the first
                               one written stays)
====================  =======  ===================================================================

A generation's process groups meet on the worker store named in its record, under the key
prefix ``chameleon/gen/<N>/``: keys of an older generation can never be read by a newer one.

Everything here is plain data plus three tiny functions over any object with torch's ``Store``
methods (``set``, ``get``, ``check``, ``wait``), so the protocol is tested on a ``HashStore``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from chameleon_elastic.plan import DeviceRole, ExecutionPlan
from chameleon_elastic.spec import JobSpec

__all__ = [
    "AGENT_STORE_ENV",
    "CHAMELEON_VARS",
    "Generation",
    "Pace",
    "Registration",
    "Resumed",
    "beat_key",
    "cause_key",
    "chameleon_env",
    "follows_key",
    "gap_key",
    "generation_key",
    "host",
    "job_env",
    "known_reported",
    "pace_key",
    "read",
    "read_int",
    "recent_steps",
    "resumed_key",
    "slow_key",
    "spare_env",
    "steps_key",
    "wake_key",
    "worker_key",
    "write",
    "write_max",
    "write_once",
]

AGENT_STORE_ENV = "CHAMELEON_AGENT_STORE"
NEWEST = "gen"
REPORTED = "reported"
CHECKPOINT = "checkpoint"
CHECKPOINTS = "checkpoints"
TROUBLE = "trouble"
MAX_FAILED = "max_failed"
STOP = "stop"            # the agent was preempted: stop at the next step boundary
ENDED = "ended"          # a worker found that training cannot go on: the sentence that says why
LEAVING = "leaving"      # a slow key's value once its worker is past its last step (leaving)
ENDED_STATUS = "ended_status"   # the exit status the ENDED sentence calls for (exit_status.py)

CHAMELEON_VARS: tuple[str, ...] = (
    "CHAMELEON_PLAN_GENERATION",
    "CHAMELEON_POLICY",
    "CHAMELEON_PIPELINE",
    "CHAMELEON_NUM_PIPELINES",
    "CHAMELEON_STAGE",
    "CHAMELEON_NUM_STAGES",
    "CHAMELEON_LAYER_START",
    "CHAMELEON_LAYER_END",
    "CHAMELEON_MICRO_BATCHES",
    "CHAMELEON_GLOBAL_MICRO_BATCHES",
    "CHAMELEON_PLAN_FILE",
    "CHAMELEON_DEVICE",
    "CHAMELEON_TP_RANK",
    "CHAMELEON_TP_SIZE",
    "CHAMELEON_TP_GROUP_RANKS",
)


def job_env(spec: JobSpec) -> dict[str, str]:
    """What every worker of a job learns of the job itself (not of its plan): how the runtime
    should train by default, so a script follows the job file the planner priced."""
    return {"CHAMELEON_MICRO_BATCH_SIZE": str(spec.training.micro_batch_size),
            "CHAMELEON_PRECISION": spec.training.precision,
            "CHAMELEON_SNAPSHOT_EVERY": str(spec.recovery.snapshot_every or 0)}


def chameleon_env(plan: ExecutionPlan, role: DeviceRole, plan_file: str,
                  unit_ranks: tuple[int, ...], tp_rank: int = 0) -> dict[str, str]:
    """The ``CHAMELEON_*`` variables of one worker (see docs/launcher.md for the table): its
    plan device (a unit of ``len(unit_ranks)`` cards under tensor parallelism), its place in the
    unit and the global ranks of the unit's cards."""
    return {
        "CHAMELEON_PLAN_GENERATION": str(plan.generation),
        "CHAMELEON_POLICY": plan.policy,
        "CHAMELEON_PIPELINE": str(role.pipeline),
        "CHAMELEON_NUM_PIPELINES": str(len(plan.pipelines)),
        "CHAMELEON_STAGE": str(role.stage),
        "CHAMELEON_NUM_STAGES": str(role.num_stages),
        "CHAMELEON_LAYER_START": str(role.layer_start),
        "CHAMELEON_LAYER_END": str(role.layer_end),
        "CHAMELEON_MICRO_BATCHES": str(role.micro_batches),
        "CHAMELEON_GLOBAL_MICRO_BATCHES": str(plan.global_micro_batches),
        "CHAMELEON_PLAN_FILE": plan_file,
        "CHAMELEON_DEVICE": str(role.device),
        "CHAMELEON_TP_RANK": str(tp_rank),
        "CHAMELEON_TP_SIZE": str(len(unit_ranks)),
        "CHAMELEON_TP_GROUP_RANKS": ",".join(map(str, unit_ranks)),
    }


def spare_env(plan: ExecutionPlan, device: int, plan_file: str, unit_ranks: tuple[int, ...],
              tp_rank: int = 0, tp: int = 1) -> dict[str, str]:
    """The ``CHAMELEON_*`` variables of a worker whose device has no role in ``plan``: a spare
    in the generation's world (``unit_ranks``: its cards' global ranks), or a standby waiting
    outside it for a role (no ranks). The role's variables are absent."""
    return {
        "CHAMELEON_PLAN_GENERATION": str(plan.generation),
        "CHAMELEON_POLICY": plan.policy,
        "CHAMELEON_GLOBAL_MICRO_BATCHES": str(plan.global_micro_batches),
        "CHAMELEON_PLAN_FILE": plan_file,
        "CHAMELEON_DEVICE": str(device),
        "CHAMELEON_TP_RANK": str(tp_rank),
        "CHAMELEON_TP_SIZE": str(tp),
        "CHAMELEON_TP_GROUP_RANKS": ",".join(map(str, unit_ranks)),
    }


def generation_key(generation: int) -> str:
    return f"gen/{generation}"


# Per-worker keys name the worker's card: its process slot, ``node * nproc_per_node +
# local_rank`` (the plan's device itself without tensor parallelism).


def worker_key(card: int) -> str:
    return f"worker/{card}"


def follows_key(card: int) -> str:
    return f"follows/{card}"


def beat_key(card: int) -> str:
    return f"beat/{card}"


def pace_key(card: int) -> str:
    return f"pace/{card}"


def steps_key(card: int) -> str:
    return f"steps/{card}"


def resumed_key(generation: int, card: int) -> str:
    return f"resumed/{generation}/{card}"


def gap_key(card: int) -> str:
    return f"gap/{card}"


def slow_key(card: int) -> str:
    return f"slow/{card}"


def cause_key(generation: int) -> str:
    return f"cause/{generation}"


def wake_key(card: int) -> str:
    return f"wake/{card}"


@dataclass(frozen=True)
class Generation:
    """One plan generation as its workers need it.

    ``world`` lists the devices of the generation's process group in rank order: working devices
    (sorted), then spare devices that keep a live worker; each device is a unit of ``tp``
    cards on consecutive ranks. ``reported`` is the last step the job reported as far as the
    agents know (None: unknown), so a new reporter neither skips nor repeats a step.
    ``starting``: devices of ``world`` whose processes start for this generation (a crashed
    worker restarted, a node's first), so the survivors' regroup waits for a process start.
    """

    generation: int
    plan_file: str
    master_addr: str
    master_port: int
    world: tuple[int, ...]
    reported: int | None = None
    tp: int = 1
    starting: tuple[int, ...] = ()

    @property
    def prefix(self) -> str:
        return f"chameleon/gen/{self.generation}/"

    @property
    def world_size(self) -> int:
        return len(self.world) * self.tp

    def rank(self, device: int, tp_rank: int = 0) -> int:
        return self.world.index(device) * self.tp + tp_rank

    def unit_ranks(self, device: int) -> tuple[int, ...]:
        return tuple(self.rank(device, t) for t in range(self.tp))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Generation:
        return cls(int(d["generation"]), str(d["plan_file"]), str(d["master_addr"]),
                   int(d["master_port"]), tuple(int(x) for x in d["world"]),
                   None if d.get("reported") is None else int(d["reported"]),
                   tp=int(d.get("tp", 1)),
                   starting=tuple(int(x) for x in d.get("starting", ())))


@dataclass(frozen=True)
class Registration:
    """A worker whose trainer is set up: it will recover in place when a peer is lost."""

    device: int
    pid: int
    generation: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Registration:
        return cls(int(d["device"]), int(d["pid"]), int(d["generation"]))


@dataclass(frozen=True)
class Resumed:
    """How one worker entered a generation, for the agent's recovery line and event.

    Wall-clock times (``noticed_at``, ``woke_at``, ``committed_at``) are Unix seconds on the
    worker's node, compared only with its own agent's clock. From ``woke_at`` on, the durations
    follow one another: ``regroup_s``, ``agree_s``, ``transfer_s``, ``rebuild_s``, then
    ``first_step_s`` up to ``committed_at`` (the agent's phases, launcher/observation/reporter.py).
    ``moved_layers`` and ``moved_bytes`` count the whole job's transfers (every worker computes
    the same numbers)."""

    device: int
    pid: int
    generation: int
    resumed_step: int
    source: str                   # "peers", "checkpoint", "init" (step 0) or "none" (kept all)
    regroup_s: float              # joining the world (a started process: its whole start-up)
    transfer_s: float
    first_step_s: float
    moved_layers: int
    moved_bytes: float
    rolled_forward: bool
    redone_steps: int
    noticed_at: float | None = None   # this worker saw the failure
    committed_at: float | None = None
    woke_at: float | None = None      # it saw the generation (a started process: it started)
    agree_s: float = 0.0
    rebuild_s: float = 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Resumed:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Pace:
    """One worker's steps in one generation so far, with their times summed: ``busy_s``
    computing (forwards, losses, backwards: what its device's speed is measured from),
    ``wait_s`` the rest of the pipeline part (receiving from peers, data), ``sync_s`` the
    gradient sums. Cumulative, so a sample lost between two reads loses nothing."""

    generation: int
    steps: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pace:
        return cls(int(d["generation"]), int(d["steps"]), float(d["busy_s"]),
                   float(d["wait_s"]), float(d["sync_s"]))


def host(timeouts: Any) -> Any:
    """The agent's end: a store on loopback, on a port the OS picks (``timeouts``: the job's
    :class:`~.timeouts.Timeouts`; a read waits up to its ``store_s``)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timeouts.delta("store_s"))


def write(store: Any, key: str, record: Any) -> None:
    """Store a record (a dataclass above) or a plain JSON value under ``key``."""
    value = asdict(record) if hasattr(record, "__dataclass_fields__") else record
    store.set(key, json.dumps(value))


def write_once(store: Any, key: str, value: Any) -> None:
    """Store a plain JSON value under ``key`` unless one is there: the first writer's stays."""
    store.compare_set(key, "", json.dumps(value))


def write_max(store: Any, key: str, value: int) -> None:
    """Store ``value`` under ``key`` unless a larger one is there (several writers, each
    raising it: the last writer's stale value must not hide a newer one). The first
    compare-and-set expects nothing: it creates the key, or returns what is there."""
    mine, seen = json.dumps(value), ""
    while True:
        seen = store.compare_set(key, seen, mine).decode()
        if seen == mine or json.loads(seen) >= value:
            return


_ABSENT = "\x00absent"   # never a JSON text: a compare against it only reads


def read(store: Any, key: str) -> Any | None:
    """The JSON value under ``key``, or None when it is not there yet, in one request that
    never waits: a compare-and-set expecting a value no writer writes returns what is there,
    and for an absent key returns the expectation without setting it. A check then a get
    raced a delete between them (a worker leaving its slow stretch, a new process's keys
    cleared): the get then waited out the store's timeout, or (TCPStore's libuv server)
    returned empty bytes, which failed an agent in CI with a JSON error."""
    found = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if found == _ABSENT.encode() else json.loads(found)


def read_int(store: Any, key: str) -> int | None:
    value = read(store, key)
    return None if value is None else int(value)


def known_reported(store: Any, cards: Iterable[int]) -> int | None:
    """The last step this node knows the job reported: the reporter's word when it runs here;
    otherwise from the steps its own workers committed (sent with their beats): a worker that
    committed step S ran it with the reporter, which had reported S - 1 before starting it.
    Without this a node that lost the reporter's node believed nothing was reported, and a
    start over from step 0 said nothing of the steps it trained again."""
    reported = read_int(store, REPORTED)
    for card in cards:
        recent = recent_steps(store, card)
        if recent:
            last = max(recent) - 1
            reported = last if reported is None else max(reported, last)
    return reported


def recent_steps(store: Any, card: int) -> dict[int, float]:
    """The steps a worker last said it committed (step -> seconds; sent with its beats)."""
    value = read(store, steps_key(card)) or {}
    return {int(step): float(seconds) for step, seconds in value.get("recent", ())}
