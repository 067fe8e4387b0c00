"""Prometheus metrics and Kubernetes-style probes of one agent (``--metrics-port``).

What is measured, and from where. The agent already knows everything an operator asks about;
this module only keeps it in Prometheus form, in a registry of its own (no global state, so
two agents in one process, as in tests, never share a series):

- events (``observe``, fed by the event log): ``recovered`` gives
  ``chameleon_recoveries_total{mode,cause}`` and one ``chameleon_recovery_seconds{phase}``
  observation per phase it timed; ``failure_seen`` of kind ``fenced`` drops
  ``chameleon_lease_ok`` to 0 and the next ``rendezvous`` raises it again;
- the agent's tick (``tick``): the plan in force (``chameleon_plan_generation``,
  ``chameleon_live_devices``) and the steps its runtime workers committed, read from the node's
  channel (``steps/<card>``: the last step and the times of the recent ones, sent by each
  worker's beat thread, so a step costs the worker no round trip). A node's step count is the
  highest step any of its workers committed: a step trained again after a rollback is not
  counted twice, and every node of a job counts the same steps.

The HTTP server answers ``/metrics`` (Prometheus text), ``/healthz`` (200 while the agent runs:
its process answers) and ``/readyz`` (200 while this node's workers train under the current
generation, 503 during a transition). It is a daemon thread of the agent's process, bound to
``--metrics-address`` (loopback by default: metrics are opt-in and stay local unless asked).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from chameleon_elastic import channel

from .reporter import RECOVERY_PHASES

__all__ = ["AgentMetrics", "MetricsServer"]


_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class AgentMetrics:
    """One agent's series, in a registry of its own."""

    def __init__(self, hang_timeout_s: float) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("chameleon_steps", "Training steps committed by this node's "
                             "workers (each step counted once)", registry=r)
        self.step_seconds = Histogram("chameleon_step_seconds", "Seconds per committed step, "
                                      "as the node's workers measured them",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.recoveries = Counter("chameleon_recoveries", "Recoveries finished on this node",
                                  ["mode", "cause"], registry=r)
        self.recovery_seconds = Histogram("chameleon_recovery_seconds", "Seconds per phase of "
                                          "a recovery (phase=total: failure to the first "
                                          "new step committed)", ["phase"],
                                          buckets=_RECOVERY_BUCKETS, registry=r)
        self.live_devices = Gauge("chameleon_live_devices", "Devices of the plan in force "
                                  "(the job's, not only this node's)", registry=r)
        self.generation = Gauge("chameleon_plan_generation", "Plan generation in force",
                                registry=r)
        self.hang_timeout = Gauge("chameleon_hang_timeout_seconds", "Seconds without progress "
                                  "before a worker is declared hung (0: off)", registry=r)
        self.lease_ok = Gauge("chameleon_lease_ok", "1 while this node holds its rendezvous "
                              "lease (etcd-v3; always 1 with other backends), 0 once fenced",
                              registry=r)
        self.hang_timeout.set(hang_timeout_s)
        self.lease_ok.set(1)
        self._last_step = -1

    def observe(self, record: dict[str, Any]) -> None:
        """One event-log record (observe.EventLog calls it for every record)."""
        event = record.get("event")
        if event == "recovered":
            self.recoveries.labels(mode=record.get("mode") or "unknown",
                                   cause=record.get("reason") or "unknown").inc()
            for phase in (*RECOVERY_PHASES, "total"):
                seconds = record.get(f"{phase}_s")
                if seconds is not None:
                    self.recovery_seconds.labels(phase=phase).observe(max(0.0, float(seconds)))
        elif event == "failure_seen" and record.get("kind") == "fenced":
            self.lease_ok.set(0)
        elif event == "rendezvous":
            self.lease_ok.set(1)

    def tick_agent(self, store: Any, cards: Iterable[int], session: Any, attempt: int,
                   workers: list[Any]) -> None:
        """:meth:`tick` from an agent's state: the plan generation and live devices of its job
        (``session``), else torchrun's restart attempt and world size."""
        if session is not None:
            generation, live = session.plan.generation, len(session.plan.live_devices)
        else:
            generation, live = max(attempt, 0), workers[0].world_size if workers else None
        self.tick(store, cards, generation, live)

    def tick(self, store: Any, cards: Iterable[int], generation: int,
             live_devices: int | None) -> None:
        """The plan in force and the steps committed since the last tick."""
        self.generation.set(generation)
        if live_devices is not None:
            self.live_devices.set(live_devices)
        if store is None:
            return
        recent: dict[int, float] = {}
        for card in cards:
            recent.update(channel.recent_steps(store, card))
        for step in sorted(s for s in recent if s > self._last_step):
            self.steps.inc()
            self.step_seconds.observe(recent[step])
            self._last_step = step

    def text(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``address:port`` (port 0: any free one).
    ``ready`` answers ``/readyz``; it is the agent's, set once the agent exists (the port is
    bound before, so that a port in use is said before anything starts)."""

    def __init__(self, metrics: AgentMetrics, address: str, port: int) -> None:
        self.metrics = metrics
        self.ready: Callable[[], bool] = lambda: False
        handler = type("Handler", (_Handler,), {"served": self})
        self._server = http.server.ThreadingHTTPServer((address, port), handler)
        self._server.daemon_threads = True
        self.address, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="chameleon-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in str(self.address) else self.address
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    served: MetricsServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, self.served.metrics.text(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._answer(200, b"ok\n")
        elif path == "/readyz":
            ok = self.served.ready()
            self._answer(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
        else:
            self._answer(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _answer(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a line on the job's stderr."""
