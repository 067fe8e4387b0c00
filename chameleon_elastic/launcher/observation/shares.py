"""What a re-plan does to a script that does not follow the plan, said once, in one line.

Every plan keeps the global batch: its micro-batch quotas sum to the job's
``global_micro_batches``. A script on the runtime follows its quota by construction, and one
that takes its gradient accumulation from ``CHAMELEON_MICRO_BATCHES`` (a framework through its
adapter, chameleon_elastic/frameworks/) follows it too. An unmodified torchrun script does not:
relaunched with fewer workers, it goes on at the share it was written for, so each step trains on
fewer samples, and nothing in its output shows it. The launcher cannot see what the script does
with its batch, but it knows who announced that they follow the plan (the channel's
``worker/<card>`` registration of a runtime worker, or ``follows/<card>`` of an adapter): for
anyone else, the first plan that changes the workers' shares gets one line naming the change and
the fix. Pure functions and one read of the node's channel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from chameleon_elastic import channel

__all__ = ["follows_plan", "share_change", "shares"]


def shares(plan: Any) -> dict[int, int]:
    """Micro-batches per step of each working device."""
    return {role.device: role.micro_batches for role in plan.roles()}


def _gives(devices: dict[int, int]) -> str:
    """``1 worker 4 micro-batches``, ``2 workers 2 micro-batches each``, ``3 workers 3, 3, 2
    micro-batches``."""
    values = sorted(devices.values(), reverse=True)
    who = f"{len(values)} worker{'s' if len(values) != 1 else ''}"
    unit = "micro-batch" if values == [1] * len(values) else "micro-batches"
    if len(set(values)) > 1:
        return f"{who} {', '.join(map(str, values))} {unit}"
    return f"{who} {values[0]} {unit}{' each' if len(values) > 1 else ''}"


def share_change(first: Any, plan: Any, micro_batch_size: int) -> str | None:
    """The line for a script that does not follow the plan, when ``plan`` gives the working
    devices other shares than ``first`` (the plan the script was started under); None when
    every device keeps its share (a crash restarted on the same layout). A script that ignores
    the plan trains, per step, what its live workers trained under the first plan."""
    was, now = shares(first), shares(plan)
    if was == now:
        return None
    kept = sum(was.get(d, 0) for d in now) / sum(was.values())
    lost = f"one that does not now trains about {kept:.0%} of its batch per step"
    if any(len(p.devices) > 1 for p in first.pipelines + plan.pipelines):
        n, n0 = len(now), len(was)
        return (f"this plan runs {n} worker{'s' if n != 1 else ''} where the first ran {n0}, "
                "in pipelines that only a script on chameleon_elastic.runtime follows (it keeps "
                f"the global batch of {plan.global_micro_batches} micro-batches); a "
                f"data-parallel script does not: it now trains about {kept:.0%} of its batch "
                "per step (docs/runtime.md).")
    return (f"this plan gives {_gives(now)} per step where the first gave {_gives(was)}: a "
            "script that takes its gradient accumulation from CHAMELEON_MICRO_BATCHES keeps "
            f"the global batch ({plan.global_micro_batches} micro-batches of "
            f"training.micro_batch_size {micro_batch_size}); {lost}. docs/frameworks.md has "
            "the one line that follows the plan in Lightning, HF Trainer and accelerate.")


def follows_plan(store: Any, cards: Iterable[int]) -> bool:
    """A worker of these cards said it follows the plan: it runs on the runtime, or a
    framework adapter announced it (frameworks/share.py)."""
    keys = [k for c in cards for k in (channel.worker_key(c), channel.follows_key(c))]
    return bool(keys) and any(store.check([k]) for k in keys)
