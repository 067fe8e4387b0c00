"""chameleon-sim: replay failure traces against chameleon and baseline policies.

Layers: ``traces`` (where failures come from) -> ``engine`` (event loop, timeline) ->
``policies`` (what each system does at an event, timed by ``planning.estimator``) ->
``experiment`` (policies x seeds, paired statistics) -> ``report`` / ``plots`` / ``cli``.
Never imports torch: the planner it shares with the launcher does not.
"""

from .constants import BaselineConstants
from .engine import Phase, PolicyRun, Reaction, simulate
from .experiment import ExperimentResult, Spread, run_experiment
from .policies import POLICY_NAMES, make_policy
from .traces import FailureTrace, TraceError, TraceEvent, generate_trace, read_trace, write_trace

__all__ = [
    "POLICY_NAMES",
    "BaselineConstants",
    "ExperimentResult",
    "FailureTrace",
    "Phase",
    "PolicyRun",
    "Reaction",
    "Spread",
    "TraceError",
    "TraceEvent",
    "generate_trace",
    "make_policy",
    "read_trace",
    "run_experiment",
    "simulate",
    "write_trace",
]
