"""torchrun's launch sequence, with our agent: from parsed flags to a finished run.

The launch configuration comes from torch's own ``config_from_args``, the worker spec and the
rendezvous parameters are built as torchrun builds them, and the agent is run as torchrun runs
its own (torch's events and metrics, the rendezvous closed at the end). What differs is the
agent (``ChameleonAgent``), the job's session and state directory with ``--job``, and, for
dynamic rendezvous backends, faster liveness defaults (``keep_alive_interval=1``,
``keep_alive_max_attempt=3``, ``last_call_timeout=3``) unless ``--rdzv-conf`` sets them.
Every usage error is raised (through the parser) before anything starts or prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .observation.state_dir import Outcome, StateDir, kept_at_most

__all__ = ["LaunchConfigError", "ScriptNotFound", "run"]

_DYNAMIC_RDZV_DEFAULTS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3,
                          "last_call_timeout": 3}


class LaunchConfigError(ValueError):
    """torch refused the launch configuration (a ``ValueError`` there, so still one here)."""


class ScriptNotFound(FileNotFoundError):
    """The training script does not exist: said before any worker starts (torch starts every
    worker to have each print "can't open file", then fails the job)."""


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
    _say_watchdog_mode(session)
    state_dir = None if state is None else state.path
    event_path = args.event_log or (None if state_dir is None else state_dir / "events.jsonl")
    try:
        served = _serve_metrics(args, parser, launch.timeouts.hang_s)
    except BaseException:
        if state is not None:
            state.close("failed", records=())
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
    outcome: Outcome = "failed"
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
        outcome = "succeeded"
        return result
    except BaseException as exc:
        if _interrupted(exc):
            outcome = "interrupted"
        raise
    finally:
        if served is not None:
            served.close()
        if profiler is not None and args.profile_out:
            profiler.write(args.profile_out, None if session is None else session.spec,
                           None if session is None else session.plan)
        events.close()
        _say_where(state, outcome, events.records, event_path)


def _interrupted(exc: BaseException) -> bool:
    """The person running chameleon-run ended it: Ctrl-C, or its terminal closed."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(exc, KeyboardInterrupt) or (
        isinstance(exc, SignalException) and exc.sigval in (signal.SIGINT, signal.SIGHUP))


def _say_where(state: StateDir | None, outcome: Outcome, records: list[dict[str, Any]],
               event_path: str | Path | None) -> None:
    """The state directory's last word (state_dir.py): removed, and why nothing was lost; or
    kept, why, and what is in it."""
    if state is None:
        if event_path is not None and Path(event_path).exists():
            sys.stderr.write(f"chameleon-run: events of this run: {event_path}\n")
        return
    why = state.close(outcome, records)
    if why is None:
        if outcome == "succeeded":
            sys.stderr.write(f"chameleon-run: removed {state.path}: the run succeeded and left "
                             "nothing to read there (--state-dir DIR keeps it)\n")
        elif outcome == "interrupted" and any(
                r.get("event") == "workers_started" for r in records):
            sys.stderr.write(f"chameleon-run: removed {state.path}: the workers wrote nothing "
                             "to stderr before the interruption (--state-dir DIR keeps it)\n")
    elif why == "given":
        if event_path is not None and Path(event_path).exists():
            sys.stderr.write(f"chameleon-run: events of this run: {event_path}\n")
    else:
        sys.stderr.write(f"chameleon-run: kept {state.path}: {why}; the event log is "
                         f"events.jsonl there (the newest {kept_at_most()} such directories stay, "
                         "--state-dir DIR keeps one for good)\n")


def _say_watchdog_mode(session: Any) -> None:
    """With a job, once at start: the line naming a user's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    that would have NCCL's watchdog kill survivors (workers/worker_env.py), if any."""
    from .workers.worker_env import nccl_watchdog_warning

    warning = None if session is None else nccl_watchdog_warning()
    if warning is not None:
        sys.stderr.write(f"chameleon-run: {warning}\n")


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
            state.close("failed", records=())   # nothing ran: leave nothing behind
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
