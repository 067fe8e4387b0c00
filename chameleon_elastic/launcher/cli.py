"""chameleon-run: torchrun's command line, torchrun's launch sequence, our agent.

Compatibility is by construction: the parser IS ``torch.distributed.run.get_args_parser()`` (every
flag, both spellings, defaults and ``PET_*`` overrides), our flags are added to it with the same
``env`` action (so ``PET_POLICY`` etc. work too), and the launch configuration comes from torch's
own ``config_from_args``. What differs is the agent (``ChameleonAgent``) and, for dynamic
rendezvous backends, faster liveness defaults (``keep_alive_interval=1``,
``keep_alive_max_attempt=3``, ``last_call_timeout=3``) unless ``--rdzv-conf`` sets them.

Two entry points. :func:`main` keeps ``torch.distributed.run.main``'s programmatic contract:
a bad combination of torch's own flags raises the exception torchrun raises (``ValueError``),
workers that fail for good raise ``ChildFailedError`` (through torch's ``@record``, which also
writes the root cause to ``TORCHELASTIC_ERROR_FILE``). :func:`console`, the ``chameleon-run``
command, turns each expected failure into one sentence and torchrun's exit status: 0 on success;
1 when workers fail for good, the launch configuration is invalid, the script is missing, the
rendezvous cannot be reached, or no plan can run the job any more; 2 for a usage error of a flag
(one sentence and ``see chameleon-run --help``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .observation.state_dir import StateDir

__all__ = ["LaunchConfigError", "ScriptNotFound", "build_parser", "console", "main"]

OUR_FLAGS = ("--job", "--preset", "--policy", "--recovery", "--stragglers", "--hang-timeout",
             "--max-failed-generations", "--plan-cache",
             "--state-dir", "--event-log", "--health-file", "--profile", "--profile-out",
             "--no-status", "--metrics-port", "--metrics-address", "--slurm")

_DYNAMIC_RDZV_DEFAULTS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3,
                          "last_call_timeout": 3}


class LaunchConfigError(ValueError):
    """torch refused the launch configuration (a ``ValueError`` there, so still one here)."""


class ScriptNotFound(FileNotFoundError):
    """The training script does not exist: said before any worker starts (torch starts every
    worker to have each print "can't open file", then fails the job)."""


_EXAMPLES = (
    ("chameleon-run --standalone --nproc-per-node 2 examples/ddp_torchrun.py", "exactly torchrun"),
    (("chameleon-run --standalone --nproc-per-node 4 --preset tiny-cpu examples/train_gpt.py "
     "--steps 40"), "plan-aware: a GPT in pipelines x data parallel, recovered in place"),
    (("chameleon-run --nnodes 1:2 --nproc-per-node 2 --rdzv-backend etcd-v3 --rdzv-endpoint "
     "10.0.0.5:2379 --rdzv-id job1 --preset tiny-cpu examples/train_gpt.py"),
     "two nodes on etcd (run the same line on each)"),
)
_POLICIES = (
    ("auto", "the better of reroute and replan by estimated throughput x effective time"),
    ("reroute", "give the lost device's micro-batches to its data-parallel peers"),
    ("replan", "a new layout: pipelines, layer split per stage, micro-batch quota per pipeline"),
    ("restart", "torchrun's behaviour: the same plan, every worker restarted"),
)


def _epilog() -> str:
    from chameleon_elastic.console import help_epilog

    return help_epilog(
        _EXAMPLES, "policies (--policy NAME, on a lost device):", _POLICIES,
        ["A job of your own: describe it in a TOML file and pass --job. Docs: docs/launcher.md",
         "(flags, events, differences from torchrun) and docs/rendezvous.md."],
        [(0, "the workers finished"),
         (1, ("workers failed for good, the launch configuration or the rendezvous failed, or\n"
             "      the script is missing (one sentence says which): retryable")),
         (2, "a flag was used wrongly (one line)"),
         (75, "preempted (SIGTERM, or SIGUSR1/2 in --signals-to-handle): requeue"),
         (93, ("no plan can run the job on the devices left, or layers were lost with no\n"
               "      checkpoint to restore them from: do not requeue"))])


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    from chameleon_elastic.console import usage_error
    from chameleon_elastic.spec import RECOVERY_MODES

    from .session import CLI_POLICIES

    parser = get_args_parser()
    parser.prog = "chameleon-run"
    # torch builds the parser, so its error() is replaced rather than subclassed
    parser.error = functools.partial(usage_error, parser.prog)  # type: ignore[method-assign]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.description = (
        "chameleon-run: torchrun with failure-aware elasticity. Every torchrun flag works the "
        "same; with --job/--preset the launcher plans a pipeline x data parallel layout and, "
        "when a device is lost, reroutes or re-plans instead of restarting everything."
    )
    group = parser.add_argument_group("chameleon (failure-aware elasticity)")
    _job_flags(group, env, CLI_POLICIES)
    _recovery_flags(group, env, RECOVERY_MODES)
    _output_flags(group, env, check_env)
    return parser


def _job_flags(group: Any, env: Any, policies: tuple[str, ...]) -> None:
    """The job and how it is planned."""
    group.add_argument("--job", action=env, type=str, default=None,
                       help="Job file (TOML: model profile, cluster, training). Enables plan "
                            "injection and failure-aware recovery.")
    group.add_argument("--preset", action=env, type=str, default=None,
                       help="A built-in job instead of --job (e.g. tiny-cpu).")
    group.add_argument("--policy", action=env, type=str, default="auto", choices=policies,
                       help="Recovery policy on a lost device: auto (best estimated score of "
                            "reroute, replan and, with standby devices beyond training.dp x "
                            "training.pp, swap), reroute, replan, or restart (torchrun's: same "
                            "plan, restart all). Default: auto.")


def _recovery_flags(group: Any, env: Any, modes: tuple[str, ...]) -> None:
    """How a lost device is recovered from, and what bounds it."""
    group.add_argument("--recovery", action=env, type=str, default=None, choices=modes,
                       help="How workers that run on chameleon_elastic.runtime survive a lost "
                            "device: inplace (default; survivors keep their processes, regroup "
                            "and take state from peers) or relaunch (stop and restart every "
                            "worker). Scripts that do not use the runtime are always relaunched. "
                            "Default: the job's cluster.recovery.")
    group.add_argument("--snapshot-every", "--snapshot_every", action=env, type=int,
                       default=None, metavar="K",
                       help="Runtime scripts recovering in place: every K committed steps each "
                            "device copies its state into host memory, its own and a device's "
                            "on another node, so layers that lose every replica come back from "
                            "memory (the steps since are trained again) instead of from a "
                            "checkpoint on disk. 0: no snapshots. Default: the job's [recovery] "
                            "snapshot_every, else the least K for which the snapshots cost at "
                            "most 2%% of the estimated step time.")
    group.add_argument("--stragglers", action=env, type=str, default="auto",
                       choices=("auto", "off"),
                       help="auto (default): a device whose measured speed stays below the "
                            "job's stragglers.threshold (0.7) for stragglers.window (5) steps "
                            "is planned around in place, like a failure but killing nothing: "
                            "the planner keeps the layout, gives the device less work or leaves "
                            "it spare, by score; once back at stragglers.recover (0.9) its work "
                            "comes back. off: the job runs at the slowest device's pace.")
    group.add_argument("--hang-timeout", "--hang_timeout", action=env, type=float,
                       default=None,
                       help="Seconds a worker on chameleon_elastic.runtime may make no progress "
                            "(and not be waiting for a peer) before its device is declared lost "
                            "and the worker killed; 0 turns it off. Scripts that never report "
                            "progress are never killed. Default: auto, derived for each worker "
                            "from its measured phase times, at most 60 s or half the collective "
                            "timeout (CHAMELEON_HANG_TIMEOUT_S overrides). In a recovery each "
                            "phase has its own deadline from measured figures, whatever this "
                            "says.")
    group.add_argument("--max-failed-generations", "--max_failed_generations", action=env,
                       type=int, default=None,
                       help="Plan generations in a row that may fail before committing a step "
                            "(a failure that keeps coming back) before the job ends with one "
                            "sentence naming the cause; 0: no cap. Default: 5 "
                            "(CHAMELEON_MAX_FAILED_GENERATIONS overrides).")
    group.add_argument("--plan-cache", "--plan_cache", action=env, type=int, default=None,
                       help="Precompute plans for up to K simultaneous losses in the background "
                            "(default: the job's planner.cache_failures; 0 disables).")


def _output_flags(group: Any, env: Any, check_env: Any) -> None:
    """Where state, events, profiles and metrics go; what the console shows."""
    group.add_argument("--state-dir", "--state_dir", action=env, type=str, default=None,
                       help="Directory for plan files (plan-gen<N>.json), the event log, "
                            "profiles and (with --job) the workers' stderr logs; kept. "
                            "Default: a new chameleon-run-<date>-<time>-* directory in the "
                            "temporary directory with --job, removed at the end unless it "
                            "holds something to read (a failure, a recovery, a worker's "
                            "stderr).")
    group.add_argument("--event-log", "--event_log", action=env, type=str, default=None,
                       help="JSONL event log path (default: <state-dir>/events.jsonl when a "
                            "state dir is in use).")
    group.add_argument("--health-file", "--health_file", action=env, type=str, default=None,
                       help="FAKE device health check for CPU/tests: a file listing device ids "
                            "marked bad, one per line.")
    group.add_argument("--profile", action=env, type=str, default=None,
                       help="Measured profile (written by --profile-out, or by "
                            "python -m chameleon_elastic.runtime.profiler) whose figures "
                            "replace the job file's guesses.")
    group.add_argument("--profile-out", "--profile_out", action=env, type=str, default=None,
                       help="Write the measured profile (per-layer times from step times, "
                            "regroup time, memory per device) here.")
    group.add_argument("--no-status", "--no_status", action=check_env,
                       help="Do not print the status line.")
    group.add_argument("--metrics-port", "--metrics_port", action=env, type=int, default=None,
                       help="Serve Prometheus metrics on /metrics, and the probes /healthz "
                            "(agent alive) and /readyz (this node trains under the current "
                            "generation), on this port (0: any free port, printed). Default: "
                            "off.")
    group.add_argument("--metrics-address", "--metrics_address", action=env, type=str,
                       default="127.0.0.1",
                       help="Address the metrics server binds to (0.0.0.0 for every "
                            "interface, as a Prometheus scrape or a Kubernetes probe from "
                            "outside the node needs). Default: 127.0.0.1.")
    group.add_argument("--slurm", action=env, type=str, nargs="?", const="on", default="auto",
                       choices=("auto", "on", "off"),
                       help="Take --nnodes, --rdzv-id, --rdzv-backend (c10d), --rdzv-endpoint "
                            "(c10d: the first host) and --node-rank (static) from the Slurm "
                            "allocation, for flags left at their defaults (one line says what "
                            "was taken). auto (default): inside an srun step; on (--slurm): "
                            "whenever SLURM_JOB_ID is set; off: never.")


def _prepare_rendezvous(args: argparse.Namespace) -> None:
    """torch.distributed.run.run()'s backend selection, unchanged."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _register_backends() -> None:
    try:
        from chameleon_elastic.rendezvous.registration import register
    except ImportError:
        return
    register()


