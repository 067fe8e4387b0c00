"""--metrics-port: Prometheus text on /metrics and the probes, scraped over HTTP from a real run
of the tiny GPT with a kill -9; the event -> series mapping on its own."""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from chameleon_elastic import channel
from chameleon_elastic.launcher.observation.metrics import AgentMetrics, MetricsServer

from .conftest import free_port, two_device_job, wait_for

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value."""
    code, text = get(url + "/metrics")
    if code != 200:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_events_and_channel_become_series_in_a_registry_of_their_own():
    metrics, other = AgentMetrics(hang_timeout_s=7), AgentMetrics(hang_timeout_s=60)
    metrics.observe({"event": "recovered", "mode": "inplace", "reason": "device_lost",
                     "detect_s": 0.1, "regroup_s": 0.2, "transfer_s": None, "total_s": 0.5})
    metrics.observe({"event": "failure_seen", "kind": "fenced"})
    store = dist.HashStore()
    channel.write(store, channel.steps_key(0), {"recent": [[0, 0.2], [1, 0.3]]})
    channel.write(store, channel.steps_key(1), {"recent": [[1, 0.3], [2, 0.4]]})
    metrics.tick(store, [0, 1], generation=2, live_devices=3)
    metrics.tick(store, [0, 1], generation=2, live_devices=3)   # nothing new: nothing counted
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        series = scrape(server.url)
        assert series[("chameleon_steps_total", ())] == 3
        assert series[("chameleon_step_seconds_count", ())] == 3
        assert abs(series[("chameleon_step_seconds_sum", ())] - 0.9) < 1e-9
        key = ("chameleon_recoveries_total", (("cause", "device_lost"), ("mode", "inplace")))
        assert series[key] == 1
        phases = {dict(labels)["phase"] for name, labels in series
                  if name == "chameleon_recovery_seconds_count"}
        assert phases == {"detect", "regroup", "total"}
        assert series[("chameleon_plan_generation", ())] == 2
        assert series[("chameleon_live_devices", ())] == 3
        assert series[("chameleon_hang_timeout_seconds", ())] == 7
        assert series[("chameleon_lease_ok", ())] == 0
        assert get(server.url + "/healthz")[0] == 200
        assert get(server.url + "/readyz")[0] == 503    # no agent said it is ready
        server.ready = lambda: True
        assert get(server.url + "/readyz")[0] == 200
        assert get(server.url + "/nothing")[0] == 404
    finally:
        server.close()
    assert b"chameleon_steps_total 0.0" in other.text()   # nothing shared between agents
    metrics.observe({"event": "rendezvous"})
    assert b"chameleon_lease_ok 1.0" in metrics.text()


def _worker_of(launcher_pid: int, device: int) -> psutil.Process | None:
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if proc.environ().get("CHAMELEON_DEVICE") == str(device) and any(
                    "train_gpt.py" in part for part in proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


@pytest.mark.timeout(300)   # the tiny GPT with 2 workers: slow only on a crowded machine
def test_scrape_during_training_shows_steps_rising_and_one_recovery_after_a_kill(tmp_path,
                                                                                  launch):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # two replicas of the tiny GPT: one is killed, the other recovers in place and trains on
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "2", "--job",
                               str(two_device_job(tmp_path, replicas=True)),
                               "--metrics-port", str(port), "--state-dir", str(tmp_path / "s"),
                               GPT, "--steps", "24", "--precision", "fp32"])
    steps = "chameleon_steps_total", ()
    first = wait_for(lambda: scrape(url).get(steps, 0) >= 3, 150, "the first steps scraped")
    assert first
    before = scrape(url)[steps]
    wait_for(lambda: scrape(url).get(steps, 0) > before, 60, "steps_total rising")
    assert get(url + "/healthz")[0] == 200
    assert wait_for(lambda: get(url + "/readyz")[0] == 200, 30, "ready while training")
    victim = wait_for(lambda: _worker_of(run.proc.pid, 1), 10, "device 1's worker")
    os.kill(victim.pid, signal.SIGKILL)
    recovered = ("chameleon_recoveries_total", (("cause", "device_lost"), ("mode", "inplace")))
    wait_for(lambda: scrape(url).get(recovered) == 1, 60, "recoveries_total at 1 after the kill")
    series = scrape(url)
    assert series[("chameleon_live_devices", ())] == 1
    assert series[("chameleon_plan_generation", ())] == 1
    assert series[("chameleon_recovery_seconds_count", (("phase", "total"),))] == 1
    after = series[steps]
    wait_for(lambda: scrape(url).get(steps, 0) > after, 60, "steps_total rising after recovery")
    assert run.wait(120) == 0, run.log.read_text()[-2000:]
    assert "metrics on http://127.0.0.1" in run.log.read_text()
