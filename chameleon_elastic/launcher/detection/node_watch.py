"""This agent's etcd lease, and what the leases say about the other nodes (``etcd-v3`` only).

Why leases: a node that dies or freezes stops refreshing its lease, and etcd deletes its key
``ttl`` seconds later, whatever the node's workers are doing. Its workers may be blocked rather
than failing (a frozen node resets no socket), so without the lease nothing would tell the
survivors' agents to re-plan until a collective timed out. torch's own keep-alive notices the
same node only when some agent runs a rendezvous operation.

Protocol (on top of ``rendezvous.liveness.NodeLiveness``):

- after its first rendezvous round every agent holds a lease under ``nodes/node-<id>``;
- ``left`` of another node, not finished: that node is lost; the agent starts a round, where the
  node's absence makes its devices lost (in place when the workers allow);
- a node that ends successfully first marks its key ``finished`` and then revokes the lease, so
  the others see it leave at once and know it is no loss;
- ``lease_lost`` of our own node (the lease expired, or no keep-alive succeeded for ``ttl``: we
  were partitioned or frozen): our plan may be stale, so the agent fences itself: its workers
  are SIGKILLed at once from the lease thread (the agent's loop may be blocked in an etcd call
  while cut off), and it rejoins through a new round, adopting the newest plan;
- ``lease_kept`` of our own node, after a ``lease_lost``: the loss was presumed because etcd
  could not answer (no leader for a while, a majority restarting), and etcd renewed the same
  lease once it answered again. The key never went, so no other node counted this one lost:
  a lost node is one whose lease etcd let expire, never one that etcd merely could not
  answer. ``on_kept`` says so (the agent's ``failure_seen`` of kind ``lease_kept``), but the
  fence stands: the workers were stopped when the loss was presumed (it had to be then: had
  etcd expired the lease, the others would be planning without this node), so the node
  rejoins through a full round as it would have anyway, and is not charged a crash.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

__all__ = ["NodeWatch"]

log = logging.getLogger("chameleon_elastic.launcher.detection.node_watch")


class NodeWatch:
    def __init__(self, params: RendezvousParameters, node: int,
                 on_fenced: Callable[[], None] | None = None,
                 on_kept: Callable[[], None] | None = None) -> None:
        """``on_fenced`` runs on the lease thread the moment our lease is presumed lost: the
        agent's own loop may be blocked in an etcd call it cannot finish while cut off.
        ``on_kept`` runs there when etcd renewed that same lease after all (module docstring)."""
        from chameleon_elastic.rendezvous.client import EtcdClient
        from chameleon_elastic.rendezvous.config import EtcdSettings
        from chameleon_elastic.rendezvous.liveness import NodeLiveness

        settings = EtcdSettings.from_config(params.endpoint, dict(params.config))
        self._client = EtcdClient(settings)
        self.node_id = f"node-{node}"
        self.ttl = settings.lease_ttl
        self.fenced = False   # our lease was lost since the last full round (rejoined())

        def on_event(event: Any) -> None:
            if event.node_id == self.node_id and event.kind == "lease_lost":
                self.fenced = True
                if on_fenced is not None:
                    on_fenced()
            elif event.node_id == self.node_id and event.kind == "lease_kept":
                log.warning("the lease of %s outlived etcd's trouble: etcd could not answer, "
                            "but it let the lease live, so no other node counted this one "
                            "lost; it rejoins through a full round, its workers stopped",
                            self.node_id)
                if on_kept is not None:
                    on_kept()

        self._live = NodeLiveness(self._client, settings.run_prefix(params.run_id),
                                  self.node_id, info={"node": node}, ttl=self.ttl,
                                  on_event=on_event)

    def start(self) -> NodeWatch:
        self._live.start()
        return self

    def changes(self) -> tuple[list[Mapping[str, Any]], bool]:
        """(infos of other nodes lost since the last call, whether our own lease was lost: a
        presumed loss counts even if etcd then kept the lease, ``lease_kept``, since the
        workers were stopped at the presumption)."""
        lost, fenced = [], False
        while True:
            try:
                event = self._live.events.get_nowait()
            except queue.Empty:
                return lost, fenced
            if event.node_id == self.node_id:
                fenced = fenced or event.kind == "lease_lost"
            elif event.kind == "left" and not event.info.get("finished"):
                lost.append({"node_id": event.node_id, **event.info})

    def alive(self) -> frozenset[int]:
        """Nodes holding their lease, as the watch last saw them (no etcd call). Not this one
        once its lease was lost, until a full round has readmitted it: the others counted it
        gone, so a quick round of its own would decide from a stale view."""
        nodes = self._live.numbers()
        return nodes - {int(self.node_id.split("-")[1])} if self.fenced else nodes

    def rejoined(self) -> None:
        self.fenced = False

    def finish(self) -> None:
        """Leave as a node that finished: the others must not count it as lost."""
        try:
            self._live.finish()
        finally:
            self._client.close()

    def close(self) -> None:
        try:
            self._live.stop()
        finally:
            self._client.close()