def _make_session(parser: argparse.ArgumentParser, args: argparse.Namespace, nproc: int,
                  max_nodes: int, state_dir: Path):
    from chameleon_elastic.profile import MeasuredProfile, ProfileError
    from chameleon_elastic.spec import SpecError, load_job

    from .session import JobSession, LauncherPlanningError

    try:
        spec = load_job(args.job, args.preset)
        if args.profile:
            measured = MeasuredProfile.load(args.profile)   # either producer's file
            try:
                spec = measured.apply(spec)
            except SpecError as exc:
                raise SpecError(f"--profile {args.profile}: {exc}") from exc
        spec = spec.with_recovery(args.recovery)  # the flag wins, for the planner too
        if args.snapshot_every is not None and args.snapshot_every < 0:
            raise SpecError(f"--snapshot-every {args.snapshot_every} is invalid; pass an "
                            "integer >= 0 (0: no snapshots).")
        spec = spec.with_snapshot_every(args.snapshot_every)
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(
            spec.cluster, devices_per_node=nproc))   # where snapshot partners are
    except (SpecError, ProfileError) as exc:
        parser.error(str(exc))
    world = nproc * max_nodes
    if world != spec.cluster.devices:
        parser.error(
            f"job {spec.name!r} describes cluster.devices = {spec.cluster.devices} but this "
            f"launch starts {max_nodes} node(s) x {nproc} process(es) = {world} devices; make "
            "--nnodes (max) x --nproc-per-node equal to cluster.devices, or edit the job file."
        )
    tp = spec.training.tp
    if nproc % tp:
        parser.error(
            f"job {spec.name!r} has training.tp = {tp} cards per tensor-parallel unit, which "
            f"does not divide --nproc-per-node {nproc}; a unit's cards must share a node, so "
            "start a multiple of training.tp processes per node."
        )
    if args.plan_cache is not None and args.plan_cache < 0:
        parser.error(f"--plan-cache {args.plan_cache} is invalid; pass an integer >= 0.")
    try:
        return JobSession(spec, args.policy, state_dir / "plans", cache_depth=args.plan_cache)
    except ImportError as exc:
        parser.error(f"--job needs the planner (chameleon_elastic.planning), which is not "
                     f"available yet: {exc}. Run without --job to launch like torchrun.")
    except LauncherPlanningError as exc:
        parser.error(str(exc))


