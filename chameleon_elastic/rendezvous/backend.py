"""torch's ``RendezvousBackend`` on etcd v3: the rendezvous state behind one compare-and-set.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous (round, participants, wait list,
heartbeats) in one opaque blob. Every agent reads it (``get_state``), changes it locally and
writes it back (``set_state``) only if nobody wrote in between, retrying otherwise. Here:

- the blob lives at ``<key_prefix>/<run_id>/rdzv/state``, framed (see below);
- the fencing token is the key's ``mod_revision`` (an int, strictly increasing cluster-wide);
- ``set_state(state, token)`` is ONE etcd transaction: *if* ``mod_revision(key) == token``
  (or, without a token, *if* the key does not exist: ``create_revision == 0``) *then* put the
  new blob *else* read the current one. Of concurrent writers holding the same token exactly
  one wins; the others receive the winner's state and token in the same round trip;
- a retried transaction whose first attempt did land (reply lost in an etcd outage) reports
  failure with the state it wrote itself; the handler then simply re-reads and carries on,
  which its state machine is built for.

Framing. torch's contract says a backend raises ``RendezvousStateError`` for corrupt state
(its c10d backend does, when base64 decoding fails); a bare blob cannot be told from garbage,
and torch would hand garbage to ``pickle.loads``. So the value in etcd is, big-endian::

    magic b"CHRZ" | format version (1 byte, now 1) | payload length (4 bytes)
    | blake2b-64 of (key, 0 byte, payload) (8 bytes) | payload (torch's blob)

17 bytes of overhead. A value without the magic (not written by this backend, e.g. a bare
pickle from a release before the framing), a truncated or altered one, one copied from another
run's key (the checksum covers the key), or one of another format version makes ``get_state``,
and ``set_state`` when it returns the current state, raise :class:`EtcdRendezvousStateError`
(a ``RendezvousStateError``) whose one sentence names the key and the fix. Nothing else reads
this key (the store and the liveness keys live under other prefixes of the run).

The payload is a pickle made by torch; this module never unpickles it (torch does), and the
checksum is no signature: the run's prefix must be writable only by authenticated trainers,
see docs/rendezvous.md.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from pyetcd import transactions
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.errors import EtcdRendezvousError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "EtcdRendezvousStateError",
    "EtcdV3RendezvousBackend",
    "decode_state",
    "encode_state",
]

#: first bytes of every value this backend writes
MAGIC = b"CHRZ"
#: layout of the value after MAGIC; bump it (and keep reading the old one) if it ever changes
FORMAT_VERSION = 1
_HEADER = struct.Struct(">4sBI")  # magic, format version, payload length
_DIGEST_SIZE = 8
_FRAME = _HEADER.size + _DIGEST_SIZE


class EtcdRendezvousStateError(EtcdRendezvousError, RendezvousStateError):
    """The value at the rendezvous state key was not written by this backend, or was damaged.

    Both a ``RendezvousStateError`` (torch's contract for corrupt state) and an
    :class:`EtcdRendezvousError` (so chameleon-run prints its one sentence, no traceback).
    """


def _digest(key: str, payload: bytes) -> bytes:
    check = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    check.update(key.encode())
    check.update(b"\0")
    check.update(payload)
    return check.digest()


def encode_state(key: str, state: bytes) -> bytes:
    """The value stored at ``key`` for torch's ``state`` (see "Framing" above)."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(state)) + _digest(key, state) + state


def _problem(key: str, value: bytes) -> str | None:
    """What is wrong with ``value`` as the framed state of ``key``, or None if nothing."""
    if value[: len(MAGIC)] != MAGIC[: len(value)]:
        if value[:1] == b"\x80":
            return ("holds a bare pickle, not framed state (written by a chameleon_elastic "
                    "release before the framing, or by another tool)")
        return "was not written by the etcd-v3 rendezvous backend (no format header)"
    if len(value) < _FRAME:
        return f"is truncated ({len(value)} bytes, shorter than its {_FRAME}-byte header)"
    _, version, length = _HEADER.unpack_from(value)
    if version != FORMAT_VERSION:
        return (f"has format version {version} (another chameleon_elastic release wrote it; "
                f"this one reads version {FORMAT_VERSION}, so run every agent of the job with "
                "the same release)")
    payload = value[_FRAME:]
    if len(payload) < length:
        return f"is truncated ({len(payload)} payload bytes, the header says {length})"
    if len(payload) > length:
        return f"has {len(payload) - length} bytes more than its header says ({length})"
    if value[_HEADER.size : _FRAME] != _digest(key, payload):
        return "fails its checksum (altered, or copied from another run's key)"
    return None


def decode_state(key: str, value: bytes) -> bytes:
    """torch's blob inside ``value`` read from ``key``.

    Raises:
        EtcdRendezvousStateError: ``value`` is not intact framed state of ``key``.
    """
    value = bytes(value)
    problem = _problem(key, value)
    if problem is not None:
        raise EtcdRendezvousStateError(
            f"The rendezvous state at etcd key {key} {problem}; delete the key "
            f"(etcdctl del {key}) or start the job with a fresh --rdzv-id."
        )
    return value[_FRAME:]


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd v3 with the key's mod revision as fencing token.

    Args:
        client: the shared connection.
        run_prefix: ``<key_prefix>/<run_id>/`` (see ``EtcdSettings.run_prefix``).
    """

    def __init__(self, client: EtcdClient, run_prefix: str) -> None:
        self._client = client
        self._key = f"{run_prefix}rdzv/state"

    @property
    def name(self) -> str:
        return "etcd-v3"

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """The current state and its token, None if there is none (see the module docstring).

        Raises:
            EtcdRendezvousStateError: the value at the key is not intact state of this run.
        """
        value, meta = self._client.call("get rendezvous state", lambda c: c.get(self._key))
        if value is None:
            return None
        return decode_state(self._key, value), int(meta.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Compare-and-set on the key's mod revision (see the module docstring).

        Raises:
            EtcdRendezvousStateError: the write was refused and the value found at the key is
                not intact state of this run.
        """
        if token is not None and not isinstance(token, int):
            # Not one of ours (e.g. a token from another backend): it cannot match.
            current = self.get_state()
            return None if current is None else (*current, False)
        if token is None:
            compare = [transactions.Create(self._key) == 0]
        else:
            compare = [transactions.Mod(self._key) == token]
        value = encode_state(self._key, bytes(state))

        def cas(client: Any) -> tuple[bool, list[Any], int]:
            succeeded, responses = client.transaction(
                compare=compare,
                success=[transactions.Put(self._key, value)],
                failure=[transactions.Get(self._key)],
            )
            revision = responses[0].response_put.header.revision if succeeded else 0
            return succeeded, responses, revision

        succeeded, responses, revision = self._client.call("set rendezvous state", cas)
        if succeeded:
            return state, int(revision), True
        found = responses[0] if responses else []
        if not found:
            return None
        current, meta = found[0]
        return decode_state(self._key, current), int(meta.mod_revision), False
