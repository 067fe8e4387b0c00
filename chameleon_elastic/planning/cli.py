"""``chameleon-plan``: the planner on its own. What layout would this job run, and what would
happen if these devices failed? Same code path as the launcher, no processes, no torch.

With tensor parallelism (``training.tp > 1``) the planner plans units of ``tp`` cards
(``planning.units.unit_spec``) while a person names the cards that fail: ``--fail`` and
``--fail-count`` take card ids, a card's failure loses its whole unit, and the output names
units with their cards. With ``tp = 1`` a unit is a card and nothing of this shows."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

from ..console import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliParser, help_epilog, make_console
from ..plan import ExecutionPlan
from ..spec import (
    RECOVERY_MODES,
    JobSpec,
    SpecError,
    cards_of,
    load_job,
    preset_names,
    unit_of,
    units_of,
)
from . import snapshots
from .search import (
    Decision,
    PlanningError,
    PolicyChoice,
    check_event,
    compact_ids,
    decide,
    initial_plan,
    resolve_snapshots,
)
from .stragglers import decide_speeds
from .units import unit_spec

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["POLICY_HELP", "RequestError", "build_parser", "main", "parse_ids"]

#: One line per ``--policy`` value for --help; keyed by the planner's own ``PolicyChoice``
#: (a test checks that both name the same policies).
POLICY_HELP: dict[str, str] = {
    "auto": "keep whichever of reroute, re-plan and (with standby devices, beyond dp x pp) "
            "swap scores higher (default)",
    "reroute": "keep the layout; the peers of a lost device take over its micro-batches",
    "replan": "search a new pp x dp layout for the live devices and move the layers it needs",
}


class RequestError(ValueError):
    """The request cannot be planned because it is wrong (exit 2), as opposed to a
    :class:`PlanningError`, where the planner finds no plan for a sound request (exit 1)."""


#: Command lines for --help, each with what it shows; all run from the repository root (a
#: test runs every one).
EXAMPLES: tuple[tuple[str, str], ...] = (
    ("chameleon-plan --preset llama2-7b-910b", "the initial layout of the paper's 8 devices"),
    ("chameleon-plan --preset llama2-7b-910b --fail 3", "device 3 fails: reroute or re-plan?"),
    ("chameleon-plan --preset tiny-cpu --fail 1,3",
     "a stage loses every replica: re-plan, those layers from in-memory snapshots"),
    ("chameleon-plan --preset tiny-cpu --fail 1,3 --snapshot-every 0",
     "the same without snapshots: those layers from the checkpoint"),
    ("chameleon-plan --job chameleon_elastic/presets/tiny-cpu.toml --fail 1 --fail 2 --json",
     "two failures one after the other, as JSON"),
    ("chameleon-plan --preset llama2-7b-910b-32 --fail-count 4 --seed 1 --policy replan",
     "4 random devices fail, re-plan forced"),
    ("chameleon-plan --preset llama2-7b-910b-tp8 --fail 0",
     "tensor parallelism: card 0 fails and takes its 8-card unit with it"),
    ("chameleon-plan --preset tiny-cpu --slow 3=0.5",
     "device 3 runs at half speed: keep, reduce its work, or leave it spare?"),
)


def _epilog() -> str:
    """Built with the parser: presets and policies come from their registries, so the list
    cannot go stale."""
    return help_epilog(
        EXAMPLES, "policies (--policy NAME):",
        [(p, POLICY_HELP.get(p, "")) for p in get_args(PolicyChoice)],
        ["When a stage loses every replica, the re-plan takes those layers from the in-memory",
         "snapshot a live partner keeps (\"snapshot\" after the source in the transfers table;",
         "the steps since the last snapshot are priced as trained again), else from the",
         'checkpoint ("checkpoint" as the source); the failure\'s summary names them. The',
         "snapshots line gives the interval, who keeps whose copy and the host memory per",
         "node (cluster.devices_per_node, cluster.host_memory_bytes). Stages that recompute their activations in the backward (the job's",
         "planner.recompute) are listed per pipeline in the layout's recompute column, and as",
         "per-stage flags in the JSON's pipelines[].recompute. Tables are as wide as their",
         "cells when the output is not a terminal.",
         "",
         "With training.tp > 1 the planner's devices are units of tp cards on one node",
         "(unit u = cards u*tp .. u*tp+tp-1). --fail and --fail-count take CARD ids; a card's",
         "failure loses its whole unit. Tables name units with their cards, e.g. u0 (cards",
         "0-7); the JSON keeps the plan in unit ids and adds \"tp\", \"units\" (unit -> its",
         "cards) and each decision's \"failed_cards\"."],
        [(EXIT_OK, "success (a re-plan from the checkpoint included)"),
         (EXIT_FAILURE, "no plan: the model fits no layout, or the forced --policy is impossible"),
         (EXIT_USAGE, ("usage error (one line on stderr): unknown flag or preset, bad job file,\n"
                      "     a device (card) that does not exist or is not live, every live device "
                      "failing,\n     --fail-count too large"))])


def parse_ids(text: str) -> list[int]:
    """'3', '3,5', '4-7' or '1,4-6' -> sorted unique device ids."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                ids.update(range(lo, hi + 1))
            else:
                ids.add(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a device list; write ids and ranges like 3 or 1,4-6"
            ) from None
    return sorted(ids)


