"""chameleon-run: torchrun's command line, with our flags, and its two entry points.

Compatibility is by construction: the parser IS ``torch.distributed.run.get_args_parser()`` (every
flag, both spellings, defaults and ``PET_*`` overrides), and our flags are added to it with the
same ``env`` action (so ``PET_POLICY`` etc. work too). What the command line then starts is in
:mod:`.launch` (torchrun's launch sequence, our agent).

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
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .launch import LaunchConfigError, ScriptNotFound, run

__all__ = ["LaunchConfigError", "ScriptNotFound", "build_parser", "command", "console", "main"]

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


def main(argv: Sequence[str] | None = None) -> Any:
    """``torch.distributed.run.main`` with our agent: same flags, same exceptions."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = build_parser()
    args = parser.parse_args(argv)
    return record(run)(args, parser)


def command() -> NoReturn:
    """The ``chameleon-run`` command (and ``python -m chameleon_elastic.launcher``):
    :func:`console`, then the process leaves without the interpreter's teardown: every file and
    server of the run is closed by then (``launch.run``'s ``finally``), and what is left are
    torch's C++ stores, whose threads the teardown may destroy while they still run (``terminate
    called without an active exception``, SIGABRT: a preempted run exited -6 instead of 75 once
    on a loaded machine, after its last sentence). It saves the teardown's time too."""
    code: int | str | None = 0
    try:
        console()
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):   # SystemExit("message"): Python prints it and exits 1
        sys.stderr.write(code + "\n")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def console() -> None:
    """:func:`main`, with every expected failure as one sentence and torchrun's exit status
    (``SystemExit``) instead of a traceback."""
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
    command()