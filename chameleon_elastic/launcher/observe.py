"""Observability: a JSONL event log for machines and a one-line live status for people.

Event log: one JSON object per line, appended and flushed as it happens, so a crashed launcher
still leaves everything up to the crash and ``tail -f`` works. Every record has ``ts`` (Unix
seconds), ``event`` (name), ``attempt`` (worker-group launch counter, 0 = first launch) and
``generation`` (plan generation); the rest depends on the event. The names and fields are listed
in docs/launcher.md.

Status line: a whole line each time the status changes (dimmed with ``rich`` on a terminal),
never redrawn in place, which would glue it to the next line a worker writes to the same
terminal. Off a terminal (a log file, Slurm's output) a line is written when the state changes
in a way that matters to a person (the plan, the live devices, the restarts, what the agent is
doing, a hang timeout halved or doubled), and a figure that merely moves (seconds waited, a
stall's length, the hang timeout derived anew: 5.13 s, 6.01 s, 6.74 s) at most once a minute:
a log kept for days is read, not watched.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Event", "EventLog", "StatusLine", "agent_started", "ended_state", "layout",
           "name_devices", "recovery_line", "running_state"]


class Event(str, enum.Enum):
    """Event log record names (docs/launcher.md lists their fields)."""

    AGENT_STARTED = "agent_started"
    RENDEZVOUS = "rendezvous"
    RENDEZVOUS_FAILOVER = "rendezvous_failover"
    FAILURE_SEEN = "failure_seen"
    PLAN_CHOSEN = "plan_chosen"
    PLANNING_FAILED = "planning_failed"
    WORKERS_STARTED = "workers_started"
    RECOVERED = "recovered"
    MEMBERSHIP_CHANGE = "membership_change"
    SHARE_CHANGED = "share_changed"
    JOB_FINISHED = "job_finished"


class EventLog:
    """Append-only JSONL log; ``path=None`` keeps records in memory only (``records``).
    ``listeners`` see every record as it is emitted (the metrics, launcher/observation/metrics.py)."""

    def __init__(self, path: str | Path | None,
                 listeners: Iterable[Callable[[dict[str, Any]], None]] = ()) -> None:
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        self.listeners = tuple(listeners)
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": Event(event).value, **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        with self._lock:
            self.records.append(record)
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()
        for listener in self.listeners:
            listener(record)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


#: off a terminal, the least time between two lines that differ only in their figures
QUIET_S = 60.0
_FIGURE = re.compile(r"\d+(?:[.:]\d+)*")


class StatusLine:
    """``gen 2 | policy replan | live 3/4 | restarts 1/3 | running``, one whole line per change
    (off a terminal: per change that matters, see the module's docstring).

    Never a line redrawn in place: the workers share our terminal and write to it directly, so
    a line without its newline would be glued to the next worker line. On a terminal the line
    is dimmed (rich), elsewhere it is plain text.
    """

    def __init__(self, enabled: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.fields: dict[str, Any] = {}
        self._last = ""
        self._last_essence = ""
        self._last_hang: float | None = None
        self._last_at = -float("inf")
        self._clock = clock
        self._console = None
        self._tty = self.stream.isatty()
        if enabled and self._tty:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, soft_wrap=True)

    def essence(self) -> str:
        """The line as a person's reading of it changes: without the hang timeout, every
        figure of the state masked (``waiting for # more node ... (#:# so far)``), and whether
        a recovery phase's deadline is in force (not its figure)."""
        f = self.fields
        state = _FIGURE.sub("#", str(f.get("state", "")))
        return (f"{f.get('generation', 0)}|{f.get('policy')}|{f.get('live')}/"
                f"{f.get('devices')}|{f.get('restarts', 0)}/{f.get('max_restarts', 0)}|{state}|"
                f"{bool(f.get('deadline'))}")

    def render(self) -> str:
        f = self.fields
        parts = [f"chameleon-run gen {f.get('generation', 0)}"]
        if "policy" in f:
            parts.append(f"policy {f['policy']}")
        if "live" in f:
            parts.append(f"live {f['live']}/{f.get('devices', '?')}")
        parts.append(f"restarts {f.get('restarts', 0)}/{f.get('max_restarts', 0)}")
        if "hang" in f:
            parts.append(f"hang timeout {f['hang']}")
        if f.get("deadline"):   # e.g. "regroup deadline 25 s (...)": its phase and why
            parts.append(str(f["deadline"]))
        if "state" in f:
            parts.append(str(f["state"]))
        return " | ".join(parts)

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)
        if not self.enabled:
            return
        text, essence, now = self.render(), self.essence(), self._clock()
        if text == self._last:
            return
        hang = _seconds(self.fields.get("hang"))
        if (not self._tty and essence == self._last_essence and now - self._last_at < QUIET_S
                and not _moved_far(self._last_hang, hang)):
            return   # only a figure moved: said again within a minute at most
        self._last, self._last_essence, self._last_at = text, essence, now
        self._last_hang = hang
        self._write(f"[{text}]", "dim")

    def show(self, state: str, session: Any, attempt: int, restarts: int,
             max_restarts: int) -> None:
        """The agent's state, with the plan in force when there is a job."""
        fields: dict[str, Any] = {"restarts": restarts, "max_restarts": max_restarts,
                                  "state": state}
        if session is not None:
            plan = session.plan
            fields.update(generation=plan.generation, policy=plan.policy,
                          live=len(plan.live_devices), devices=session.devices)
        else:
            fields.update(generation=attempt)
        self.update(**fields)

    def say(self, text: str) -> None:
        """One line for people (a recovery, a fatal error), printed even with --no-status."""
        self._write(text, "bold")

    def _write(self, text: str, style: str) -> None:
        if self._console is not None:
            self._console.print(text, style=style, markup=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()


def _seconds(text: Any) -> float | None:
    """``5.13 s (auto)`` -> 5.13; ``off`` or nothing -> None."""
    found = _FIGURE.match(str(text or ""))
    return float(found.group()) if found else None


def _moved_far(was: float | None, now: float | None) -> bool:
    """A hang timeout that appeared, went, or was at least halved or doubled: a detector that
    convicts in 5 s instead of 60 s is news; 5.13 s becoming 6.01 s is not."""
    if was is None or now is None:
        return (was is None) != (now is None)
    return max(was, now) >= 2 * min(was, now)


def name_devices(ids: Sequence[int], tp: int = 1) -> str:
    """``device 2`` / ``devices 2, 1`` (in the order given); under tensor parallelism, plan
    devices are units: ``unit 1 (cards 2-3)``."""
    if tp == 1:
        return f"device{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
    return f"unit{'s' if len(ids) > 1 else ''} " + ", ".join(
        f"{u} (cards {u * tp}-{u * tp + tp - 1})" for u in ids)


def layout(plan: Any, tp: int = 1) -> str:
    """``2 pipelines: devices 2, 1 | device 0``: each pipeline's live devices in stage order, so
    the numbers read as device ids, never as stage counts. A rerouted plan keeps its lost
    devices in place, serving nothing: they are not named, and a pipeline left with none is
    not counted."""
    dead = set(plan.failed_devices)
    pipes = [name_devices(live, tp) for p in plan.pipelines
             if (live := [d for d in p.devices if d not in dead])]
    n = len(pipes)
    return f"{n} pipeline{'s' if n != 1 else ''}: {' | '.join(pipes)}"


def running_state(live: set[int], world: set[int], tp: int = 1) -> str:
    """The status line's state once a generation's workers run: ``live`` local cards with a
    worker, ``world`` the local cards in the generation's world. A card outside the world is a
    standby (runtime/recovery/standby.py): a node of standbys alone says so, or its user sees a node
    that seems to run and never prints a step."""
    waiting = sorted({c // tp for c in live - world})
    if not waiting:
        return "running"
    if not live & world:
        verb = "wait" if len(waiting) > 1 else "waits"
        return f"standby: {name_devices(waiting, tp)} {verb} warm for a lost device's place"
    return f"running, {name_devices(waiting, tp)} standby"


def ended_state(succeeded: Collection[int], finished_elsewhere: Callable[[], bool]) -> str:
    """The status line's last state of a node with no worker left: its workers (``succeeded``:
    their cards) finished the script, or the job finished on the other nodes while this node's
    standbys waited (they were not needed), or every device of this node was lost."""
    if succeeded:
        return "succeeded"
    if finished_elsewhere():
        return "succeeded on the other nodes (standby not needed)"
    return "no device left here"


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def recovery_line(what: str, plan: Any, *, inplace: bool, started: int, moved_layers: int,
                  moved_bytes: float, source: str, resumed_step: int | None, redone: int,
                  seconds: float | None, logs: str | None = None, tp: int = 1,
                  same_layout: bool = False, idle: bool = False, quiet: bool = False,
                  reported: int | None = None) -> str:
    """The one plain line a person reads per recovery, e.g. ``device 3 lost (SIGKILL) at step
    8; re-planned to 2 pipelines: devices 0, 1 | device 2; moved 3 layers from peers (1.2 MB to
    this node); resumed at step 8 in 0.41 s``. ``moved_layers`` counts the whole job's moves,
    ``moved_bytes`` what this node's workers received. ``logs``: where the workers' stderr went
    (the survivors' complaints about their lost peer are there, not on the console).
    ``same_layout``: no device was lost, back or slowed (a crash restarted on the plan in
    force), so nothing was re-planned: ``kept the plan (2 pipelines: ...)``. ``idle``: every
    device lost held no layers (spares), so nothing was rerouted or re-planned either; the
    world is formed again without it. ``quiet``: they were standbys, outside the training
    world, and the workers were not even told: there is no resumed step, only the last one
    ``reported`` before the loss."""
    if quiet:
        head = what if reported is None else f"{what} after step {reported}"
        return (f"{head}; standbys hold no layers and no worker waits on them: training goes "
                f"on undisturbed ({layout(plan, tp)})")
    parts = [what if resumed_step is None else f"{what} at step {resumed_step + redone}"]
    if same_layout and not idle:
        parts.append(f"kept the plan ({layout(plan, tp)})")
    elif idle:   # its world is formed again: a spare takes part in every step's vote
        parts.append(f"spares hold no layers: the layout kept ({layout(plan, tp)}), the "
                     "training world formed again without them (a spare votes in every step)")
    elif plan.policy == "reroute":
        peers = sorted({s.device for r in plan.reroute for s in r.peers})
        parts.append(f"rerouted to data-parallel peers: {name_devices(peers, tp)}")
    elif plan.policy == "swap":   # the standbys are the receivers: they held nothing
        standbys = sorted({t.dst for t in plan.transfers})
        parts.append(f"swapped in standby {name_devices(standbys, tp)}, the layout kept "
                     f"({layout(plan, tp)})")
    else:
        parts.append(f"re-planned to {layout(plan, tp)}")
    if not inplace:
        parts.append(f"relaunched {started} worker{'s' if started != 1 else ''}")
    elif started:
        parts.append(f"started {started} worker{'s' if started != 1 else ''} " + (
            "in place of the failed" if same_layout else "for returning devices"))
    if source == "peers":
        here = f"{_megabytes(moved_bytes)} to this node" if moved_bytes else "none to this node"
        parts.append(f"moved {moved_layers} layer{'s' if moved_layers != 1 else ''} from peers "
                     f"({here})")
    elif source == "snapshot" and resumed_step is not None:
        parts.append(f"restored from the in-memory snapshot of step {resumed_step}")
    elif source == "checkpoint" and resumed_step is not None:
        parts.append(f"restored from the checkpoint of step {resumed_step}")
    elif source == "init" and redone:
        parts.append("some layers exist nowhere now and there is no checkpoint yet: training "
                     "starts over")
    if redone and resumed_step is not None:
        last = resumed_step + redone - 1
        span = f"step {resumed_step}" if redone == 1 else f"steps {resumed_step}-{last}"
        parts.append(f"{span} will be trained again")
    if resumed_step is not None:
        tail = f"resumed at step {resumed_step}"
        parts.append(tail if seconds is None else f"{tail} in {seconds:.2f} s")
    if logs:
        parts.append(f"workers' stderr in {logs}")
    return "; ".join(parts)


def agent_started(spec: Any, session: Any, recovery: str) -> dict[str, Any]:
    """The ``agent_started`` event's fields: the entry point and sizes, and with a job its
    policy, recovery mode and plan file."""
    fields = {"entrypoint": spec.get_entrypoint_name(), "nproc_per_node": spec.local_world_size,
              "max_restarts": spec.max_restarts}
    if session is not None:
        fields.update(policy=session.policy, recovery=recovery, plan_file=session.plan_file)
    return fields
