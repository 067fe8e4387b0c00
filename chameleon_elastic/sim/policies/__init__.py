"""Policy models the simulator can replay a trace against, by name.

Each model answers every trace event with a :class:`~chameleon_elastic.sim.engine.Reaction`.
``chameleon`` and ``hybrid`` decide with the launcher's planner; the baselines build their
plans by their own rules and are timed by the same estimator (see each module's docstring for
the assumptions, and docs/sim.md for where every constant comes from). Activation
recomputation reaches a model only through the planner: ``chameleon``, ``hybrid``, ``recycle``
and ``checkpoint`` run the planner's layouts (flags included), while ``oobleck``'s own templates
ignore it.
"""

from __future__ import annotations

from collections.abc import Callable

from ...spec import JobSpec
from ..constants import BaselineConstants
from ..engine import PolicyModel
from .chameleon import ChameleonPolicy, HybridPolicy
from .nvrx import NvrxPolicy
from .oobleck import OobleckPolicy
from .restart import CheckpointPolicy, RecyclePolicy
from .torchft import TorchftPolicy

__all__ = [
    "POLICY_NAMES",
    "ChameleonPolicy",
    "CheckpointPolicy",
    "HybridPolicy",
    "NvrxPolicy",
    "OobleckPolicy",
    "RecyclePolicy",
    "TorchftPolicy",
    "make_policy",
    "parse_policies",
]

_FACTORIES: dict[str, Callable[[JobSpec, BaselineConstants], PolicyModel]] = {
    "chameleon": ChameleonPolicy,
    "hybrid": HybridPolicy,
    "oobleck": OobleckPolicy,
    "recycle": RecyclePolicy,
    "checkpoint": CheckpointPolicy,
    "torchft": TorchftPolicy,
    "nvrx": NvrxPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, spec: JobSpec, constants: BaselineConstants) -> PolicyModel:
    """A fresh model (policies keep per-run state, so never share one between traces)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from: {', '.join(POLICY_NAMES)}."
        ) from None
    return factory(spec, constants)


def parse_policies(text: str) -> tuple[str, ...]:
    """``"chameleon,oobleck"`` -> names, validated, duplicates dropped, order kept."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(
            f"no policy named in {text!r}; pass a comma-separated list from: "
            f"{', '.join(POLICY_NAMES)}."
        )
    for n in names:
        if n not in _FACTORIES:
            raise ValueError(
                f"unknown policy {n!r}; choose from: {', '.join(POLICY_NAMES)}."
            )
    return tuple(dict.fromkeys(names))
