"""torch's ``RendezvousBackend`` contract, checked on a real etcd.

``get_state`` -> ``(state, token)`` or None; ``set_state(state, token)`` is a compare-and-set
returning ``(state, token, succeeded)`` (the current state and token when it failed) or None;
both raise ``RendezvousStateError`` for a value the backend did not write or that was damaged.
Damaged values are written with a plain pyetcd client, as an operator or a bug would.
"""

from __future__ import annotations

import pickle
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyetcd
import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from chameleon_elastic.rendezvous.backend import (
    FORMAT_VERSION,
    MAGIC,
    EtcdV3RendezvousBackend,
    decode_state,
    encode_state,
)
from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.errors import EtcdRendezvousError, rendezvous_message

pytestmark = pytest.mark.timeout(30)

_HEADER = 4 + 1 + 4  # magic, version, payload length (the documented layout)
_FRAME = _HEADER + 8  # + blake2b-64 digest


@pytest.fixture
def raw(etcd_settings: EtcdSettings) -> Iterator[Any]:
    """A plain pyetcd client on the same server: writes bytes the backend did not frame."""
    host, port = etcd_settings.endpoints[0]
    client = pyetcd.client(host=host, port=port, timeout=5)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def backend(etcd_client: EtcdClient, run_prefix: str) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(etcd_client, run_prefix)


def _stored(raw: Any, backend: EtcdV3RendezvousBackend) -> bytes:
    value, _ = raw.get(backend.key)
    assert value is not None
    return bytes(value)


# -- compare-and-set semantics ---------------------------------------------------------------


def test_get_on_empty_key_is_none(backend) -> None:
    assert backend.get_state() is None


def test_set_without_token_creates_once(backend) -> None:
    state, token, ok = backend.set_state(b"first")
    assert ok and state == b"first" and isinstance(token, int)
    assert backend.get_state() == (b"first", token)
    # the key exists now: a second token-less write is refused and told the current state
    assert backend.set_state(b"second") == (b"first", token, False)


def test_set_with_current_token_succeeds_with_a_new_token(backend) -> None:
    _, token, _ = backend.set_state(b"v1")
    state, newer, ok = backend.set_state(b"v2", token)
    assert ok and state == b"v2" and newer != token
    assert backend.get_state() == (b"v2", newer)


def test_set_with_stale_token_fails_and_returns_current(backend) -> None:
    _, stale, _ = backend.set_state(b"v1")
    _, current, _ = backend.set_state(b"v2", stale)
    assert backend.set_state(b"late write", stale) == (b"v2", current, False)
    assert backend.get_state() == (b"v2", current)


def test_set_with_token_on_deleted_key_is_none(backend, raw) -> None:
    _, token, _ = backend.set_state(b"v1")
    raw.delete(backend.key)
    assert backend.set_state(b"v2", token) is None
    assert backend.get_state() is None


def test_state_round_trips_byte_for_byte(backend) -> None:
    blob = bytes(range(256)) * 800  # ~200 KB, every byte value
    _, token, _ = backend.set_state(blob)
    assert backend.get_state() == (blob, token)
    _, token, ok = backend.set_state(b"", token)
    assert ok and backend.get_state() == (b"", token)


def test_framing_costs_17_bytes(backend, raw) -> None:
    backend.set_state(b"x" * 1000)
    stored = _stored(raw, backend)
    assert len(stored) == 1000 + _FRAME
    assert stored[:4] == MAGIC and stored[4] == FORMAT_VERSION


def test_two_backends_racing_lose_no_update(etcd_settings, run_prefix) -> None:
    """Two agents (two connections) each add 1 to a counter 25 times by read-modify-write;
    every lost race is reported with the newer state, and no increment is lost."""
    rounds = 25
    clients = [EtcdClient(etcd_settings) for _ in range(2)]
    start = threading.Barrier(2)

    def bump(backend: EtcdV3RendezvousBackend) -> int:
        start.wait(timeout=10)
        losses = 0
        current = backend.get_state()
        for _ in range(rounds):
            while True:
                value = 0 if current is None else int(current[0])
                token = None if current is None else current[1]
                result = backend.set_state(str(value + 1).encode(), token)
                assert result is not None
                state, new_token, ok = result
                current = (state, new_token)
                if ok:
                    break
                losses += 1
                assert int(state) > value  # a loser learns the state as it is now
        return losses

    try:
        backends = [EtcdV3RendezvousBackend(c, run_prefix) for c in clients]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(bump, b) for b in backends]
            [f.result(timeout=25) for f in futures]  # re-raises a failed assertion
        final = backends[0].get_state()
        assert final is not None and int(final[0]) == 2 * rounds
        assert backends[1].get_state() == final
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("existing", [False, True])
def test_concurrent_writers_with_one_token_exactly_one_wins(
    etcd_settings, run_prefix, existing
) -> None:
    writers = 6
    clients = [EtcdClient(etcd_settings) for _ in range(writers)]
    try:
        backends = [EtcdV3RendezvousBackend(c, run_prefix) for c in clients]
        token = backends[0].set_state(b"base")[1] if existing else None
        barrier = threading.Barrier(writers)
        results: list[tuple[bytes, Any, bool] | None] = [None] * writers

        def write(i: int) -> None:
            barrier.wait(timeout=10)
            results[i] = backends[i].set_state(f"writer {i}".encode(), token)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert all(r is not None for r in results)
        winners = [i for i, r in enumerate(results) if r[2]]  # type: ignore[index]
        assert len(winners) == 1
        final = backends[0].get_state()
        assert final is not None and final[0] == f"writer {winners[0]}".encode()
        for r in results:  # every loser was told the winner's state and token
            assert (r[0], r[1]) == final  # type: ignore[index]
    finally:
        for client in clients:
            client.close()


