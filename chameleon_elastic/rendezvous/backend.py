"""torch's ``RendezvousBackend`` on etcd v3: the rendezvous state behind one compare-and-set.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous (round, participants, wait list,
heartbeats) in one opaque blob. Every agent reads it (``get_state``), changes it locally and
writes it back (``set_state``) only if nobody wrote in between, retrying otherwise. Here:

- the blob lives at ``<key_prefix>/<run_id>/rdzv/state``;
- the fencing token is the key's ``mod_revision`` (an int, strictly increasing cluster-wide);
- ``set_state(state, token)`` is ONE etcd transaction: *if* ``mod_revision(key) == token``
  (or, without a token, *if* the key does not exist: ``create_revision == 0``) *then* put the
  new blob *else* read the current one. Of concurrent writers holding the same token exactly
  one wins; the others receive the winner's state and token in the same round trip;
- a retried transaction whose first attempt did land (reply lost in an etcd outage) reports
  failure with the state it wrote itself; the handler then simply re-reads and carries on,
  which its state machine is built for.

The blob is a pickle made by torch; this module never unpickles it (torch does). That is why
the run's prefix must be writable only by authenticated trainers: see docs/rendezvous.md.
"""

from __future__ import annotations

from typing import Any

from pyetcd import transactions
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from chameleon_elastic.rendezvous.client import EtcdClient

__all__ = ["EtcdV3RendezvousBackend"]


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
        value, meta = self._client.call("get rendezvous state", lambda c: c.get(self._key))
        if value is None:
            return None
        return bytes(value), int(meta.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            # Not one of ours (e.g. a token from another backend): it cannot match.
            current = self.get_state()
            return None if current is None else (*current, False)
        if token is None:
            compare = [transactions.Create(self._key) == 0]
        else:
            compare = [transactions.Mod(self._key) == token]

        def cas(client: Any) -> tuple[bool, list[Any], int]:
            succeeded, responses = client.transaction(
                compare=compare,
                success=[transactions.Put(self._key, state)],
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
        value, meta = found[0]
        return bytes(value), int(meta.mod_revision), False
