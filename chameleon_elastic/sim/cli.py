"""``chameleon-sim``: replay failure traces against several policies and compare them.

    chameleon-sim --preset llama2-7b-910b-32 --hours 9 --failure-rate 0.1 --seeds 20 \\
                  --policies chameleon,oobleck,recycle --out sim-out [--json]

Goodput at 16,384 GPUs, ours beside torchft-like, NVRx-like and checkpoint-restart (docs/sim.md):

    chameleon-sim --scenario goodput-16k --out sim-goodput

One trace per seed (``--trace-model poisson|hourly``, optional ``--mttr-s`` repairs), or one
given trace (``--trace FILE.csv``). Every policy replays every trace. Prints a summary table
(or, with ``--json``, a JSON document on stdout); with ``--out`` also writes summary.json,
runs.csv, the traces as CSV, throughput.png, relative.png and devices.png. Usage errors
exit 2 with one line and no traceback; a job the planner cannot start, or an ``--out`` that
cannot be written, exits 1; nothing is written to ``--out`` unless the whole run succeeded.

With tensor parallelism (``training.tp > 1``) every policy runs on the unit view of the job
(``planning.units.unit_spec``): devices are units of ``tp`` cards, and a unit fails at ``tp``
times the per-card rate. ``--failure-rate`` stays per card; a ``--trace`` file names cards and
is mapped to units; the traces written to ``--out`` name cards too (each unit event as its
first card's), so they replay to the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..console import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliParser, help_epilog, make_console
from ..planning.units import unit_spec
from ..spec import RECOVERY_MODES, JobSpec, SpecError, load_job, preset_names
from .constants import REROUTE_TIMINGS, BaselineConstants
from .experiment import ExperimentResult, run_experiment
from .policies import POLICY_NAMES, parse_policies
from .scenarios import SCENARIOS, scenario_lines
from .traces import (
    TRACE_MODELS,
    FailureTrace,
    TraceError,
    cards_to_units,
    generate_trace,
    read_trace,
    units_to_cards,
    write_trace,
)

__all__ = ["DEFAULT_POLICIES", "EXAMPLES", "POLICY_HELP", "build_parser", "main"]

DEFAULT_POLICIES = "chameleon,oobleck,recycle"

#: One line per simulated policy for --help, keyed by the simulator's registry
#: (``POLICY_NAMES``; a test checks that both name the same policies).
POLICY_HELP: dict[str, str] = {
    "chameleon": "the launcher's planner: reroute or re-plan, whichever scores higher",
    "hybrid": "reroute at once, stage the re-plan in the background, then switch",
    "oobleck": "Oobleck-like: pipeline templates re-instantiated on the live devices",
    "recycle": "ReCycle-like: peers take a lost device's micro-batches; restart if a stage dies",
    "checkpoint": "torchrun-like: synchronous checkpoints, every failure restarts from the last",
    "torchft": "torchft-like: a lost device's replica group leaves the quorum, heals, rejoins",
    "nvrx": "NVRx-like: every rank restarts in process onto hot spares, reloads the checkpoint",
}

#: Command lines for --help, each with what it shows; all run from the repository root in a
#: few seconds (a test runs every one).
EXAMPLES: tuple[tuple[str, str], ...] = (
    ("chameleon-sim --preset llama2-7b-910b --hours 2 --seeds 4",
     "the default policies on the paper's 8 devices"),
    ("chameleon-sim --preset llama2-7b-910b-32 --seeds 5 --out sim-out",
     "the paper's simulation (9 h, 0.1/device-hour); plus summary.json, runs.csv, plots"),
    ("chameleon-sim --preset tiny-cpu --hours 1 --trace-model hourly --mttr-s 600 --json",
     "hourly failures with repairs, JSON on stdout"),
    ("chameleon-sim --preset llama2-7b-910b-tp8 --hours 1 --seeds 4",
     "tensor parallelism: 32 cards as 4 units of 8, a unit lost with any of its cards"),
    ("chameleon-sim --scenario goodput-16k --seeds 2 --hours 6",
     "goodput at 16,384 GPUs (MTTF 1.8 h): ours, torchft-like, NVRx-like, checkpoint-restart"),
)


def _epilog() -> str:
    """Built with the parser: presets and policies come from their registries, so the list
    cannot go stale."""
    return help_epilog(
        EXAMPLES, f"policies (--policies NAME,...; default {DEFAULT_POLICIES}):",
        [(n, POLICY_HELP.get(n, "")) for n in POLICY_NAMES],
        ["scenarios (--scenario NAME; explicit flags win over what it sets):",
         *scenario_lines(),
         "",
         "Goodput (--goodput) = net samples / what the fault-free job trains in the same time;",
         "the table splits the rest into paused, redone (lost work) and slowed (docs/sim.md).",
         "",
         "Tables are as wide as their cells when the output is not a terminal.",
         "",
         "With training.tp > 1 every policy plans and runs units of tp cards (unit u = cards",
         "u*tp .. u*tp+tp-1): a unit fails at tp x the per-card --failure-rate, and working",
         "devices, failures and decisions count units. A --trace file names CARDS (a unit is",
         "down while any of its cards is); traces written to --out name cards too."],
        [(EXIT_OK, "success"),
         (EXIT_FAILURE, ("the planner cannot start the job (nothing fits), or --out is not "
                        "writable")),
         (EXIT_USAGE, ("usage error (one line on stderr): unknown flag, preset or policy, a bad\n"
                      "     number, an unreadable job or trace file, a trace for another number "
                      "of devices"))])


def build_parser() -> CliParser:
    p = CliParser(
        prog="chameleon-sim",
        description="Event-driven failure simulator: every policy replays the same traces and "
                    "is timed by\nthe planner's estimator.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = p.add_argument_group("job")
    job.add_argument("--job", metavar="FILE", help="job spec TOML")
    job.add_argument("--preset", metavar="NAME",
                     help=f"built-in job spec: {', '.join(preset_names())}")
    job.add_argument("--scenario", choices=tuple(SCENARIOS), default=None,
                     help="a named experiment: fills in --preset, --hours, --seeds and "
                          "--policies where not given, and turns on --goodput (list below)")
    tr = p.add_argument_group("failures")
    tr.add_argument("--hours", type=float, default=None,
                    help="simulated hours (default 9, the --scenario's, or the --trace file's "
                         "horizon)")
    tr.add_argument("--failure-rate", type=float, default=None, metavar="PER_DEVICE_HOUR",
                    help="failures per device (card) per hour (default: the job's "
                         "cluster.failure_rate_per_hour); also what the planner assumes")
    tr.add_argument("--seeds", type=int, default=None,
                    help="number of traces (default 20, or the --scenario's)")
    tr.add_argument("--seed-base", type=int, default=0, help="first seed (default 0)")
    tr.add_argument("--trace-model", choices=TRACE_MODELS, default="poisson",
                    help="poisson: exponential time to failure; hourly: Bamboo/Oobleck "
                         "per-hour Bernoulli at a uniform time (default poisson)")
    tr.add_argument("--mttr-s", type=float, default=None, metavar="S",
                    help="mean time to repair; failed devices rejoin (default: never)")
    tr.add_argument("--trace", metavar="FILE",
                    help="replay this CSV trace instead (time_s,device,event; devices are "
                         "cards, mapped to units when training.tp > 1)")
    pol = p.add_argument_group("policies")
    pol.add_argument("--policies", default=None,
                     help=f"comma-separated, from {', '.join(POLICY_NAMES)} "
                          f"(default {DEFAULT_POLICIES}, or the --scenario's)")
    pol.add_argument("--dp-radius", type=int, default=None,
                     help="override the job's planner.dp_radius (the paper's R_dp)")
    pol.add_argument("--pp-radius", type=int, default=None,
                     help="override the job's planner.pp_radius (the paper's R_pp)")
    pol.add_argument("--no-templates", action="store_true",
                     help="search only the paper's R_dp x R_pp window (planner.templates = "
                          "false): no pipeline-length templates")
    pol.add_argument("--recovery", choices=RECOVERY_MODES, default=None,
                     help="how chameleon switches to a re-plan, overriding the job's "
                          "cluster.recovery: inplace (pause cluster.regroup_s) or relaunch "
                          "(pause cluster.restart_s); checkpoint restarts and Oobleck always "
                          "pay cluster.restart_s")
    pol.add_argument("--checkpoint-interval-s", type=float, default=None,
                     help="checkpoint interval (default: Young's optimum)")
    pol.add_argument("--storage-bandwidth", type=float, default=2e9, metavar="BYTES_PER_S",
                     help="checkpoint write/read rate per device (default 2e9)")
    pol.add_argument("--oobleck-reconfigure-s", type=float, default=None,
                     help="Oobleck's fixed reconfiguration cost (default cluster.restart_s)")
    pol.add_argument("--reroute-timing", choices=REROUTE_TIMINGS, default="closed-form",
                     help="how a rerouted layout's step is timed while it runs: the paper's "
                          "closed form (default) or the simulated executed schedule")
    pol.add_argument("--torchft-failure-s", type=float, default=5.11, metavar="S",
                     help="torchft-like: what survivors lose at a group's loss (default 5.11, "
                          "measured with torchft's default timeouts; 1.18 with 1 s timeouts)")
    pol.add_argument("--nvrx-restart-s", type=float, default=1.5, metavar="S",
                     help="NVRx-like: in-process restart of every rank, the re-run iteration "
                          "and the checkpoint load aside (default 1.5, its docs at 16k ranks)")
    pol.add_argument("--hybrid-interference", type=float, default=0.0,
                     help="throughput fraction lost while hybrid stages transfers (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write summary.json, runs.csv, traces, plots")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--goodput", action="store_true",
                     help="also print the goodput table (and write goodput.png with --out)")
    out.add_argument("--bins", type=int, default=108, help="time bins in the plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--jobs", type=int, default=0, metavar="N",
                     help="replay policies x seeds in N worker processes (default 0: one per "
                          "CPU core; 1: in this process)")
    return p


def _traces(args: argparse.Namespace, job: JobSpec) -> list[tuple[int, FailureTrace]]:
    """The traces every policy replays, in the planner's devices: units of ``training.tp``
    cards. A ``--trace`` file names cards and is mapped to units; generated traces are drawn
    on the units directly, at the unit view's failure rate (tp x the card rate)."""
    tp = job.training.tp
    spec = unit_spec(job)
    if args.trace is not None:
        horizon = None if args.hours is None else args.hours * 3600.0
        trace = read_trace(args.trace, devices=job.cluster.devices, horizon_s=horizon)
        return [(args.seed_base, cards_to_units(trace, tp))]
    hours = 9.0 if args.hours is None else args.hours
    rate = spec.cluster.failure_rate_per_hour
    return [
        (seed, generate_trace(args.trace_model, spec.cluster.devices, rate, hours, seed,
                              args.mttr_s))
        for seed in range(args.seed_base, args.seed_base + args.seeds)
    ]