# -- runs ------------------------------------------------------------------------------------


def test_another_run_is_not_visible(etcd_client, etcd_settings) -> None:
    a = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-a"))
    b = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-b"))
    _, token_a, _ = a.set_state(b"a-state")
    assert b.get_state() is None
    _, token_b, ok = b.set_state(b"b-state")
    assert ok and b.get_state() == (b"b-state", token_b)
    assert a.get_state() == (b"a-state", token_a)


def test_state_copied_from_another_run_is_refused(etcd_client, etcd_settings, raw) -> None:
    a = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-a"))
    b = EtcdV3RendezvousBackend(etcd_client, etcd_settings.run_prefix("job-b"))
    a.set_state(b"a-state")
    raw.put(b.key, _stored(raw, a))
    with pytest.raises(RendezvousStateError, match="checksum"):
        b.get_state()


# -- values the backend did not write, or that were damaged ----------------------------------


def _valid(key: str) -> bytes:
    return encode_state(key, pickle.dumps({"round": 3, "participants": ["n0", "n1"]}))


def _flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]


def _other_version(value: bytes, version: int) -> bytes:
    return value[:4] + struct.pack(">B", version) + value[5:]


BAD_VALUES = {
    "garbage": lambda key: b"definitely not rendezvous state",
    "bare torch pickle": lambda key: pickle.dumps({"round": 3}),
    "empty": lambda key: b"",
    "magic only": lambda key: MAGIC,
    "truncated header": lambda key: _valid(key)[: _FRAME - 1],
    "truncated payload": lambda key: _valid(key)[:-1],
    "extra byte": lambda key: _valid(key) + b"\0",
    "flipped payload byte": lambda key: _flip(_valid(key), _FRAME + 3),
    "flipped checksum byte": lambda key: _flip(_valid(key), _HEADER),
    "wrong version": lambda key: _other_version(_valid(key), FORMAT_VERSION + 1),
    "version zero": lambda key: _other_version(_valid(key), 0),
}

EXPECTED = {
    "garbage": "not written by",
    "bare torch pickle": "bare pickle",
    "empty": "truncated",
    "magic only": "truncated",
    "truncated header": "truncated",
    "truncated payload": "truncated",
    "extra byte": "bytes more than its header",
    "flipped payload byte": "checksum",
    "flipped checksum byte": "checksum",
    "wrong version": f"format version {FORMAT_VERSION + 1}",
    "version zero": "format version 0",
}


def _check_message(exc: BaseException, key: str) -> None:
    """One sentence naming the key and the fix; printed by chameleon-run without traceback."""
    message = str(exc)
    assert key in message and "--rdzv-id" in message and f"etcdctl del {key}" in message
    assert "\n" not in message and message.endswith(".")
    assert isinstance(exc, EtcdRendezvousError) and rendezvous_message(exc) == message


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_bad_value_raises_state_error_on_get(backend, raw, kind) -> None:
    raw.put(backend.key, BAD_VALUES[kind](backend.key))
    with pytest.raises(RendezvousStateError, match=EXPECTED[kind]) as caught:
        backend.get_state()
    _check_message(caught.value, backend.key)


@pytest.mark.parametrize("kind", ["garbage", "truncated payload", "flipped checksum byte",
                                  "wrong version"])
def test_bad_value_raises_state_error_when_set_fails(backend, raw, kind) -> None:
    _, token, _ = backend.set_state(b"v1")
    raw.put(backend.key, BAD_VALUES[kind](backend.key))  # moves the revision: token is stale
    with pytest.raises(RendezvousStateError, match=EXPECTED[kind]) as caught:
        backend.set_state(b"v2", token)
    _check_message(caught.value, backend.key)
    with pytest.raises(RendezvousStateError):  # no token: the key exists, the create fails
        backend.set_state(b"v2")
    with pytest.raises(RendezvousStateError):  # a foreign token: reads the current state
        backend.set_state(b"v2", b"opaque token")


def test_set_with_current_token_overwrites_a_bad_value(backend, raw) -> None:
    """The CAS compares revisions, not contents: whoever holds the current token may repair."""
    raw.put(backend.key, b"garbage")
    _, meta = raw.get(backend.key)
    _, token, ok = backend.set_state(b"repaired", int(meta.mod_revision))
    assert ok and backend.get_state() == (b"repaired", token)


def test_deleting_a_bad_value_starts_afresh(backend, raw) -> None:
    """The fix the message names works: after ``etcdctl del`` the rendezvous starts anew."""
    raw.put(backend.key, b"garbage")
    raw.delete(backend.key)
    assert backend.get_state() is None
    assert backend.set_state(b"fresh")[2]


def test_decode_inverts_encode_and_binds_the_key() -> None:
    for state in (b"", b"x", pickle.dumps(list(range(1000)))):
        assert decode_state("/k", encode_state("/k", state)) == state
    with pytest.raises(RendezvousStateError):
        decode_state("/other", encode_state("/k", b"x"))