@dataclasses.dataclass
class _Launch:
    """What the command line resolves to before anything starts."""

    config: Any                  # torch's LaunchConfig
    cmd: Any
    cmd_args: list[Any]
    timeouts: Any
    max_failed_generations: int
    state: StateDir | None       # the run's state directory (state_dir.py)
    session: Any                 # JobSession with --job / --preset, else None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from chameleon_elastic import torch_compat

    from .agent import ChameleonAgent
    from .detection.health import AlwaysHealthy, FileHealthCheck
    from .observation.profiler import Profiler
    from .observe import EventLog, StatusLine
    from .workers.worker_logs import WorkerLogs

    _take_slurm(args, parser)
    job_mode = _check_job_flags(args, parser)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        _without_death_signal_warning)
    _prepare_rendezvous(args)
    with _held_warnings("torch.distributed.run"):   # its OMP banner: only once the job is valid
        launch = _resolve(args, parser, job_mode)
    config, state, session = launch.config, launch.state, launch.session
    state_dir = None if state is None else state.path
    event_path = args.event_log or (None if state_dir is None else state_dir / "events.jsonl")
    try:
        served = _serve_metrics(args, parser, launch.timeouts.hang_s)
    except BaseException:
        if state is not None:
            state.close(succeeded=False, records=())
        raise
    events = EventLog(event_path, listeners=() if served is None else (served.metrics.observe,))
    profiler = None
    if args.profile_out:
        assert state_dir is not None
        profiler = Profiler(state_dir / "profile")
    if session is not None and _torch_logging_untouched(args):
        assert state_dir is not None
        config.logs_specs = WorkerLogs(state_dir / "logs")
    if state_dir is not None:
        what = ("plans, events, profiles and workers' stderr" if isinstance(
            config.logs_specs, WorkerLogs) else "plans, events and profiles")
        sys.stderr.write(f"chameleon-run: {what} in {state_dir}\n")
    status = StatusLine(enabled=not args.no_status)
    succeeded = False
    try:   # from the store's connection on: a failure or Ctrl-C there leaves nothing either
        spec, params = _worker_spec(launch, status)
        agent = ChameleonAgent(
            spec, config.logs_specs, rdzv_parameters=params, session=session, events=events,
            status=status,
            health=FileHealthCheck(args.health_file) if args.health_file else AlwaysHealthy(),
            profiler=profiler, timeouts=launch.timeouts,
            max_failed_generations=launch.max_failed_generations,
            metrics=None if served is None else served.metrics,
            recovery="relaunch" if session is None else session.spec.cluster.recovery,
            stragglers=args.stragglers == "auto",
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
        )
        if served is not None:
            served.ready = agent.ready
        result = _run_agent(agent, spec, config,
                            torch_compat.entrypoint_name(launch.cmd, list(launch.cmd_args)))
        succeeded = True
        return result
    finally:
        if served is not None:
            served.close()
        if profiler is not None and args.profile_out:
            profiler.write(args.profile_out, None if session is None else session.spec,
                           None if session is None else session.plan)
        events.close()
        if state is not None and state.close(succeeded, events.records):
            if succeeded:
                sys.stderr.write(f"chameleon-run: removed {state_dir}: the run succeeded and "
                                 "left nothing to read there (--state-dir DIR keeps it)\n")
        elif event_path is not None and Path(event_path).exists():
            sys.stderr.write(f"chameleon-run: events of this run: {event_path}\n")


