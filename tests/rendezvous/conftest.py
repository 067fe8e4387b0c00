"""Fixtures for the etcd v3 rendezvous tests: a real etcd on free loopback ports, always stopped."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
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
