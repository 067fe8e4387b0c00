"""The end of one agent's run: wait for the other agents, but not for a node that is gone.

Why: torch's exit barrier waits up to ``exit_barrier_timeout`` (300 s) for every node of the
last round. A node lost meanwhile (killed, frozen, cut off from etcd) never arrives. With leases
watched (etcd-v3), the wait ends as soon as another node's lease expires, or once fewer nodes
hold a lease than the round had (a member lost earlier with no device left: its loss started
no recovery, so nothing else remembers it). Without leases it is torch's barrier, in slices. (A node whose every device was lost does not wait here while the job
goes on elsewhere: it stays a member with no device, agent.py.)

The protocol is torch's (``torch.distributed.elastic.utils.store.barrier``) on the same keys:
every agent adds one to a counter, the one that counts up to the world size sets a key, and all
wait for that key. The store's ``add`` is applied exactly once (rendezvous/store.py), so no agent
is ever counted twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["wait_for_the_others"]

log = logging.getLogger("chameleon_elastic.launcher.coordination.exit_barrier")

#: torch's keys (its agents' terminal-state barrier), so the protocol is the same
_PREFIX = "torchelastic/agent/terminal_state"
_COUNT, _DONE = _PREFIX + "/num_members", _PREFIX + "/last_member"
#: how often the wait looks at the other nodes' leases
_SLICE_S = 1.0


def wait_for_the_others(store: Any, world_size: int, timeout_s: float,
                        lost: Callable[[], list[str]]) -> None:
    """Wait until every one of ``world_size`` agents arrived, ``timeout_s`` passed (torch's
    behaviour: go on), or ``lost()`` names nodes gone since the run began its end."""
    try:
        if store.add(_COUNT, 1) >= world_size:
            store.set(_DONE, "1")
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("not every agent reached the end within %.0f s; ending anyway",
                            timeout_s)
                return
            try:
                store.wait([_DONE], timedelta(seconds=min(_SLICE_S, remaining)))
                return
            except dist.DistStoreError:
                gone = lost()
                if gone:
                    log.info("%s left before the end; not waiting for them", ", ".join(gone))
                    return
    except Exception as exc:  # noqa: BLE001 - torch's barrier logs and ends too
        log.warning("the end-of-run barrier failed (%s); ending anyway", exc)
