"""Bounded recovery: how many plan generations in a row may fail before the job gives up.

Why a bound: a failure that repeats deterministically (a bug whose error looks like a lost peer,
a peer that can never connect) makes the workers regroup, fail and regroup again forever, and
since their progress counts keep moving the hang detector never fires. torchft bounds the same
case with ``max_retries``.

A generation *fails* when it is abandoned before it commits a step; a generation that commits
one ends the streak. The workers (runtime/recovery/in_place.py) and the agents (launcher/agent.py) both
count, each with what it sees: a worker the generations it entered or tried to enter, an agent
the generations it renewed after a failure. Past the cap either ends the job with one sentence
that names the cause which kept coming back, and a non-zero exit.

The cap resolves as the timeouts do: ``CHAMELEON_MAX_FAILED_GENERATIONS`` > ``chameleon-run
--max-failed-generations`` > :data:`DEFAULT_CAP`; 0 means no cap. The agent hands the resolved
value to its workers on its channel (``max_failed``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["DEFAULT_CAP", "ENV_VAR", "FailureStreak", "RetrySettingError", "resolve_cap"]

ENV_VAR = "CHAMELEON_MAX_FAILED_GENERATIONS"
#: consecutive failed generations allowed; a genuine burst (a rack lost device by device) takes
#: a few, a deterministic failure takes them all
DEFAULT_CAP = 5


class RetrySettingError(ValueError):
    """A cap that cannot be used; the message names the setting and the fix."""


def resolve_cap(env: Mapping[str, str] | None = None, given: int | None = None) -> int:
    """Environment > ``given`` (the flag; None: not given) > :data:`DEFAULT_CAP`."""
    env = os.environ if env is None else env
    raw: object = env.get(ENV_VAR, given if given is not None else DEFAULT_CAP)
    try:
        cap = int(str(raw))
    except ValueError:
        cap = -1
    if cap < 0:
        raise RetrySettingError(
            f"the cap on failed generations ({ENV_VAR} or --max-failed-generations) is "
            f"{raw!r}; set it to a whole number >= 1, or 0 for no cap.")
    return cap


def _kind(cause: str) -> str:
    """A cause with its numbers blanked, so that the same failure on another port, tag or
    generation counts as the same cause."""
    return re.sub(r"\d+", "#", cause)


@dataclass
class FailureStreak:
    """Consecutive failed generations and their causes (first lines)."""

    cap: int
    count: int = 0
    causes: list[str] = field(default_factory=list)

    def progressed(self) -> None:
        """A step was committed: the streak is over."""
        self.count = 0
        self.causes.clear()

    def failed(self, cause: str) -> bool:
        """One more generation failed with ``cause``; True when that is past the cap."""
        self.count += 1
        lines = cause.strip().splitlines()
        self.causes.append(lines[0][:300] if lines else "unknown cause")
        return 0 < self.cap < self.count

    def forget_last(self) -> None:
        """The last generation counted did not fail after all (nobody left it)."""
        if self.count:
            self.count -= 1
            self.causes.pop()

    @property
    def cause(self) -> str:
        """The cause that came back most often in the streak (its latest wording)."""
        kinds = Counter(_kind(c) for c in self.causes)
        top = max(kinds.values(), default=0)
        return next((c for c in reversed(self.causes) if kinds[_kind(c)] == top), "unknown")

    def sentence(self) -> str:
        cause = self.cause
        times = sum(_kind(c) == _kind(cause) for c in self.causes)
        return (f"{self.count} plan generations in a row failed before committing a step, "
                f"{times} of them with: {cause.rstrip('.')}; a failure that "
                "repeats is not a lost device, so the job gives up: fix that cause, or raise "
                f"--max-failed-generations (now {self.cap}).")