def _take_slurm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill the flags the Slurm allocation knows (launcher/slurm.py), saying so in one line."""
    from .slurm import SlurmAllocation, SlurmError, from_allocation

    alloc = SlurmAllocation.from_env(os.environ)
    if args.slurm == "off" or alloc is None:
        if args.slurm == "on":
            parser.error("--slurm: SLURM_JOB_ID is not set, so there is no allocation to read; "
                         "run inside sbatch/srun, or drop --slurm.")
        return
    if args.slurm == "auto" and not alloc.in_step:
        return
    try:
        taken = from_allocation(alloc, vars(args), args.standalone)
    except SlurmError as exc:
        parser.error(str(exc))
    for dest, value in taken.items():
        setattr(args, dest, value)
    if taken:
        flags = " ".join(f"--{d.replace('_', '-')} {v}" for d, v in taken.items())
        sys.stderr.write(f"chameleon-run: under Slurm job {alloc.job_id} (node "
                         f"{alloc.node_rank} of {alloc.nnodes}): {flags} (--slurm off to "
                         "launch exactly as given)\n")


def _serve_metrics(args: argparse.Namespace, parser: argparse.ArgumentParser,
                   hang_s: float) -> Any:
    """The metrics server of ``--metrics-port`` (None without it), bound before anything
    starts, so that a port in use is a usage error, not a failed job."""
    if args.metrics_port is None:
        return None
    from .observation.metrics import AgentMetrics, MetricsServer

    if not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port {args.metrics_port} is not a port; pass 0..65535 "
                     "(0: any free port).")
    try:
        served = MetricsServer(AgentMetrics(hang_s), args.metrics_address, args.metrics_port)
    except OSError as exc:
        parser.error(f"cannot serve metrics on {args.metrics_address}:{args.metrics_port} "
                     f"({exc.strerror or exc}); pass another --metrics-port or "
                     "--metrics-address.")
    sys.stderr.write(f"chameleon-run: metrics on {served.url}/metrics (probes /healthz, "
                     "/readyz)\n")
    return served


def _check_job_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """Whether a job is given; our job-only flags without one are a usage error."""
    if args.job is not None and args.preset is not None:
        parser.error("--job and --preset are mutually exclusive; pass only one of them.")
    job_mode = args.job is not None or args.preset is not None
    job_only = (("--health-file", args.health_file), ("--profile", args.profile),
                ("--plan-cache", args.plan_cache), ("--recovery", args.recovery),
                ("--hang-timeout", args.hang_timeout),
                ("--max-failed-generations", args.max_failed_generations),
                ("--policy", None if args.policy == "auto" else args.policy),
                ("--stragglers", None if args.stragglers == "auto" else args.stragglers))
    for flag, value in job_only:
        if value is not None and not job_mode:
            parser.error(f"{flag} only applies with --job or --preset; add one, or drop {flag}.")
    return job_mode


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser,
             job_mode: bool) -> _Launch:
    """torch's launch configuration, our timeouts, the state directory and the job's session;
    every usage error is raised here, before anything starts or prints."""
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    from chameleon_elastic.retries import RetrySettingError, resolve_cap
    from chameleon_elastic.timeouts import Timeouts, TimeoutSettingError

    try:
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as exc:   # torch validates --nnodes with assert
        raise LaunchConfigError(str(exc)) from exc
    _check_endpoint(config, parser)
    _check_script(args)
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    try:
        timeouts = Timeouts.resolve(shutdown_s=config.shutdown_timeout, hang_s=args.hang_timeout)
        cap = resolve_cap(given=args.max_failed_generations)
    except (TimeoutSettingError, RetrySettingError) as exc:
        parser.error(str(exc))
    _register_backends()
    if config.rdzv_backend not in ("static",):
        for key, value in _DYNAMIC_RDZV_DEFAULTS.items():
            config.rdzv_configs.setdefault(key, value)
    state = StateDir.open(args.state_dir, needed=job_mode or bool(args.profile_out))
    session = None
    if job_mode:
        assert state is not None
        try:
            session = _make_session(parser, args, config.nproc_per_node, max_nodes, state.path)
        except BaseException:
            state.close(succeeded=False, records=())   # nothing ran: leave nothing behind
            raise
    return _Launch(config, cmd, list(cmd_args), timeouts, cap, state, session)


def _check_endpoint(config: Any, parser: argparse.ArgumentParser) -> None:
    """A malformed ``--rdzv-endpoint`` (or an etcd-v3 ``--rdzv-conf`` value) is a usage error,
    said in one line before anything connects: torch's c10d raised it in a traceback as the
    agent started, and etcd's resolver failed it only after ``connect_timeout``."""
    backend, endpoint = config.rdzv_backend, config.rdzv_endpoint
    if backend == "etcd-v3":
        from chameleon_elastic.rendezvous.config import EtcdSettings
        from chameleon_elastic.rendezvous.errors import EtcdConfigError

        try:
            EtcdSettings.from_config(endpoint, config.rdzv_configs)
        except EtcdConfigError as exc:
            parser.error(str(exc))
    elif endpoint:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        try:
            parse_rendezvous_endpoint(endpoint, default_port=29400)
        except ValueError as exc:
            parser.error(f"--rdzv-endpoint {endpoint!r}: {str(exc).rstrip('.')}; give the "
                         "host:port of the node that hosts the rendezvous (c10d: node 0)")