def parse_slow(text: str) -> tuple[int, float]:
    """'3=0.5' -> (device 3, speed factor 0.5)."""
    device, _, factor = text.partition("=")
    try:
        pair = int(device), float(factor)
    except ValueError:
        pair = None
    if pair is None or not (0 < pair[1] < float("inf")) or pair[0] < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not DEVICE=FACTOR; write a device id and its positive speed factor "
            "like 3=0.5 (half speed)"
        )
    return pair


def build_parser() -> CliParser:
    p = CliParser(
        prog="chameleon-plan",
        # Raw text (RawDescriptionHelpFormatter keeps the epilog's columns): wrapped by hand.
        description="Preview the Chameleon planner: the initial pipeline x data parallel layout "
                    "of a job\nand, for failures you name, whether it would reroute or re-plan, "
                    "with the estimated\nstep time, memory, transfers and score of each option.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = p.add_mutually_exclusive_group()
    job.add_argument("--job", metavar="FILE", help="job spec in TOML (model, cluster, training)")
    job.add_argument("--preset", metavar="NAME",
                     help=f"built-in job spec, one of: {', '.join(preset_names())}")
    p.add_argument("--fail", metavar="IDS", type=parse_ids, action="append", default=[],
                   help="devices (cards) that fail together in one event (e.g. 3 or 1,4-6); "
                        "repeat the flag for failures one after the other, each planned from the "
                        "last state; with training.tp > 1 a card's failure loses its whole unit")
    p.add_argument("--fail-count", metavar="K", type=int, default=0,
                   help="one more event in which K live devices (cards), drawn with --seed, fail")
    p.add_argument("--seed", type=int, default=0, help="seed for --fail-count (default 0)")
    p.add_argument("--slow", metavar="DEVICE=FACTOR", type=parse_slow, action="append",
                   default=[],
                   help="after the failures, this device (card) runs at FACTOR of its profiled "
                        "speed (0.5: half speed); repeat for several. The planner keeps the "
                        "layout, reduces the slow device's work, or leaves it spare, by score")
    p.add_argument("--policy", choices=get_args(PolicyChoice), default="auto",
                   help="auto (default) picks the higher score; reroute/replan force one")
    p.add_argument("--recovery", choices=RECOVERY_MODES, default=None,
                   help="how processes switch to a re-plan, overriding the job's "
                        "cluster.recovery: inplace (regroup, cluster.regroup_s) or relaunch "
                        "(restart, cluster.restart_s)")
    p.add_argument("--snapshot-every", metavar="K", type=int, default=None,
                   help="in-memory snapshots every K steps, overriding the job's [recovery] "
                        "snapshot_every (0: none; default: the job's, else the least K that "
                        "costs at most 2%% of the step time), as chameleon-run takes them")
    p.add_argument("--json", action="store_true",
                   help="print the final plan as JSON, with a 'decisions' list, instead of tables")
    return p


def _events(args: argparse.Namespace, job: JobSpec) -> list[list[int]]:
    """The failure events as card ids (device ids when ``tp = 1``). ``--fail-count`` draws from
    the cards still live after the ``--fail`` events: those of units no event has hit."""
    events = [list(ids) for ids in args.fail]
    if args.fail_count < 0:
        raise RequestError(f"--fail-count {args.fail_count} is negative; pass 0 or more.")
    if args.fail_count:
        tp = job.training.tp
        hit = set(units_of((c for e in events for c in e), tp))
        live = [c for c in range(job.cluster.devices) if unit_of(c, tp) not in hit]
        if args.fail_count >= len(live):
            what = "device" if tp == 1 else "card"
            raise RequestError(
                f"--fail-count {args.fail_count} would leave no live {what} of {len(live)}; "
                "pass a smaller count."
            )
        events.append(sorted(random.Random(args.seed).sample(live, args.fail_count)))
    return events


def _lost_units(job: JobSpec, plan: ExecutionPlan, cards: list[int]) -> list[int]:
    """The units an event's cards take down, for the planner. Cards that do not exist, or whose
    unit is gone already, are the request's fault (said in cards, which is what the person
    named); with ``tp = 1`` cards are the planner's devices and ``check_event`` says it."""
    tp = job.training.tp
    if tp == 1:
        return cards
    total = job.cluster.devices
    live = set(plan.live_devices)
    for card in cards:
        if not 0 <= card < total:
            raise RequestError(
                f"card {card} does not exist: the job has cards 0-{total - 1} (cluster.devices "
                f"= {total}); name a card in that range."
            )
        if unit_of(card, tp) not in live:
            live_cards = [c for u in sorted(live) for c in cards_of(u, tp)]
            raise RequestError(
                f"card {card} cannot fail: its unit {_unit_label(unit_of(card, tp), tp)} is not "
                f"live in plan generation {plan.generation} (live cards: "
                f"{compact_ids(live_cards)}); name a card of a live unit."
            )
    units = list(units_of(cards, tp))
    if set(units) >= live:
        raise RequestError(
            f"cards {compact_ids(sorted(set(cards)))} would take all {len(live)} live units; "
            "at least one unit must survive to continue."
        )
    return units


def _check_event(spec: JobSpec, plan: ExecutionPlan, failed: list[int]) -> None:
    """A failure the plan cannot have is the request's fault, not the planner's: said here,
    before the planner, so that exit 1 only ever means "no plan"."""
    try:
        check_event(spec, plan, failed, ())
    except PlanningError as exc:
        raise RequestError(str(exc)) from exc


def _decision_record(failed: list[int], d: Decision, cards: list[int] | None = None) -> dict:
    """One decision as plain data; ``failed`` in the planner's ids (units), ``cards`` (the
    ids the person named) only when tensor parallelism makes them differ."""
    return {
        "failed": failed,
        **({} if cards is None else {"failed_cards": sorted(set(cards))}),
        "chosen": d.chosen.policy,
        "generation": d.chosen.generation,
        "scores": {k: p.estimate.score for k, p in d.candidates.items()},
        "step_time_s": {k: p.estimate.step_time_s for k, p in d.candidates.items()},
        "transition_time_s": {k: p.estimate.transition_time_s for k, p in d.candidates.items()},
        "checkpoint_layers": list(d.chosen.checkpoint_layers),
        "snapshot_layers": list(d.chosen.snapshot_layers),
        "rejected": d.rejected,
    }


def run(args: argparse.Namespace) -> tuple[ExecutionPlan, JobSpec, list[dict]]:
    """The final plan after every failure event, the job as given (cards), and one record per
    decision. Plans are made on the unit view of the job, so they name units (devices when
    ``tp = 1``). Raises SpecError / RequestError for a wrong request, PlanningError when there
    is no plan."""
    job = load_job(args.job, args.preset).with_recovery(args.recovery)
    if args.snapshot_every is not None and args.snapshot_every < 0:
        raise RequestError(f"--snapshot-every {args.snapshot_every} is invalid; pass an "
                           "integer >= 0 (0: no snapshots).")
    job = resolve_snapshots(job.with_snapshot_every(args.snapshot_every))
    spec = unit_spec(job)
    tp = job.training.tp
    plan = initial_plan(spec)
    records = []
    for cards in _events(args, job):
        failed = _lost_units(job, plan, cards)
        _check_event(spec, plan, failed)
        decision = decide(spec, plan, failed, policy=args.policy)
        records.append(_decision_record(failed, decision, cards if tp > 1 else None))
        plan = decision.chosen
    if args.slow:
        speeds = _speeds(job, plan, args.slow)
        decision = decide_speeds(spec, plan, speeds, policy=args.policy)
        chosen = next(k for k, p in decision.candidates.items() if p is decision.chosen)
        records.append({**_decision_record([], decision), "failed": None, "chosen": chosen,
                        "slow": {str(d): f for d, f in sorted(speeds.items())}})
        plan = decision.chosen
    return plan, job, records


def _speeds(job: JobSpec, plan: ExecutionPlan, pairs: list[tuple[int, float]]
            ) -> dict[int, float]:
    """Speed factors per planner device (a card's factor is its unit's), checked live."""
    tp = job.training.tp
    out: dict[int, float] = {}
    for card, factor in pairs:
        unit = unit_of(card, tp)
        if unit not in plan.live_devices:
            raise RequestError(
                f"--slow {card}={factor:g}: {'device' if tp == 1 else 'card'} {card} is not live "
                f"in plan generation {plan.generation}; name a live one."
            )
        out[unit] = min(factor, out.get(unit, factor))
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _unit_label(unit: int, tp: int) -> str:
    """``u3 (cards 24-31)``: a unit as a person finds it on the cluster."""
    cards = cards_of(unit, tp)
    return f"u{unit} (cards {cards[0]}-{cards[-1]})"


@dataclass(frozen=True)
class _Names:
    """How the tables name the planner's devices: plain ids when a device is a card
    (``tp = 1``, the output as it always was), else units (``u3``), with their cards where a
    person must find them (``u3 (cards 24-31)``)."""

    tp: int

    @property
    def units(self) -> bool:
        return self.tp > 1

    def short(self, device: int | str) -> str:
        return f"u{device}" if self.units and isinstance(device, int) else str(device)

    def full(self, device: int) -> str:
        return _unit_label(device, self.tp) if self.units else str(device)


#: Transfers listed in the table; the rest are counted (``--json`` has them all).
MAX_TRANSFER_ROWS = 20


def _transfer_table(plan: ExecutionPlan, names: _Names) -> Table:
    """Who sends which layers to whom; ``checkpoint`` where no live device held them. Between
    units every card sends its own shard to its counterpart, so sizes are per card."""
    from rich.table import Table

    total = sum(t.bytes for t in plan.transfers)
    if names.units:
        title = (f"transfers: {len(plan.transfers)} unit links, {_gb(total)} per card in all "
                 f"(card i to card i, {names.tp} cards each)")
    else:
        title = f"transfers: {len(plan.transfers)} links, {_gb(total)} in all"
    table = Table(title=title)
    for col in ("source", "receiver", "layers", "size per card" if names.units else "size"):
        table.add_column(col)
    for t in plan.transfers[:MAX_TRANSFER_ROWS]:
        src = names.short(t.src) + (" (snapshot)" if t.snapshot else "")
        table.add_row(src, names.short(t.dst), compact_ids(t.layers), _gb(t.bytes))
    hidden = len(plan.transfers) - MAX_TRANSFER_ROWS
    if hidden > 0:
        table.caption = f"{hidden} more (--json lists them all)"
    return table


def _recomputing(flags: Sequence[bool]) -> str:
    """The stages that recompute, e.g. 'stages 0-1', or '-' when none does."""
    stages = [s for s, flag in enumerate(flags) if flag]
    if not stages:
        return "-"
    return f"stage{'s' if len(stages) > 1 else ''} {compact_ids(stages)}"


def _render(plan: ExecutionPlan, job: JobSpec, records: list[dict]) -> None:
    from rich.table import Table

    console = make_console()
    names = _Names(job.training.tp)
    est = plan.estimate
    live = len(plan.live_devices)
    if names.units:
        units = job.cluster.devices // names.tp
        alive = (f"{live}/{units} units of {names.tp} cards live "
                 f"({live * names.tp}/{job.cluster.devices} cards)")
    else:
        alive = f"{live}/{job.cluster.devices} devices live"
    console.print(f"[bold]{job.name}[/]: generation {plan.generation}, policy [bold]{plan.policy}"
                  f"[/], {alive}, "
                  f"{plan.global_micro_batches} micro-batches per step, "
                  f"recovery {job.cluster.recovery}, precision {job.training.precision}, "
                  f"recompute {job.planner.recompute}")
    table = Table(title="layout")
    for col in ("pipeline", f"{'units' if names.units else 'devices'} (stage order)",
                "layers per stage", "micro-batches", "recompute"):
        table.add_column(col)
    dead = set(plan.failed_devices)
    for i, p in enumerate(plan.pipelines):
        devs = " ".join(f"[red]x{names.full(d)}[/]" if d in dead else names.full(d)
                        for d in p.devices)
        layers = " ".join(f"[{a},{b})" for a, b in p.layers)
        table.add_row(str(i), devs, layers, str(p.micro_batches), _recomputing(p.recompute))
    console.print(table)
    if plan.spare_devices:
        console.print(f"spare {'units' if names.units else 'devices'}: "
                      f"{' '.join(map(names.full, plan.spare_devices))}")
    for r in plan.reroute:
        shares = ", ".join(f"{names.short(s.device)} takes {s.micro_batches}" for s in r.peers)
        console.print(f"rerouted: {'unit' if names.units else 'device'} {names.full(r.device)} "
                      f"(pipeline {r.pipeline}, stage {r.stage}): {shares}")
    if plan.transfers:
        console.print(_transfer_table(plan, names))
    console.print(_snapshot_line(plan, job))
    console.print(f"gradient all-reduce: {len(plan.allreduce_rounds)} round(s), "
                  f"{sum(len(r) for r in plan.allreduce_rounds)} group(s)")
    peak = max(est.peak_memory_bytes.values())
    console.print(
        f"estimate: step {est.step_time_s:.4f} s, throughput {est.throughput:.2f} samples/s, "
        f"transition {est.transition_time_s:.2f} s, peak memory {_gb(peak)} of "
        f"{_gb(job.cluster.device_memory_bytes)}{' per card' if names.units else ''}, "
        f"score {est.score:.3f}"
    )
    for rec in records:
        scores = ", ".join(f"{k} {v:.3f}" for k, v in rec["scores"].items())
        what = (f"failure of {_failed_label(rec, names)}" if rec["failed"] is not None else
                "slow " + ", ".join(f"{names.full(int(d))} at {f:g}x"
                                    for d, f in rec["slow"].items()))
        line = f"{what}: chose [bold]{rec['chosen']}[/] (scores: {scores})"
        other = [k for k in rec["scores"] if k != rec["chosen"]]
        for k in other:
            line += (f"; {rec['chosen']} step {rec['step_time_s'][rec['chosen']]:.4f} s + "
                     f"{rec['transition_time_s'][rec['chosen']]:.2f} s transition vs {k} step "
                     f"{rec['step_time_s'][k]:.4f} s + {rec['transition_time_s'][k]:.2f} s")
        if rec["snapshot_layers"]:
            line += (f"; every replica of layers {compact_ids(rec['snapshot_layers'])} was "
                     "lost: they come from in-memory snapshots (the steps since the last one "
                     "are trained again)")
        if rec["checkpoint_layers"]:
            line += (f"; every replica of layers {compact_ids(rec['checkpoint_layers'])} was "
                     "lost: they come from the checkpoint")
        for k, why in rec["rejected"].items():
            line += f"; {k} impossible: {why}"
        console.print(line)


def _snapshot_line(plan: ExecutionPlan, job: JobSpec) -> str:
    """``snapshots: every 4 steps, kept by 0->2 1->3 2->0 3->1; host memory per node: ...``"""
    every = snapshots.every(job)
    if not every:
        why = snapshots.why_none(job) or "snapshot_every = 0"
        return f"snapshots: none ({why})"
    spec = unit_spec(job)
    pairs = snapshots.partners(plan, spec.cluster.devices_per_node)
    kept = " ".join(f"{d}->{p}" for d, p in sorted(pairs.items())) or "nobody (replicas only)"
    limit = job.cluster.host_memory_bytes
    per_node = ", ".join(f"node {n} {_gb(b)}" for n, b in
                         sorted(snapshots.host_bytes(spec, plan).items()))
    return (f"snapshots: every {every} steps, copies kept by {kept}; host memory per node: "
            f"{per_node}" + ("" if limit is None else f" of {_gb(limit)}"))


def _failed_label(record: dict, names: _Names) -> str:
    """``[1, 3]`` (devices), or with units: the cards named and the units they took down."""
    if not names.units:
        return str(record["failed"])
    cards, units = record["failed_cards"], record["failed"]
    return (f"card{'s' if len(cards) > 1 else ''} {compact_ids(cards)}, which lost "
            f"unit{'s' if len(units) > 1 else ''} {', '.join(map(names.full, units))}")


def _to_json(plan: ExecutionPlan, job: JobSpec, records: list[dict]) -> dict:
    """The plan (in the planner's ids) and the decisions; with units, also ``tp`` and which
    cards each unit is, so that a reader can map every id back to cards."""
    out = plan.to_dict()
    tp = job.training.tp
    if tp > 1:
        out["tp"] = tp
        out["units"] = {str(u): list(cards_of(u, tp)) for u in range(job.cluster.devices // tp)}
    every = snapshots.every(job)
    spec = unit_spec(job)
    out["snapshots"] = {
        "every": every,
        "partners": {str(d): p for d, p in sorted(
            (snapshots.partners(plan, spec.cluster.devices_per_node) if every else {}).items())},
        "host_bytes_per_node": {str(n): b for n, b in sorted(
            snapshots.host_bytes(spec, plan).items())},
        "host_memory_bytes": job.cluster.host_memory_bytes,
    }
    out["decisions"] = records
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan, spec, records = run(args)
    except (SpecError, RequestError) as exc:
        parser.error(str(exc))
    except PlanningError as exc:
        return parser.failure(str(exc))
    if args.json:
        json.dump(_to_json(plan, spec, records), sys.stdout, indent=2)
        print()
    else:
        _render(plan, spec, records)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
