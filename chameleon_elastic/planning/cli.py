"""``chameleon-plan``: the planner on its own. What layout would this job run, and what would
happen if these devices failed? Same code path as the launcher, no processes, no torch."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

from ..console import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliParser, help_epilog, make_console
from ..plan import ExecutionPlan
from ..spec import RECOVERY_MODES, JobSpec, SpecError, load_job, preset_names
from .search import (
    Decision,
    PlanningError,
    PolicyChoice,
    check_event,
    compact_ids,
    decide,
    initial_plan,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["POLICY_HELP", "RequestError", "build_parser", "main", "parse_ids"]

#: One line per ``--policy`` value for --help; keyed by the planner's own ``PolicyChoice``
#: (a test checks that both name the same policies).
POLICY_HELP: dict[str, str] = {
    "auto": "keep whichever of reroute and re-plan scores higher (default)",
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
     "a stage loses every replica: re-plan, those layers from the checkpoint"),
    ("chameleon-plan --job chameleon_elastic/presets/tiny-cpu.toml --fail 1 --fail 2 --json",
     "two failures one after the other, as JSON"),
    ("chameleon-plan --preset llama2-7b-910b-32 --fail-count 4 --seed 1 --policy replan",
     "4 random devices fail, re-plan forced"),
)


def _epilog() -> str:
    """Built with the parser: presets and policies come from their registries, so the list
    cannot go stale."""
    return help_epilog(
        EXAMPLES, "policies (--policy NAME):",
        [(p, POLICY_HELP.get(p, "")) for p in get_args(PolicyChoice)],
        ["When a stage loses every replica, the re-plan loads those layers from the checkpoint:",
         'the transfers table shows "checkpoint" as their source, and the failure\'s summary',
         "names them. Stages that recompute their activations in the backward (the job's",
         "planner.recompute) are listed per pipeline in the layout's recompute column, and as",
         "per-stage flags in the JSON's pipelines[].recompute. Tables are as wide as their",
         "cells when the output is not a terminal."],
        [(EXIT_OK, "success (a re-plan from the checkpoint included)"),
         (EXIT_FAILURE, "no plan: the model fits no layout, or the forced --policy is impossible"),
         (EXIT_USAGE, ("usage error (one line on stderr): unknown flag or preset, bad job file,\n"
                      "     a device that is not live, every live device failing, --fail-count "
                      "too large"))])


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
                   help="devices that fail together in one event (e.g. 3 or 1,4-6); repeat the "
                        "flag for failures one after the other, each planned from the last state")
    p.add_argument("--fail-count", metavar="K", type=int, default=0,
                   help="one more event in which K live devices, drawn with --seed, fail")
    p.add_argument("--seed", type=int, default=0, help="seed for --fail-count (default 0)")
    p.add_argument("--policy", choices=get_args(PolicyChoice), default="auto",
                   help="auto (default) picks the higher score; reroute/replan force one")
    p.add_argument("--recovery", choices=RECOVERY_MODES, default=None,
                   help="how processes switch to a re-plan, overriding the job's "
                        "cluster.recovery: inplace (regroup, cluster.regroup_s) or relaunch "
                        "(restart, cluster.restart_s)")
    p.add_argument("--json", action="store_true",
                   help="print the final plan as JSON, with a 'decisions' list, instead of tables")
    return p


def _events(args: argparse.Namespace, spec: JobSpec) -> list[list[int]]:
    events = [list(ids) for ids in args.fail]
    if args.fail_count < 0:
        raise RequestError(f"--fail-count {args.fail_count} is negative; pass 0 or more.")
    if args.fail_count:
        dead = {d for e in events for d in e}
        live = [d for d in range(spec.cluster.devices) if d not in dead]
        if args.fail_count >= len(live):
            raise RequestError(
                f"--fail-count {args.fail_count} would leave no live device of {len(live)}; "
                "pass a smaller count."
            )
        events.append(sorted(random.Random(args.seed).sample(live, args.fail_count)))
    return events


def _check_event(spec: JobSpec, plan: ExecutionPlan, failed: list[int]) -> None:
    """A failure the plan cannot have is the request's fault, not the planner's: said here,
    before the planner, so that exit 1 only ever means "no plan"."""
    try:
        check_event(spec, plan, failed, ())
    except PlanningError as exc:
        raise RequestError(str(exc)) from exc


def _decision_record(failed: list[int], d: Decision) -> dict:
    return {
        "failed": failed,
        "chosen": d.chosen.policy,
        "generation": d.chosen.generation,
        "scores": {k: p.estimate.score for k, p in d.candidates.items()},
        "step_time_s": {k: p.estimate.step_time_s for k, p in d.candidates.items()},
        "transition_time_s": {k: p.estimate.transition_time_s for k, p in d.candidates.items()},
        "checkpoint_layers": list(d.chosen.checkpoint_layers),
        "rejected": d.rejected,
    }


def run(args: argparse.Namespace) -> tuple[ExecutionPlan, JobSpec, list[dict]]:
    """The final plan after every failure event, the spec, and one record per decision.
    Raises SpecError / RequestError for a wrong request, PlanningError when there is no plan."""
    spec = load_job(args.job, args.preset).with_recovery(args.recovery)
    plan = initial_plan(spec)
    records = []
    for failed in _events(args, spec):
        _check_event(spec, plan, failed)
        decision = decide(spec, plan, failed, policy=args.policy)
        records.append(_decision_record(failed, decision))
        plan = decision.chosen
    return plan, spec, records


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


#: Transfers listed in the table; the rest are counted (``--json`` has them all).
MAX_TRANSFER_ROWS = 20


def _transfer_table(plan: ExecutionPlan) -> Table:
    """Who sends which layers to whom; ``checkpoint`` where no live device held them."""
    from rich.table import Table

    total = sum(t.bytes for t in plan.transfers)
    table = Table(title=f"transfers: {len(plan.transfers)} links, {_gb(total)} in all")
    for col in ("source", "receiver", "layers", "size"):
        table.add_column(col)
    for t in plan.transfers[:MAX_TRANSFER_ROWS]:
        table.add_row(str(t.src), str(t.dst), compact_ids(t.layers), _gb(t.bytes))
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


def _render(plan: ExecutionPlan, spec: JobSpec, records: list[dict]) -> None:
    from rich.table import Table

    console = make_console()
    est = plan.estimate
    live = len(plan.live_devices)
    console.print(f"[bold]{spec.name}[/]: generation {plan.generation}, policy [bold]{plan.policy}"
                  f"[/], {live}/{spec.cluster.devices} devices live, "
                  f"{plan.global_micro_batches} micro-batches per step, "
                  f"recovery {spec.cluster.recovery}, precision {spec.training.precision}, "
                  f"recompute {spec.planner.recompute}")
    table = Table(title="layout")
    for col in ("pipeline", "devices (stage order)", "layers per stage", "micro-batches",
                "recompute"):
        table.add_column(col)
    dead = set(plan.failed_devices)
    for i, p in enumerate(plan.pipelines):
        devs = " ".join(f"[red]x{d}[/]" if d in dead else str(d) for d in p.devices)
        layers = " ".join(f"[{a},{b})" for a, b in p.layers)
        table.add_row(str(i), devs, layers, str(p.micro_batches), _recomputing(p.recompute))
    console.print(table)
    if plan.spare_devices:
        console.print(f"spare devices: {' '.join(map(str, plan.spare_devices))}")
    for r in plan.reroute:
        shares = ", ".join(f"{s.device} takes {s.micro_batches}" for s in r.peers)
        console.print(f"rerouted: device {r.device} (pipeline {r.pipeline}, stage {r.stage}): "
                      f"{shares}")
    if plan.transfers:
        console.print(_transfer_table(plan))
    console.print(f"gradient all-reduce: {len(plan.allreduce_rounds)} round(s), "
                  f"{sum(len(r) for r in plan.allreduce_rounds)} group(s)")
    peak = max(est.peak_memory_bytes.values())
    console.print(
        f"estimate: step {est.step_time_s:.4f} s, throughput {est.throughput:.2f} samples/s, "
        f"transition {est.transition_time_s:.2f} s, peak memory {_gb(peak)} of "
        f"{_gb(spec.cluster.device_memory_bytes)}, score {est.score:.3f}"
    )
    for rec in records:
        scores = ", ".join(f"{k} {v:.3f}" for k, v in rec["scores"].items())
        line = f"failure of {rec['failed']}: chose [bold]{rec['chosen']}[/] (scores: {scores})"
        other = [k for k in rec["scores"] if k != rec["chosen"]]
        for k in other:
            line += (f"; {rec['chosen']} step {rec['step_time_s'][rec['chosen']]:.4f} s + "
                     f"{rec['transition_time_s'][rec['chosen']]:.2f} s transition vs {k} step "
                     f"{rec['step_time_s'][k]:.4f} s + {rec['transition_time_s'][k]:.2f} s")
        if rec["checkpoint_layers"]:
            line += (f"; every replica of layers {compact_ids(rec['checkpoint_layers'])} was "
                     "lost: they come from the checkpoint")
        for k, why in rec["rejected"].items():
            line += f"; {k} impossible: {why}"
        console.print(line)


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
        out = plan.to_dict()
        out["decisions"] = records
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        _render(plan, spec, records)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