def _worker_spec(launch: _Launch, status: Any) -> tuple[Any, Any]:
    """torch's ``WorkerSpec`` and ``RendezvousParameters``, as torchrun builds them."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from chameleon_elastic import torch_compat
    from chameleon_elastic.rendezvous.handler import handler_for

    from .coordination.waiting import connect_interruptibly

    config = launch.config
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = torch_compat.addr_and_port(params)
    # c10d's store connects in C++, deaf to Ctrl-C for minutes (waiting.py); our etcd-v3 client
    # answers Ctrl-C and says its own sentence after connect_timeout
    handler = (connect_interruptibly(lambda: handler_for(params), params.endpoint, status)
               if params.backend == "c10d" else handler_for(params))
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=launch.cmd,
        args=tuple(launch.cmd_args), rdzv_handler=handler,
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
        event_log_handler=config.event_log_handler, numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    return spec, params


def _run_agent(agent: Any, spec: Any, config: Any, entrypoint_name: str) -> Any:
    """Run the agent as torch's launcher does: its events, its metrics, the rendezvous closed
    at the end (unless a signal ended the run), ``ChildFailedError`` for workers that failed."""
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from .workers.worker_logs import WorkersFailed

    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        try:
            result = agent.run()
        except Exception:
            torch_events.record(agent.get_event_failed(), config.event_log_handler)
            raise
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result is None:  # rendezvous closed gracefully
            return None
        if result.is_failed():
            if not result.failures:  # ended by the agent, which said why in one sentence
                raise SystemExit(int(agent.exit_status))
            raise WorkersFailed(entrypoint_name, result.failures,
                                {rank: agent.stderr_log(rank) for rank in result.failures})
        return result.return_values
    except SignalException:
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            try:
                spec.rdzv_handler.shutdown()
            except Exception as exc:  # noqa: BLE001 - the job's outcome is already decided
                sys.stderr.write(f"chameleon-run: closing the rendezvous failed: {exc}\n")


def _without_death_signal_warning(record: logging.LogRecord) -> bool:
    """torch's agent logs "Received 2 death signal, shutting down workers"; chameleon-run says
    it in its own sentence ("interrupted (SIGINT): workers stopped")."""
    return "death signal" not in record.getMessage()


@contextlib.contextmanager
def _held_warnings(name: str) -> Iterator[None]:
    """Hold ``name``'s log records until the block succeeds: torch warns (the OMP_NUM_THREADS
    banner) before it validates, and a usage error must not come after a banner."""
    held: list[logging.LogRecord] = []
    logger = logging.getLogger(name)

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in held:   # reached only on success
        logger.handle(record)


def main(argv: Sequence[str] | None = None) -> Any:
    """``torch.distributed.run.main`` with our agent: same flags, same exceptions."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = build_parser()
    args = parser.parse_args(argv)
    return record(run)(args, parser)


