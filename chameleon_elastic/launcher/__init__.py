"""chameleon-run: the torchrun-compatible launcher (CLI, ChameleonAgent, plan injection).

Importing this package is cheap: torch is imported only by the agent and the CLI when they run.
See docs/launcher.md for flags, environment variables, the event log and exit codes.
"""

from .detection.health import AlwaysHealthy, FileHealthCheck, HealthCheck
from .failures import FailureKind, WorkerFailure, classify_exit
from .observation.profiler import record_step
from .plan_env import CHAMELEON_VARS, chameleon_env, device_id, local_assignments

__all__ = [
    "CHAMELEON_VARS",
    "AlwaysHealthy",
    "FailureKind",
    "FileHealthCheck",
    "HealthCheck",
    "WorkerFailure",
    "chameleon_env",
    "classify_exit",
    "device_id",
    "local_assignments",
    "record_step",
]
