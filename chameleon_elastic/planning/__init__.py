"""The decision centre: schedule, estimator, search, restorer and plan cache.

Pure Python on numpy/scipy/networkx; never imports torch, so the launcher, the simulator and
``chameleon-plan`` share one fast-to-import implementation that runs at 2048-device scale.
"""

from .cache import PlanCache
from .estimator import evaluate
from .search import Decision, PlanningError, decide, initial_plan, resolve_snapshots
from .units import tp_allreduce_s, unit_spec

__all__ = ["Decision", "PlanCache", "PlanningError", "decide", "evaluate", "initial_plan",
           "resolve_snapshots", "tp_allreduce_s", "unit_spec"]