def _apply_scenario(args: argparse.Namespace) -> None:
    """Fill in what ``--scenario`` sets and the command line left out, then the defaults."""
    scenario = SCENARIOS.get(args.scenario) if args.scenario else None
    if scenario is not None:
        if args.job is None and args.preset is None:
            args.preset = scenario.preset
        if args.hours is None and args.trace is None:
            args.hours = scenario.hours
        args.seeds = scenario.seeds if args.seeds is None else args.seeds
        args.policies = scenario.policies if args.policies is None else args.policies
        args.goodput = True
    args.seeds = 20 if args.seeds is None else args.seeds
    args.policies = DEFAULT_POLICIES if args.policies is None else args.policies


def _check(args: argparse.Namespace, parser: CliParser) -> None:
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} is invalid; pass at least 1.")
    if args.bins < 1:
        parser.error(f"--bins {args.bins} is invalid; pass at least 1.")
    if args.jobs < 0:
        parser.error(f"--jobs {args.jobs} is invalid; pass 0 (one per core) or more.")
    if args.failure_rate is not None and not (args.failure_rate >= 0
                                              and math.isfinite(args.failure_rate)):
        parser.error(f"--failure-rate {args.failure_rate} is invalid; pass a number >= 0 "
                     "(0.1 means 10% per device per hour).")
    if args.hours is not None and not (args.hours > 0 and math.isfinite(args.hours)):
        parser.error(f"--hours {args.hours} is invalid; pass a positive number.")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} exists and is not a directory; pass a directory path.")


