"""A leader change inside a recovery round, for ``coordination_scale.py --leader-change``.

At 4096 simulated nodes etcd's leader, starved on two shared cores, changed during a quick
round, and every agent failed with "no endpoint answered within the retry deadline (last
error: UNAVAILABLE: etcdserver: leader changed)" (issue 48). :class:`LeaderChange` makes that
happen on purpose, at a chosen moment of the round, so that the agents' handling of it is
measured rather than hoped for:

- it waits for the lost node's key to go (its lease expired or was revoked: the moment the
  agents' watches see the loss and the round starts), then ``at_s`` more seconds, so that the
  change lands while the agents write their reports and wait for the decision;
- ``move``: the leader hands leadership to the next member (etcd's maintenance
  ``MoveLeader``, what ``etcdctl move-leader`` sends; ``LocalEtcdCluster.move_leader``):
  every member stays up, in-flight proposals fail with "etcdserver: leader changed";
- ``restart``: the leader is SIGKILLed and started again on its data (a member restart: its
  clients' connections and watch streams break, the others elect a new leader);
- ``row()`` says what happened, for the benchmark's row: how, when (after the kill), which
  member led before and after, the raft term before and after, and how long the change took.

Waiting for the key is a poll (every 20 ms, one small read) from the benchmark's parent: a
watch of its own would be one more watcher in the figures it reports.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["HOWS", "LeaderChange"]

#: the ways to change the leader (``--leader-change``)
HOWS = ("move", "restart")

_POLL_S = 0.02


class LeaderChange:
    """Change ``cluster``'s leader ``at_s`` seconds after ``key`` is deleted; a thread."""

    def __init__(self, cluster: Any, how: str, key: str, at_s: float,
                 on_restart: Any = None) -> None:
        if how not in HOWS:
            raise ValueError(f"--leader-change {how!r}: one of {', '.join(HOWS)}")
        self.cluster, self.how, self.key, self.at_s = cluster, how, key, at_s
        self.on_restart = on_restart   # called with the restarted member (its priority)
        self.killed_at: float | None = None
        self._out: dict[str, Any] = {"leader_change": how}
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="leader-change")

    def start(self) -> LeaderChange:
        self._thread.start()
        return self

    def wait(self, timeout: float = 60.0) -> None:
        """Until the change is over (a restarted member serves its ``/metrics`` again)."""
        if self._thread.ident is not None:
            self._done.wait(timeout)

    def row(self, timeout: float = 60.0) -> dict[str, Any]:
        """What happened (the benchmark's row); stops waiting if the key never went."""
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout)
        else:   # the run ended before the kill
            self._out["leader_change_error"] = "the run ended before the node was killed"
        return dict(self._out)

    def _run(self) -> None:
        try:
            self._change()
        except Exception as exc:   # noqa: BLE001 - reported in the row, the run goes on
            self._out["leader_change_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()
        # a member restarted here dies with the thread that started it (LocalEtcd's
        # PR_SET_PDEATHSIG is per thread): the thread lives until the run asks for the row
        self._stop.wait()

    def _change(self) -> None:
        from chameleon_elastic.rendezvous.client import EtcdClient
        from chameleon_elastic.rendezvous.config import EtcdSettings

        settings = EtcdSettings.from_config(self.cluster.endpoints, {"retry_timeout": "30"})
        with EtcdClient(settings) as client:
            while client.call("poll", lambda c: c.get(self.key))[0] is not None:
                if self._stop.wait(_POLL_S):
                    self._out["leader_change_error"] = "the lost node's key never went"
                    return
        gone = time.monotonic()
        self._stop.wait(max(0.0, gone + self.at_s - time.monotonic()))
        old, term = self.cluster.leader_claim()
        began = time.monotonic()
        if self.how == "move":
            _, new = self.cluster.move_leader()
        else:
            self.cluster.restart(old)
            if self.on_restart is not None:
                self.on_restart(self.cluster.members[old])
            new = self.cluster.leader()
        self._out.update({
            "leader_change_after_loss_s": round(began - gone, 3),
            "leader_change_after_kill_s": (None if self.killed_at is None
                                           else round(began - self.killed_at, 3)),
            "leader_change_took_s": round(time.monotonic() - began, 3),
            "leader_before": old, "leader_after": new,
            "term_before": term, "term_after": self.cluster.term(new),
        })
