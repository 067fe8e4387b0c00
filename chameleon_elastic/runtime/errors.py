"""The runtime's one exception type, so callers can tell our failures from torch's."""

from __future__ import annotations

__all__ = ["PipelineRuntimeError"]


class PipelineRuntimeError(RuntimeError):
    """Training under a plan cannot go on; the message names the problem and the fix."""