def console() -> None:
    """The ``chameleon-run`` command: :func:`main`, with every expected failure as one sentence
    and torchrun's exit status instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

    from chameleon_elastic.exit_status import ExitStatus
    from chameleon_elastic.rendezvous.errors import rendezvous_message

    from .workers.preemption import Preempted

    parser = build_parser()
    args = parser.parse_args()
    try:
        record(run)(args, parser)
    except Preempted as exc:
        sys.stderr.write(f"chameleon-run: {exc.sentence} (exit status "
                         f"{int(ExitStatus.PREEMPTED)}: requeue)\n")
        raise SystemExit(int(ExitStatus.PREEMPTED)) from None
    except (SignalException, KeyboardInterrupt) as exc:
        # torch's agent has stopped the workers already (SignalException: its handler exists
        # from the first worker's start on); before any worker started, Python's
        # KeyboardInterrupt ends the wait. Exit as torchrun does (1), with no traceback. A
        # preemption signal (SIGTERM, SIGUSR1/2) is Preempted, above.
        if isinstance(exc, SignalException):
            what = f"{signal.Signals(exc.sigval).name}): workers stopped"
        else:
            what = "SIGINT) before any worker started"
        sys.stderr.write(f"chameleon-run: interrupted ({what}\n")
        raise SystemExit(1) from None
    except LaunchConfigError as exc:
        sys.stderr.write(f"chameleon-run: error: invalid launch configuration: "
                         f"{str(exc).strip().rstrip('.')}; see chameleon-run --help\n")
        raise SystemExit(1) from None
    except ScriptNotFound as exc:
        sys.stderr.write(f"chameleon-run: {exc}\n")
        raise SystemExit(1) from None
    except ChildFailedError as exc:
        sys.stderr.write(f"chameleon-run: {_failure_sentence(exc)}\n")
        raise SystemExit(1) from None
    except RendezvousClosedError:   # before this node joined: the agent handles it after
        sys.stderr.write(
            f"chameleon-run: the rendezvous {args.rdzv_id!r} at {args.rdzv_endpoint} is closed: "
            "a job with this --rdzv-id already ended there (a job closes its rendezvous when "
            "it ends, as torchrun's does); start the job with a new --rdzv-id\n")
        raise SystemExit(1) from None
    except RendezvousError as exc:
        message = rendezvous_message(exc) or (
            f"the rendezvous failed ({type(exc).__name__}"
            f"{': ' + str(exc).splitlines()[0][:300] if str(exc).strip() else ''}); "
            "check --rdzv-endpoint and that every node was started with the same --rdzv-id")
        sys.stderr.write(f"chameleon-run: {message}\n")
        raise SystemExit(1) from None


def _check_script(args: argparse.Namespace) -> None:
    if args.no_python or args.module or os.path.exists(args.training_script):
        return
    raise ScriptNotFound(f"the training script {args.training_script!r} does not exist (relative paths are "
            f"taken from the current directory, {os.getcwd()}); check the path, or pass "
            "--module for a module name.")


def _torch_logging_untouched(args: argparse.Namespace) -> bool:
    """No torch flag says where workers' output goes: under --job, their stderr goes to files."""
    return (args.redirects == "0" and args.tee == "0" and args.log_dir is None
            and args.logs_specs is None and not args.local_ranks_filter
            and not args.duplicate_stdout_filters and not args.duplicate_stderr_filters)


