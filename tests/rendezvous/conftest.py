"""Fixtures for the etcd v3 rendezvous tests: a real etcd (one member or a cluster of three) on
free loopback ports, and real agent processes; all always stopped."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _rdzv_agents import Agents

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[LocalEtcd]:
    """A fresh single-member etcd with its data under tmp_path; stopped even if the test fails."""
    server = LocalEtcd(data_dir=tmp_path / "etcd-data")
    try:
        server.start()
        yield server
    finally:
        server.stop(kill=True)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    """A fresh three-member etcd cluster under tmp_path; every member stopped even on failure."""
    cluster = LocalEtcdCluster(members=3, work_dir=tmp_path / "etcd-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop(kill=True)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    """Agent processes of one test, with logs under tmp_path; all SIGKILLed at teardown."""
    logs = tmp_path / "logs"
    logs.mkdir()
    group = Agents(logs)
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture
def etcd_settings(etcd_server: LocalEtcd) -> EtcdSettings:
    return EtcdSettings.from_config(
        etcd_server.endpoint, {"retry_timeout": "20", "connect_timeout": "5"}
    )


@pytest.fixture
def etcd_client(etcd_settings: EtcdSettings) -> Iterator[EtcdClient]:
    client = EtcdClient(etcd_settings)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def run_prefix(etcd_settings: EtcdSettings) -> str:
    return etcd_settings.run_prefix(f"run-{uuid.uuid4().hex[:8]}")
