"""The etcd-v3 backend beyond torch's contract: fencing tokens are etcd revisions, foreign
tokens never match, state survives an etcd restart. The contract itself (CAS semantics, racing
writers, corrupt state) is in test_rdzv_backend_contract.py."""

from __future__ import annotations

import pytest

from chameleon_elastic.rendezvous.backend import EtcdV3RendezvousBackend

pytestmark = pytest.mark.timeout(60)


def test_token_is_the_fencing_revision(etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    _, token, _ = backend.set_state(b"v1")
    _, newer, ok = backend.set_state(b"v2", token)
    assert ok and isinstance(newer, int) and newer > token
    # any later write to the cluster (even elsewhere) only makes the next token larger
    etcd_client.call("put", lambda c: c.put(run_prefix + "unrelated", b"x"))
    _, newest, ok = backend.set_state(b"v3", newer)
    assert ok and newest > newer + 1


def test_foreign_token_never_matches(etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    assert backend.set_state(b"x", b"not-a-revision") is None
    _, token, _ = backend.set_state(b"v1")
    assert backend.set_state(b"v2", b"opaque") == (b"v1", token, False)


def test_key_lives_under_the_run_prefix(etcd_client, etcd_settings) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-a"))
    assert backend.key.startswith(etcd_settings.key_prefix + "/job-a/")
    assert backend.name == "etcd-v3"


def test_state_survives_etcd_restart(etcd_server, etcd_client, run_prefix) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, run_prefix)
    _, token, _ = backend.set_state(b"before")
    etcd_server.restart()
    assert backend.get_state() == (b"before", token)
    _, _, ok = backend.set_state(b"after", token)
    assert ok
