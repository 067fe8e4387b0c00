"""A c10d ``Store`` on etcd v3, so no key-value store has to live inside a training process.

Keys live under ``<key_prefix>/<run_id>/store/``; values are raw bytes. The operations follow
``TCPStore``'s semantics:

- ``set``/``multi_set``: one put / one transaction;
- ``get``/``multi_get``: wait until the keys exist (up to the store timeout), then read;
- ``add``: integer counter, updated by compare-and-set on the key's mod revision (retried on
  contention), returns the new value; applied exactly once even when etcd's reply is lost
  (``append`` too: :meth:`EtcdStore._once`);
- ``compare_set(key, expected, desired)``: one transaction; writes ``desired`` when the value
  equals ``expected`` (or the key is absent and ``expected`` is empty) and returns the value
  now stored, else returns the current value (``expected`` when the key is absent). Against
  a large value the store read, the revision is compared (the value stays out of etcd's
  size-limited request);
- ``wait``: reads the missing keys at revision R, then watches the first missing key from
  R + 1, so a put that races with the read is never missed; a broken watch (etcd restart) just
  re-reads and re-watches. Timeout -> :class:`EtcdStoreTimeoutError` (a ``DistStoreError``).
  A wait that times out keeps its watch (one per store): a caller that waits in slices for
  the same key (a quick round's followers, checking a lease between slices) then costs etcd
  nothing per slice, where a read, a watch created and one cancelled per slice made 3000
  requests a second at 1024 agents. No event on the kept watch means the key is still
  missing, so the next slice skips the read; a wait for anything else cancels it. A watch
  whose last event put the one key waited for ends the wait without a read (the event says
  the key is there), and a ``get`` of that key right after (the same thread's next call on the
  store) returns the value the event carried, without a request: a quick round's followers
  wait for the agreement and read it, one read per follower saved (4096 per round at 4096
  nodes; the value crossed the wire once either way);
- ``check``, ``delete_key``, ``num_keys`` (keys of this store), ``append``;
- every request retries etcd's transient failures (``client.classify``) for ``retry_timeout``,
  or until the deadline of the round it is made in (:meth:`EtcdStore.retrying_until`): a leader
  change or a member restart during a recovery round makes the agents wait, bounded by the
  round, instead of failing.

etcd refuses a transaction of more than ``--max-txn-ops`` operations (128 by default), so reads
and writes of more keys (a thousand nodes' reports) go in transactions of at most
``MAX_TXN_OPS``: each is atomic, the whole is not (no caller needs more: the keys read were
waited for, and the keys written belong to one writer).

What torch does with it (torch 2.13): ``DynamicRendezvousHandler`` wraps this store in a
``PrefixStore("torch.rendezvous.<run_id>.<round>")`` and hands it to the agents, which use it
for ``RendezvousStoreInfo`` (MASTER_ADDR/MASTER_PORT, written by group rank 0), role/rank
assignment (``set``/``multi_get``/``multi_set``/``get``) and the exit barrier (``add``/``set``/
``wait``). Workers do NOT use it: by default (``use_agent_store``) the rank-0 *agent* hosts a
``TCPStore`` server and workers connect to MASTER_ADDR:MASTER_PORT; with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` the rank-0 *worker* hosts it instead. A worker that
should bootstrap from etcd builds ``EtcdStore`` itself and passes it to
``init_process_group(store=...)``.

Limit of torch's Python-store bridge: through a ``PrefixStore``, ``delete_key`` and
``num_keys`` hit pure-virtual C++ methods (torch's trampoline does not forward them); call them
on the ``EtcdStore`` directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from pyetcd import events as etcd_events
from pyetcd import transactions

from chameleon_elastic.rendezvous.client import EtcdClient, is_transient
from chameleon_elastic.rendezvous.errors import EtcdRendezvousError, EtcdStoreTimeoutError
from chameleon_elastic.rendezvous.pyetcd_compat import add_watch

__all__ = ["EtcdStore"]

log = logging.getLogger("chameleon_elastic.rendezvous.store")

_DEFAULT_TIMEOUT = timedelta(seconds=300)
#: a value at least this long, read by the store, is compared by its revision (compare_set)
_BY_REVISION = 64 * 1024
MAX_TXN_OPS = 128   # etcd's default --max-txn-ops


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i:i + MAX_TXN_OPS] for i in range(0, len(items), MAX_TXN_OPS)] or [items]


def _digest(value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=16).digest()


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class EtcdStore(dist.Store):
    """``torch.distributed.Store`` backed by etcd v3 (see the module docstring).

    Args:
        client: the shared connection.
        run_prefix: ``<key_prefix>/<run_id>/``.
        timeout: how long ``get``/``wait`` wait for missing keys (``set_timeout`` changes it).
    """

    def __init__(
        self,
        client: EtcdClient,
        run_prefix: str,
        timeout: timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = f"{run_prefix}store/"
        self._marks = f"{run_prefix}store-once/"
        self.set_timeout(timeout)
        self._kept: _Watch | None = None   # a timed-out wait's watch, for the next slice
        self._kept_lock = threading.Lock()
        #: per thread: (full key, value) a wait's watch just delivered, for the next get
        self._waited = threading.local()
        #: full key -> (digest, mod revision) of a large value this store read (compare_set)
        self._read: dict[str, tuple[bytes, int]] = {}

    @property
    def prefix(self) -> str:
        return self._prefix

    def retrying_until(self, deadline: float) -> contextlib.AbstractContextManager[None]:
        """Inside the block, this thread's store calls retry etcd's transient failures (a
        leader change, a member restarting, an overloaded cluster) until ``deadline``
        (``time.monotonic()``) rather than for ``retry_timeout``: a round's agreement
        (launcher/coordination/agreement.py) bounds its requests by its own deadline."""
        return self._client.retrying_until(deadline)

    def _key(self, key: str) -> str:
        """The full key. Every call on the store but ``num_keys`` names its keys here first,
        which ends what a wait left for the next ``get`` (``_take_waited``): only a get that
        comes right after the wait may read the watch's value instead of etcd."""
        self._waited.value = None
        return self._prefix + key

    def _take_waited(self, key: str) -> bytes | None:
        """The value the watch of this thread's last call, a wait for ``key``, delivered."""
        seen, self._waited.value = getattr(self._waited, "value", None), None
        return seen[1] if seen is not None and seen[0] == self._prefix + key else None

    def set(self, key: str, value: str | bytes) -> None:
        data, full = _to_bytes(value), self._key(key)
        self._client.call("store set", lambda c: c.put(full, data))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        puts = [transactions.Put(self._key(k), _to_bytes(v)) for k, v in zip(keys, values)]
        for chunk in _chunks(puts):
            self._client.call("store multi_set", lambda c, ops=chunk: c.transaction([], ops, []))

    def get(self, key: str) -> bytes:
        seen = self._take_waited(key)
        return seen if seen is not None else self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Read first, wait only for what is missing: a key usually exists when it is read
        (a quick round's followers read the decision right after its marker woke them, a
        thousand at once at 1024 nodes), so a check before every read was a request
        wasted."""
        full = [self._key(k) for k in keys]
        deadline = self._deadline(None)
        gets = [transactions.Get(k) for k in full]
        while True:
            found = [kvs[0] if kvs else None for chunk in _chunks(gets)
                     for kvs in self._client.call(
                         "store get", lambda c, ops=chunk: c.transaction([], ops, []))[1]]
            if all(f is not None for f in found):
                for key, (value, meta) in zip(full, found):   # type: ignore[misc]
                    self._note_read(key, value, meta.mod_revision)
                return [bytes(value) for value, _ in found]  # type: ignore[misc]
            self._wait_full([k for k, f in zip(full, found) if f is None], deadline)

    def _note_read(self, full: str, value: bytes, revision: int) -> None:
        """Remember a large value's revision, for a compare-and-set against it."""
        if len(value) >= _BY_REVISION:
            self._read[full] = (_digest(value), revision)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)

        def bump(client: Any) -> tuple[list, Any, int]:
            value, meta = client.get(full)
            if value is None:
                return [transactions.Create(full) == 0], transactions.Put(full, str(amount)), \
                    int(amount)
            try:
                current = int(bytes(value))
            except ValueError as exc:
                raise EtcdRendezvousError(
                    f"store add({key!r}) found a non-integer value {bytes(value)[:40]!r}; "
                    "add only works on keys written by add (or set to a decimal integer)."
                ) from exc
            new = current + int(amount)
            return [transactions.Mod(full) == meta.mod_revision], transactions.Put(full, str(new)), \
                new

        return int(self._once("store add", bump))

    def append(self, key: str, value: str | bytes) -> None:
        full, data = self._key(key), _to_bytes(value)

        def extend(client: Any) -> tuple[list, Any, int]:
            old, meta = client.get(full)
            if old is None:
                return [transactions.Create(full) == 0], transactions.Put(full, data), 0
            return ([transactions.Mod(full) == meta.mod_revision],
                    transactions.Put(full, bytes(old) + data), 0)

        self._once("store append", extend)

    def _once(self, what: str, update: Callable[[Any], tuple[list, Any, int]]) -> int:
        """Apply a read-modify-write exactly once. ``update(client)`` reads and returns the
        compare, the put and the result; the transaction that applies the put also writes a
        marker unique to this call, and a retry reads it first. Why: a transient error may
        strike after etcd applied the transaction (its leader killed mid-call), and the client
        retries the call; a second ``add`` counted one agent twice in torch's exit barrier,
        whose last member must count exactly to the world size, and every agent then waited
        out the barrier's timeout. Contention (the compare failing) just reads again."""
        marker = f"{self._marks}{uuid.uuid4().hex}"   # outside the store's keys (num_keys)
        tries = 0

        def attempt(client: Any) -> int | None:
            nonlocal tries
            tries += 1
            if tries > 1:
                done, _ = client.get(marker)
                if done is not None:   # applied; its reply was lost
                    return int(bytes(done))
            compare, put, result = update(client)
            ok, _ = client.transaction(compare, [put, transactions.Put(marker, str(result))],
                                       [])
            return result if ok else None

        while True:
            result = self._client.call(what, attempt)
            if result is not None:
                break
        try:
            self._client.call(what, lambda c: c.delete(marker), timeout=0.0)
        except Exception as exc:  # noqa: BLE001 - a marker left behind costs a few bytes
            log.debug("store marker %s left behind: %s", marker, exc)
        return result

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's compare-and-set. Against a large value this store read, etcd compares
        the key's revision instead of the value: the value then stays out of the request,
        which etcd limits (1.5 MiB by default, ``--max-request-bytes``): the plan record at
        131072 devices is 1.1 MB, sent twice by a value compare."""
        full, want, new = self._key(key), _to_bytes(expected), _to_bytes(desired)

        def cas(client: Any) -> bytes | None:
            known = self._read.get(full)
            by_revision = known is not None and known[0] == _digest(want)
            ok, responses = client.transaction(
                [transactions.Mod(full) == known[1] if by_revision  # type: ignore[index]
                 else transactions.Value(full) == want],
                [transactions.Put(full, new)],
                [transactions.Get(full)],
            )
            if ok:
                self._read.pop(full, None)
                return new
            found = responses[0] if responses else []
            if found:
                value, meta = bytes(found[0][0]), found[0][1]
                if by_revision and value == want:   # rewritten with the same bytes: again
                    self._note_read(full, value, meta.mod_revision)
                    return None
                return value
            if want:
                return want  # absent key, non-empty expectation: TCPStore returns expected
            ok, responses = client.transaction(
                [transactions.Create(full) == 0],
                [transactions.Put(full, new)],
                [transactions.Get(full)],
            )
            if ok:
                return new
            found = responses[0] if responses else []
            return bytes(found[0][0]) if found else None  # deleted again: retry

        while True:
            result = self._client.call("store compare_set", cas)
            if result is not None:
                return result

    def check(self, keys: list[str]) -> bool:
        full = [self._key(k) for k in keys]
        return not self._missing(full)[0]

    def delete_key(self, key: str) -> bool:
        full = self._key(key)
        return bool(self._client.call("store delete", lambda c: c.delete(full)))

    def num_keys(self) -> int:
        response = self._client.call(
            "store num_keys", lambda c: c.get_prefix_response(self._prefix, count_only=True)
        )
        return int(response.count)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_full([self._key(k) for k in keys], self._deadline(timeout))

    def has_extended_api(self) -> bool:
        return True

    # -- waiting --------------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None) -> float:
        span = self.timeout if timeout is None else timeout
        seconds = span.total_seconds()
        return time.monotonic() + (seconds if seconds > 0 else float("inf"))

    def _missing(self, full: list[str], serializable: bool = False,
                 values: bool = False) -> tuple[list[str], int, dict[str, bytes]]:
        """The keys absent, a revision at or before which each was seen absent (the earliest
        chunk's: a watch from there misses no put, at worst wakes once for nothing), and with
        ``values`` the values of those present. ``serializable``: answered by the member the
        client talks to, without asking the leader (see ``_wait_full``)."""
        answers = [self._missing_chunk(list(chunk), serializable, values)
                   for chunk in _chunks(full)]
        return ([k for missing, _, _ in answers for k in missing],
                min(revision for _, revision, _ in answers),
                {k: v for _, _, found in answers for k, v in found.items()})

    def _missing_chunk(self, full: list[str], serializable: bool,
                       values: bool) -> tuple[list[str], int, dict[str, bytes]]:
        request = _presence_request(full, serializable, values)

        def read(client: Any) -> tuple[list[str], int, dict[str, bytes]]:
            # A txn answers all reads at one revision. pyetcd's public ``transaction`` drops
            # the response header (the revision the watch must start after), hence the stub.
            response = client.kvstub.Txn(
                request,
                client.timeout,
                credentials=client.call_credentials,
                metadata=client.metadata,
            )
            answers = [answer.response_range for answer in response.responses]
            missing = [key for key, answer in zip(full, answers) if answer.count == 0]
            found = {key: bytes(answer.kvs[0].value) for key, answer in zip(full, answers)
                     if values and answer.kvs}
            return missing, int(response.header.revision), found

        return self._client.call("store check", read)

    def _wait_full(self, full: list[str], deadline: float) -> None:
        while True:
            watch = self._take_kept(full)
            if watch is not None and watch.fired.is_set():   # written between two slices
                watch.cancel()
                if watch.written:
                    self._waited.value = (watch.key, watch.value)
                    return
                watch = None
            if watch is not None:
                missing = [watch.key]
            else:
                # Serializable: a member behind the leader may call a key absent that is there,
                # and the watch from its revision then delivers that put. A linearizable read
                # cost the members nearly what a put does (the leader confirms itself first:
                # 0.7 against 0.24 ms; docs/rendezvous.md, *Serializable waits*). A single
                # key's value comes with the read: the get that follows the wait (every
                # follower reads the decision) then needs neither a request nor a leader.
                missing, revision, found = self._missing(full, serializable=True,
                                                         values=len(full) == 1)
                if not missing:
                    if found:
                        self._waited.value = next(iter(found.items()))
                    return
            remaining = deadline - time.monotonic()
            if remaining > 0 and watch is None:
                watch = self._watch(missing[0], revision + 1)
                if watch is None:   # compacted revision or similar: read again
                    time.sleep(min(0.1, remaining))
                    continue
            if remaining > 0 and watch.fired.wait(remaining):
                watch.cancel()
                if watch.written and full == [watch.key]:   # the one key waited for is there
                    self._waited.value = (watch.key, watch.value)
                    return
                continue   # another key may still be missing, or the watch broke: read again
            if watch is not None:
                self._keep(watch)
            raise EtcdStoreTimeoutError(
                f"Timed out waiting for store key(s) {[k[len(self._prefix):] for k in missing]}"
                f" under {self._prefix}: nobody set them before the store timeout "
                f"({self.timeout}). A peer is missing or failed; check the other agents' "
                "logs, or raise the timeout (--rdzv-conf read_timeout=SECONDS)."
            )

    def _take_kept(self, full: list[str]) -> _Watch | None:
        """The kept watch when it watches the one key waited for (not fired: the key is still
        missing), else None (cancelling a kept watch of another key)."""
        with self._kept_lock:
            watch, self._kept = self._kept, None
        if watch is not None and full != [watch.key]:
            watch.cancel()
            return None
        return watch

    def _keep(self, watch: _Watch) -> None:
        with self._kept_lock:
            old, self._kept = self._kept, watch
        if old is not None:
            old.cancel()

    def _watch(self, key: str, start_revision: int) -> _Watch | None:
        """A watch on ``key`` from ``start_revision``; None when etcd refused it for a reason
        a new read settles (a compacted revision)."""
        fired = threading.Event()
        seen: dict[str, Any] = {"written": False, "value": None}

        def on_event(response: object) -> None:
            events = getattr(response, "events", None)
            if events:   # the key's last event: a put (it is there) or a delete
                seen["written"] = isinstance(events[-1], etcd_events.PutEvent)
                seen["value"] = bytes(events[-1].value) if seen["written"] else None
            fired.set()  # an event or an error: either way, the wait is over or reads again

        def create(client: Any) -> Any:
            return add_watch(client, key, on_event, start_revision=start_revision)

        try:
            handle = self._client.call("store wait", create)
        except EtcdRendezvousError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                return None
            raise
        return _Watch(key, fired, handle, seen)


class _Watch:
    """One etcd watch of a store wait: ``fired`` once anything came on it; ``written`` when
    the last event on it was a put of the key (so the key exists: no read needed, which
    spared a transaction per waiting agent, 4096 per quick round at 4096 nodes)."""

    def __init__(self, key: str, fired: threading.Event, handle: Any,
                 seen: dict[str, Any]) -> None:
        self.key, self.fired, self._handle = key, fired, handle
        self._seen = seen

    @property
    def written(self) -> bool:
        return self._seen["written"]

    @property
    def value(self) -> bytes | None:
        """The value the last put carried (when ``written``)."""
        return self._seen["value"]

    def cancel(self) -> None:
        """Cancel on the stream that holds the watch (pyetcd_compat.add_watch): after a
        fail-over, a cancel by number went to the new stream and cancelled another watch."""
        try:
            self._handle.cancel()
        except Exception:  # the stream may be gone already (etcd restart)
            log.debug("cancelling a store watch failed", exc_info=True)


def _presence_request(keys: list[str], serializable: bool = False, values: bool = False) -> Any:
    """One unconditional txn that says whether each key is there (count_only unless
    ``values``: then the values travel too), built from pyetcd's public protobuf messages
    rather than its private request builders. etcd serves a txn of serializable ranges from
    the member asked, without the leader."""
    from pyetcd import etcdrpc

    ranges = [
        etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
            key=k.encode(), count_only=not values, serializable=serializable))
        for k in keys
    ]
    return etcdrpc.TxnRequest(compare=[], success=ranges, failure=[])