def _write_outputs(result: ExperimentResult, traces: Sequence[tuple[int, FailureTrace]],
                   doc_setting: dict, out_dir: Path, bins: int, tp: int = 1,
                   goodput: bool = False) -> dict:
    """Everything into a temporary folder first, then moved in: no half-written output.
    Traces are written in cards (``tp > 1``: each unit event as its first card's), the form
    ``--trace`` reads."""
    from .plots import plot_experiment
    from .report import runs_csv, to_json_dict

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".chameleon-sim-", dir=out_dir.parent))
    try:
        (tmp / "traces").mkdir()
        for seed, trace in traces:
            write_trace(units_to_cards(trace, tp), tmp / "traces" / f"seed-{seed}.csv")
        plot_experiment(result, tmp, bins, tp=tp)
        (tmp / "runs.csv").write_text(runs_csv(result))
        names = ["summary.json", "runs.csv", "throughput.png", "relative.png", "devices.png",
                 "traces"]
        if goodput:
            from .goodput import plot_goodput

            plot_goodput(result, tmp / "goodput.png")
            names.append("goodput.png")
        files = {n: str(out_dir / n) for n in names}
        doc = to_json_dict(result, doc_setting, files)
        (tmp / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for n in names:
            target = out_dir / n
            if target.is_dir():
                shutil.rmtree(target)
            (tmp / n).replace(target)
        return doc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _apply_scenario(args)
    _check(args, parser)
    try:
        # The job as given (cards) first, overrides included; the policies then run on its
        # unit view (itself when training.tp = 1).
        job = _job(args, parser)
        spec = unit_spec(job)
        policies = parse_policies(args.policies)
        constants = _constants(args)
        traces = _traces(args, job)
    except (SpecError, TraceError, ValueError) as exc:
        parser.error(str(exc))
    jobs = args.jobs or len(os.sched_getaffinity(0))
    from ..planning.search import PlanningError

    try:
        result = _run(spec, traces, policies, constants, progress=not args.no_progress,
                      jobs=jobs)
    except PlanningError as exc:
        return parser.failure(f"the job cannot start: {exc}")
    except ValueError as exc:  # a trace for another number of devices
        parser.error(str(exc))
    setting = _setting(args, job, spec, traces, constants)
    return _report(args, parser, result, traces, setting, job.training.tp)


def _job(args: argparse.Namespace, parser: CliParser) -> JobSpec:
    """The job as given, in cards, with the command line's overrides (recovery, failure rate,
    planner radii and templates) applied: the one spec the setting and the traces describe.
    Raises SpecError for a job that cannot be loaded; a negative radius is a usage error."""
    spec = load_job(args.job, args.preset).with_recovery(args.recovery)
    if args.failure_rate is not None:
        spec = replace(spec, cluster=replace(spec.cluster,
                                             failure_rate_per_hour=args.failure_rate))
    for flag, value in (("--dp-radius", args.dp_radius), ("--pp-radius", args.pp_radius)):
        if value is not None and value < 0:
            parser.error(f"{flag} {value} is invalid; pass an integer >= 0.")
    planner = spec.planner
    if args.dp_radius is not None:
        planner = replace(planner, dp_radius=args.dp_radius)
    if args.pp_radius is not None:
        planner = replace(planner, pp_radius=args.pp_radius)
    if args.no_templates:
        planner = replace(planner, templates=False)
    return replace(spec, planner=planner)


def _constants(args: argparse.Namespace) -> BaselineConstants:
    """The baselines' figures the command line sets (checkpointing, Oobleck, hybrid, reroute
    timing): kept apart from the job, which every policy shares."""
    return BaselineConstants(
        storage_bandwidth_bytes_per_s=args.storage_bandwidth,
        checkpoint_interval_s=args.checkpoint_interval_s,
        oobleck_reconfigure_s=args.oobleck_reconfigure_s,
        hybrid_interference=args.hybrid_interference,
        reroute_timing=args.reroute_timing,
        torchft_failure_s=args.torchft_failure_s,
        nvrx_restart_s=args.nvrx_restart_s,
    )


def _setting(args: argparse.Namespace, job: JobSpec, spec: JobSpec,
             traces: Sequence[tuple[int, FailureTrace]], constants: BaselineConstants) -> dict:
    """The JSON document's ``setting``: everything needed to rerun the experiment and read
    its numbers. ``job`` counts cards, ``spec`` is its unit view (the planner's devices)."""
    return {
        "devices": job.cluster.devices,
        **_unit_setting(job, spec),
        "hours": traces[0][1].horizon_s / 3600.0,
        "failure_rate_per_hour": job.cluster.failure_rate_per_hour,
        "trace_model": "file" if args.trace else args.trace_model,
        "mttr_s": args.mttr_s,
        "mean_failures": sum(t.failures for _, t in traces) / len(traces),
        "planner": {"dp_radius": spec.planner.dp_radius, "pp_radius": spec.planner.pp_radius,
                    "templates": spec.planner.templates},
        "constants": {
            "storage_bandwidth_bytes_per_s": constants.storage_bandwidth_bytes_per_s,
            "checkpoint_interval_s": constants.checkpoint_interval_s,
            "oobleck_reconfigure_s": constants.reconfigure_s(spec),
            "restart_s": spec.cluster.restart_s,
            "recovery": spec.cluster.recovery,
            "switch_s": spec.cluster.switch_s,
            "hybrid_interference": constants.hybrid_interference,
            "reroute_timing": constants.reroute_timing,
            "torchft_failure_s": constants.torchft_failure_s,
            "torchft_join_s": constants.torchft_join_s,
            "torchft_restart_s": constants.torchft_restart_s,
            "torchft_heal_bandwidth_bytes_per_s": constants.torchft_heal_bandwidth_bytes_per_s,
            "nvrx_restart_s": constants.nvrx_restart_s,
        },
    }


def _report(args: argparse.Namespace, parser: CliParser, result: ExperimentResult,
            traces: Sequence[tuple[int, FailureTrace]], setting: dict, tp: int) -> int:
    """Write ``--out`` (whole or not at all), then print the JSON document or the table.
    Returns the exit status: a failure when ``--out`` cannot be written, before any print."""
    from .report import summary_table, to_json_dict

    if args.out is not None:
        try:
            doc = _write_outputs(result, traces, setting, Path(args.out), args.bins, tp,
                                 args.goodput)
        except OSError as exc:
            return parser.failure(f"cannot write --out {args.out}: {exc}; pass a writable "
                                  "directory.")
    else:
        doc = to_json_dict(result, setting)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        console = make_console()
        console.print(summary_table(result, tp=tp))
        if args.goodput:
            from .goodput import goodput_table

            console.print(goodput_table(result))
        if args.out is not None:
            extra = ", goodput.png" if args.goodput else ""
            console.print(f"wrote {args.out}/summary.json, runs.csv, throughput.png, "
                          f"relative.png, devices.png{extra}, traces/", markup=False,
                          highlight=False)
    return EXIT_OK


def _unit_setting(job: JobSpec, spec: JobSpec) -> dict:
    """What the JSON setting adds under tensor parallelism (nothing when ``tp = 1``): the unit
    size and count, and the rate a unit fails at; ``devices`` and ``failure_rate_per_hour``
    stay the job's cards and per-card rate, while failures and working devices count units."""
    tp = job.training.tp
    if tp == 1:
        return {}
    return {"tp": tp, "units": spec.cluster.devices,
            "unit_failure_rate_per_hour": spec.cluster.failure_rate_per_hour}


def _run(spec: JobSpec, traces: Sequence[tuple[int, FailureTrace]], policies: Sequence[str],
         constants: BaselineConstants, progress: bool, jobs: int) -> ExperimentResult:
    """The experiment behind a progress bar on stderr (gone once done, so stdout stays the
    report alone). Raises PlanningError when the job cannot start, ValueError for a trace of
    another size."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=make_console(stderr=True), transient=True,
                   disable=not progress)
    with bar:
        task = bar.add_task("simulating", total=len(traces) * len(policies))

        def advance(name: str, seed: int) -> None:
            bar.update(task, advance=1, description=f"seed {seed} {name}")

        return run_experiment(spec, traces, policies, constants, on_run=advance, jobs=jobs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
