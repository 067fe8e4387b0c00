"""Every timeout of the launcher and the runtime, resolved in one place, with its hierarchy.

A recovery involves several waits that must nest: a survivor that has given up its broken
process groups waits for the agents to publish the next generation, and while it waits another
survivor may still be blocked in a collective that has not failed yet. If the outer wait were the
shorter one, recovery would give up on a peer that was about to arrive. So the timeouts are one
frozen value, checked once, and both sides (agent and workers) resolve it the same way:

    environment variable  >  flag or argument  >  default

+--------------+-----------------------------------+-----------------------------------------+
| field        | environment variable              | bounds                                  |
+==============+===================================+=========================================+
| hang_s       | CHAMELEON_HANG_TIMEOUT_S          | a runtime worker making no progress     |
|              | (``--hang-timeout``; 0: off)      | before its agent kills it as hung       |
| collective_s | CHAMELEON_COLLECTIVE_TIMEOUT_S    | one collective or point-to-point        |
|              |                                   | transfer in the runtime (gloo/nccl)     |
| store_s      | CHAMELEON_STORE_TIMEOUT_S         | one read of a key another process       |
|              |                                   | writes (worker store, agent channel)    |
| generation_s | CHAMELEON_GENERATION_TIMEOUT_S    | a worker waiting for the agents to      |
|              |                                   | publish the next plan generation        |
| failover_s   | CHAMELEON_FAILOVER_TIMEOUT_S      | an agent rebuilding its rendezvous after|
|              |                                   | the store host died (all retries)       |
| shutdown_s   | (torchrun's --shutdown-timeout)   | SIGTERM to SIGKILL when stopping workers|
+--------------+-----------------------------------+-----------------------------------------+

When ``hang_s`` is not set it is 60 s or half the collective timeout, whichever is less, and
``hang_auto`` is set: the agent then derives each worker's hang timeout from its measured phase
times, with ``hang_s`` as the ceiling (chameleon_elastic/hang.py).

Invariants: every value is positive (``hang_s`` may be 0: off), ``hang_s < collective_s`` (a
hung worker is killed, which makes its peers' collectives fail at once, before any of them
times out), and ``store_s <= generation_s`` and ``collective_s <= generation_s`` (a waiting
survivor outlasts any peer still blocked in a collective or a store read). The rendezvous
timeouts (``--rdzv-conf join_timeout`` etc., torch's) sit above all of these: the hierarchy is
hang < collective < waiting for the next generation < rendezvous. ``shutdown_s`` is torchrun's own flag and keeps torchrun's
semantics (its ``PET_SHUTDOWN_TIMEOUT`` variable is the flag's default, as in torchrun).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta

__all__ = ["ENV_VARS", "TimeoutSettingError", "Timeouts"]

ENV_VARS: dict[str, str] = {
    "hang_s": "CHAMELEON_HANG_TIMEOUT_S",
    "collective_s": "CHAMELEON_COLLECTIVE_TIMEOUT_S",
    "store_s": "CHAMELEON_STORE_TIMEOUT_S",
    "generation_s": "CHAMELEON_GENERATION_TIMEOUT_S",
    "failover_s": "CHAMELEON_FAILOVER_TIMEOUT_S",
}


class TimeoutSettingError(ValueError):
    """A timeout setting that cannot be used; the message names the variable and the fix."""


@dataclass(frozen=True)
class Timeouts:
    hang_s: float = 60.0
    collective_s: float = 120.0
    store_s: float = 60.0
    generation_s: float = 300.0
    failover_s: float = 60.0
    shutdown_s: float = 30.0
    hang_auto: bool = False   # hang_s is the ceiling of a timeout derived from measurements

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "hang_auto":
                continue
            value = getattr(self, f.name)
            least = 0 if f.name == "hang_s" else None
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value >= 0 if least == 0 else value > 0)):
                raise TimeoutSettingError(
                    f"timeout {f.name} = {value!r} must be a positive number of seconds"
                    + (" (or 0 to turn hang detection off)." if least == 0 else ".")
                )
        if self.hang_s >= self.collective_s:
            raise TimeoutSettingError(
                f"hang timeout {self.hang_s:g} s must be below the collective timeout "
                f"{self.collective_s:g} s, so a hung worker is killed before its peers' "
                "collectives time out; lower --hang-timeout or raise "
                "CHAMELEON_COLLECTIVE_TIMEOUT_S."
            )
        for inner in ("store_s", "collective_s"):
            if getattr(self, inner) > self.generation_s:
                raise TimeoutSettingError(
                    f"timeout {inner} = {getattr(self, inner):g} s exceeds generation_s = "
                    f"{self.generation_s:g} s; a survivor waiting for the next plan must outlast "
                    f"any peer still blocked, so raise {ENV_VARS['generation_s']} or lower "
                    f"{ENV_VARS[inner]}."
                )

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **given: float | None) -> Timeouts:
        """Environment > ``given`` (a flag or an argument; None means not given) > default."""
        env = os.environ if env is None else env
        unknown = set(given) - ({f.name for f in fields(cls)} - {"hang_auto"})
        if unknown:
            raise TypeError(f"unknown timeout(s) {sorted(unknown)}")
        values: dict[str, float] = {}
        for f in fields(cls):
            if f.name == "hang_auto":
                continue
            var = ENV_VARS.get(f.name)
            raw = env.get(var) if var else None
            if raw is not None:
                try:
                    values[f.name] = float(raw)
                except ValueError:
                    raise TimeoutSettingError(
                        f"{var}={raw!r} is not a number; set it to a timeout in seconds."
                    ) from None
            elif given.get(f.name) is not None:
                values[f.name] = float(given[f.name])  # type: ignore[arg-type]
        if "hang_s" not in values:   # follow a lowered collective timeout, keep below it
            values["hang_s"] = min(cls.hang_s, values.get("collective_s", cls.collective_s) / 2)
            return cls(**values, hang_auto=True)
        return cls(**values)

    def delta(self, name: str) -> timedelta:
        """One field as the ``timedelta`` torch's APIs take."""
        return timedelta(seconds=getattr(self, name))
