"""The runtime's exception types, so callers can tell our failures from torch's."""

from __future__ import annotations

__all__ = ["PeerLost", "PipelineRuntimeError"]


class PipelineRuntimeError(RuntimeError):
    """Training under a plan cannot go on; the message names the problem and the fix."""


class PeerLost(PipelineRuntimeError):
    """A transfer or collective broke because a peer is gone, or because a peer tore its
    process groups down to recover (or the agent announced a new plan generation). Under
    chameleon-run this starts an in-place recovery; it reaches the user only without an agent
    to regroup with (plain torchrun, tests)."""