def _failure_sentence(exc: Any) -> str:
    """One sentence for ``ChildFailedError``: who failed, how, and where the details are (the
    worker's stderr log under --job; otherwise its error file, or its output above, which we
    did not capture and so never claim holds a traceback: a worker killed by a signal has
    none, one that exited with a code may have printed nothing)."""
    rank, first = exc.get_first_failure()
    how = (f"was killed by {first.signal_name()}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    more = len(exc.failures) - 1
    others = f" ({more} more worker{'s' if more != 1 else ''} failed)" if more else ""
    log = getattr(exc, "stderr_logs", {}).get(rank)
    if log is None:
        if os.path.exists(first.error_file):
            where = f"; its traceback is in {first.error_file}"
        elif first.exitcode < 0:
            where = ("; a signal leaves no Python traceback: what the worker printed last, if "
                     "anything, is above")
        else:
            where = "; what it printed, if anything, is above"
        return f"{exc.name} failed: rank {rank} (pid {first.pid}) {how}{others}{where}."
    from .workers.worker_logs import tail

    last = tail(log)
    shown = "".join(f"\n  | {line}" for line in last)
    return (f"{exc.name} failed: rank {rank} (pid {first.pid}) {how}{others}; its stderr is in "
            f"{log}" + (f", which ends:{shown}" if last else " (empty)."))


if __name__ == "__main__":
    console()
