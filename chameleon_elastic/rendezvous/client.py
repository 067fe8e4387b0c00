"""One resilient etcd v3 connection shared by the backend, the store and the liveness watcher.

``pyetcd`` (etcd-sdk-python) does one gRPC request per call and never retries. Two of its
defaults also defeat a restart of etcd: an endpoint that fails once is shunned for 300 s, and an
auth token obtained at connect time dies with the server's memory. :class:`EtcdClient` fixes
both and adds the retry policy the rendezvous needs:

- every request goes through :meth:`EtcdClient.call`, which sorts each failure with
  :func:`classify`, the one rule of this package (docs/rendezvous.md, *Errors*, gives it with
  the reasons): a member that cannot serve (down, unreachable, no leader, no answer in time)
  is left for another member; a cluster that answers but is changing its leader ("leader
  changed", "raft proposal dropped") or is overloaded ("too many requests") is asked again on
  the same connection after a back-off, so that its watches stay; an expired auth token is
  renewed; anything else (bad credentials, a request etcd refuses) is raised at once. Retries
  go on until the caller's deadline: ``retry_timeout``, or the deadline of the round the call
  is made in (:meth:`EtcdClient.retrying_until`), then :class:`EtcdConnectionError`. gRPC's own
  reconnect back-off is capped at 1 s so a restarted server is found within about a second;
- an expired/unknown auth token (``invalid auth token``, e.g. after etcd restarted) rebuilds the
  underlying client, which authenticates again, and the request is retried;
- bad credentials and missing permissions are not transient: :class:`EtcdAuthError` at once;
- endpoints of a cluster fail over in turn: after a member's failure the next attempt goes to
  another member (an endpoint that failed is tried again after 0.2 s), so a dead member or one
  without a leader costs one attempt, not the retry deadline. Only the endpoint the failed
  attempt used is marked, and only once: on a client shared by threads, every thread's error
  marked whichever member was in use by then, and all three were soon marked at once.

The first contact (the constructor, ``verify=True``) only waits ``connect_timeout``, so a wrong
``--rdzv-endpoint`` or a TLS mismatch is reported in seconds, in one sentence that names the
endpoints, what came back and the fix (chameleon-run prints it without a traceback). A request
that is retried after a lost reply may have been applied once already: callers use
compare-and-set transactions (the backend) or accept at-least-once (``Store.add``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions

from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdRendezvousError,
)
from chameleon_elastic.rendezvous.pyetcd_compat import (
    Etcd3Client,
    drop_cached_stubs,
    is_failed_node_error,
)

__all__ = ["BUSY", "ETCD_FAILURES", "FATAL", "LEADER", "MEMBER", "TOKEN", "EtcdClient", "classify",
           "is_transient"]

log = logging.getLogger("chameleon_elastic.rendezvous.connection")

T = TypeVar("T")

_ENDPOINT_RETRY_S = 0.2
_BACKOFF_START_S = 0.02
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
#: what a call to etcd can raise: our errors, gRPC's, pyetcd's (for ``except`` clauses)
ETCD_FAILURES: tuple[type[BaseException], ...] = (
    EtcdRendezvousError,
    grpc.RpcError,
    etcd_exceptions.Etcd3Exception,
    ValueError,
)

# -- what a failed request means: the one rule (docs/rendezvous.md, *Errors*, says why) ------

#: this member cannot serve now (down, unreachable, cut off from the leader, no answer within
#: rpc_timeout): the next attempt goes to another member
MEMBER = "member"
#: the cluster answered, but it is changing its leader; any member would say the same for a
#: moment: ask again on the same connection (its watches stay) after a short back-off
LEADER = "leader"
#: the cluster answered, but it is overloaded: ask again on the same connection, backing off
#: longer, so that a thousand agents' retries do not keep it overloaded
BUSY = "busy"
#: etcd forgot our auth token (it restarted): log in again, then retry
TOKEN = "token"
#: a retry cannot cure it (credentials, permissions, a request etcd refuses, no space): raise
FATAL = "fatal"

_LEADER_DETAILS = ("leader changed", "raft proposal dropped", "previous leader failure")
_BUSY_DETAILS = ("too many requests", "applied index took too long")
_MEMBER_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
}
# under UNKNOWN, which etcd uses for raft's errors; "context deadline exceeded": the member's
# own deadline for a linearizable read ran out waiting for a leader (a majority lost)
_MEMBER_DETAILS = ("no leader", "timed out", "context deadline exceeded")
_MEMBER_PYETCD = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
    etcd_exceptions.InternalServerError,
    etcd_exceptions.WatchTimedOut,
)
#: back-off cap per kind: a leader change is over in about a second; an overloaded cluster
#: needs its queue drained more than it needs our next attempt
_BACKOFF_MAX_S = {MEMBER: 0.5, LEADER: 0.5, BUSY: 2.0, TOKEN: 0.5}


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc`` (pyetcd raises its own types inside ``except RpcError``)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _code_and_details(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    rpc = _rpc_error(exc)
    if rpc is None:
        return None, ""
    try:
        return rpc.code(), (rpc.details() or "")  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # a half-built RpcError
        return None, ""


def _details(exc: BaseException) -> str:
    rpc = _rpc_error(exc)
    if rpc is not None:
        try:
            return f"{rpc.code().name}: {rpc.details()}"  # type: ignore[attr-defined]
        except (AttributeError, ValueError):  # a half-built RpcError
            return str(rpc)
    return str(exc) or type(exc).__name__


def classify(exc: BaseException) -> str:
    """What a failed etcd request means: :data:`MEMBER`, :data:`LEADER`, :data:`BUSY`,
    :data:`TOKEN` or :data:`FATAL` (see their comments; docs/rendezvous.md, *Errors*)."""
    code, details = _code_and_details(exc)
    if _auth_problem(exc) is not None:
        return FATAL
    if _is_token_expired(exc):
        return TOKEN
    if any(d in details for d in _LEADER_DETAILS):   # UNAVAILABLE, or UNKNOWN (raft's text)
        return LEADER
    if any(d in details for d in _BUSY_DETAILS):     # RESOURCE_EXHAUSTED, UNAVAILABLE
        return BUSY
    if code in _MEMBER_CODES or (code == grpc.StatusCode.UNKNOWN
                                 and any(d in details for d in _MEMBER_DETAILS)):
        return MEMBER
    if code is None and (isinstance(exc, _MEMBER_PYETCD) or is_failed_node_error(exc)):
        return MEMBER
    return FATAL


def is_transient(exc: BaseException) -> bool:
    """True for failures a retry may cure (:func:`classify` says anything but FATAL)."""
    return classify(exc) != FATAL


def _connect_reason(details: str) -> str:
    """gRPC's connect failure without its wrapping: "UNAVAILABLE: failed to connect to all
    addresses; last error: UNKNOWN: ipv4:127.0.0.1:2399: Socket closed" -> "Socket closed"."""
    reason = details.rsplit("last error: ", 1)[-1]
    return re.sub(r"^[A-Z_]+: (ipv[46]:\S+?:\d+: )?", "", reason).strip() or details


def _is_token_expired(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    if rpc is None:
        return False
    try:
        return rpc.code() == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in (
            rpc.details() or ""
        )
    except (AttributeError, ValueError):
        return False


def _auth_problem(exc: BaseException) -> str | None:
    rpc = _rpc_error(exc)
    if rpc is None:
        return None
    try:
        code, details = rpc.code(), (rpc.details() or "")
    except (AttributeError, ValueError):
        return None
    if "authentication failed" in details or "invalid user" in details:
        return "bad credentials"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return "permission denied"
    if "authentication is not enabled" in details:
        return "auth disabled"
    if "user name is empty" in details or "user name not found" in details:
        return "no user"
    return None


def _fail_over(client: pyetcd.MultiEndpointEtcd3Client, used: Any, exc: BaseException) -> None:
    """Make the next attempt go to another member of the cluster than ``used``, the endpoint
    the failed attempt went to.

    Only a member's own failure (:data:`MEMBER`) moves the client: pyetcd's moved it on every
    UNAVAILABLE, "leader changed" included (pyetcd_compat). Only ``used`` is marked, and only
    when it is still in use and not marked already: another thread sharing the client may have
    moved it meanwhile, and marking the member in use by then failed a healthy one (with 256
    agents on a client, every member was soon marked and most attempts reached no etcd at
    all). One member alone has nowhere to go, and "no server available" means every member is
    already marked.
    """
    if len(client.endpoints) < 2 or isinstance(exc, etcd_exceptions.NoServerAvailableError):
        return
    if used is None or client.endpoint_in_use is not used or used.is_failed():
        return
    used.fail()
    drop_cached_stubs(client)  # cached stubs use the old channel


class EtcdClient:
    """A thread-safe, self-healing handle on one etcd cluster (see the module docstring)."""

    def __init__(self, settings: EtcdSettings, *, verify: bool = True) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: pyetcd.MultiEndpointEtcd3Client | None = None
        self._closed = False
        self._rounds = threading.local()   # per thread: the deadline of the round it is in
        if verify:
            self._connect()

    def _connect(self) -> None:
        """First contact: a status probe retried until ``connect_timeout``, then one sentence.

        Every attempt's RPC deadline ends by then too, so an endpoint that accepts but never
        answers cannot stretch the wait by ``rpc_timeout``.
        """
        budget = self.settings.connect_timeout
        deadline = time.monotonic() + budget

        def probe(client: pyetcd.MultiEndpointEtcd3Client) -> Any:
            left = deadline - time.monotonic()
            return self._status(client, max(0.01, min(self.settings.rpc_timeout, left)))

        self.call("connect", probe, timeout=budget,
                  give_up=lambda exc: self._unreachable_error(exc, budget))

    @staticmethod
    def _status(client: pyetcd.MultiEndpointEtcd3Client, rpc_timeout: float | None = None) -> Any:
        return client.maintenancestub.Status(
            etcdrpc.StatusRequest(),
            client.timeout if rpc_timeout is None else rpc_timeout,
            credentials=client.call_credentials,
            metadata=client.metadata,
        )

    def status(self, timeout: float | None = None) -> Any:
        """The answering member's ``StatusResponse``, retried like every call.

        ``header.member_id`` is the member that answered, ``leader`` the member it follows
        (itself when it is the leader), ``raftTerm`` grows with every election.
        """
        return self.call("status", self._status, timeout=timeout)

    def _build(self) -> pyetcd.MultiEndpointEtcd3Client:
        s = self.settings
        creds = None
        if s.secure:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(s.cacert, s.key, s.cert)
        endpoints = [
            pyetcd.Endpoint(
                host,
                port,
                secure=s.secure,
                creds=creds,
                time_retry=_ENDPOINT_RETRY_S,
                opts=_GRPC_OPTIONS,
            )
            for host, port in s.endpoints
        ]
        try:
            client = Etcd3Client(   # pyetcd's, less its own fail-over (pyetcd_compat)
                endpoints=endpoints,
                timeout=s.rpc_timeout,
                user=s.user,
                password=s.password,
                failover=True,
            )
            if not s.secure:
                # gRPC refuses call credentials on a plaintext channel; the auth token also
                # travels as plain metadata, which etcd accepts.
                client.call_credentials = None
            return client
        except BaseException:
            for endpoint in endpoints:
                endpoint.close()
            raise

    def client(self) -> pyetcd.MultiEndpointEtcd3Client:
        """The current pyetcd client (built, and authenticated, on first use)."""
        with self._lock:
            if self._closed:
                raise EtcdRendezvousError(
                    "This etcd connection was closed; create a new EtcdClient to talk to etcd "
                    "again."
                )
            if self._client is None:
                self._client = self._build()
            return self._client

    def _reset(self, stale: pyetcd.MultiEndpointEtcd3Client) -> None:
        with self._lock:
            if self._client is stale:
                self._client = None
        try:
            stale.close()
        except Exception:  # closing a broken channel must not mask the real error
            log.debug("closing a stale etcd client failed", exc_info=True)

    @contextlib.contextmanager
    def retrying_until(self, deadline: float) -> Iterator[None]:
        """Inside the block, this thread's calls without a ``timeout`` of their own retry
        transient failures until ``deadline`` (``time.monotonic()``) instead of for
        ``retry_timeout``: a round bounds its own requests, so that a leader change or an
        overloaded cluster makes its agents wait as long as the round may last, and no longer.
        """
        before = getattr(self._rounds, "deadline", None)
        self._rounds.deadline = deadline
        try:
            yield
        finally:
            self._rounds.deadline = before

    def _deadline(self, timeout: float | None) -> tuple[float, str]:
        """(when a call gives up, what that deadline is, for the message)."""
        if timeout is not None:
            return time.monotonic() + timeout, f"{timeout:g} s"
        deadline = getattr(self._rounds, "deadline", None)
        if deadline is not None:
            return deadline, "the round's deadline"
        retry = self.settings.retry_timeout
        return time.monotonic() + retry, f"the retry deadline (retry_timeout={retry:g} s)"

    def call(
        self,
        what: str,
        fn: Callable[[pyetcd.MultiEndpointEtcd3Client], T],
        *,
        timeout: float | None = None,
        give_up: Callable[[BaseException], EtcdConnectionError] | None = None,
    ) -> T:
        """Run ``fn(client)``, retrying transient failures (:func:`classify`) until the
        deadline: ``timeout`` when given, else the round's (:meth:`retrying_until`), else
        ``retry_timeout``. At the deadline raise ``give_up(last error)``, by default a
        connection error naming ``what``."""
        deadline, patience = self._deadline(timeout)
        backoff = _BACKOFF_START_S
        last: BaseException | None = None  # the last error of a member, for the message
        while True:
            current: pyetcd.MultiEndpointEtcd3Client | None = None
            used = None
            try:
                current = self.client()
                used = current.endpoint_in_use
                return fn(current)
            except EtcdRendezvousError:
                raise
            except Exception as exc:
                problem = _auth_problem(exc)
                if problem is not None:
                    raise self._auth_error(problem, what) from exc
                kind = classify(exc)
                if kind == FATAL:
                    raise
                if current is not None and kind == TOKEN:
                    self._reset(current)
                elif current is not None and kind == MEMBER:
                    _fail_over(current, used, exc)
                if last is None or not isinstance(exc, etcd_exceptions.NoServerAvailableError):
                    last = exc  # "every member marked failed" hides why they failed
                if time.monotonic() >= deadline:
                    if give_up is None:
                        raise self._connection_error(what, last, patience) from last
                    # The message already carries the gRPC status and details; chaining the
                    # gRPC exception only adds ~20 lines of grpc internals to torchrun's
                    # traceback, which prints the whole chain of an uncaught error.
                    raise give_up(last) from None
                log.debug("etcd %s failed (%s: %s); retrying", what, kind, _details(exc))
                backoff = max(backoff, _BACKOFF_START_S * 10) if kind == BUSY else backoff
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())) * random.uniform(0.5, 1))
            backoff = min(backoff * 2, _BACKOFF_MAX_S[kind])

    def _connection_error(self, what: str, exc: BaseException,
                          patience: str) -> EtcdConnectionError:
        s = self.settings
        if classify(exc) in (LEADER, BUSY):   # it answered: the cluster, not the connection
            return EtcdConnectionError(
                f"etcd {what} failed: the cluster at {s.endpoint_text} answered but could not "
                f"serve it within {patience} (last answer: {_details(exc)}: it was changing "
                "its leader or overloaded, for longer than that); give etcd's members their "
                "own cores and a fast disk, or raise --rdzv-conf retry_timeout=SECONDS."
            )
        hint = (
            " With TLS, also check that cacert is the CA that signed the server's certificate, "
            "that the certificate names the host you connect to, and that cert/key match."
            if s.secure
            else " If the cluster uses TLS (https client URLs), pass cacert=... in --rdzv-conf."
        )
        return EtcdConnectionError(
            f"etcd {what} failed: no endpoint of {s.endpoint_text} answered within {patience} "
            f"(last error: {_details(exc)}). Check --rdzv-endpoint (the host:port of "
            f"etcd's client URLs, comma-separated) and that etcd is running and reachable.{hint}"
        )

    def _unreachable_error(self, exc: BaseException, waited: float) -> EtcdConnectionError:
        """One sentence: where, for how long, what came back, and what to do about it."""
        s = self.settings
        detail = _connect_reason(_details(exc))
        retry = "or raise --rdzv-conf connect_timeout=SECONDS if etcd is still starting"
        if "connection refused" in detail.lower():
            seen = "connection refused: nothing listens there"
            fix = (
                "start etcd there, point --rdzv-endpoint at the client URLs of a running etcd "
                f"cluster (host:port, comma-separated), {retry}"
            )
        elif s.secure:
            seen = f"the TLS connection failed: {detail}"
            fix = (
                "check that cacert is the CA that signed the server's certificate, that the "
                "certificate names the host you connect to and that cert/key match, point "
                f"--rdzv-endpoint at etcd's client URLs, {retry}"
            )
        else:
            seen = f"something listens there but did not answer as etcd: {detail}"
            fix = (
                "point --rdzv-endpoint at etcd's client URLs (host:port, port 2379 unless "
                "configured otherwise), pass cacert=... in --rdzv-conf if they are https, "
                f"{retry}"
            )
        return EtcdConnectionError(
            f"no etcd answered at {s.endpoint_text} within {waited:g} s ({seen}); {fix}."
        )

    def _auth_error(self, problem: str, what: str) -> EtcdAuthError:
        s = self.settings
        messages = {
            "bad credentials": (
                f"etcd at {s.endpoint_text} rejected user {s.user!r}: the user name or password "
                "is wrong. Fix user/password in --rdzv-conf (or CHAMELEON_ETCD_USER / "
                "CHAMELEON_ETCD_PASSWORD)."
            ),
            "permission denied": (
                f"etcd at {s.endpoint_text} denied {what} to user {s.user!r}. Grant the user's "
                f"role readwrite on the prefix {s.key_prefix}/ (etcdctl role grant-permission "
                f"ROLE --prefix=true readwrite {s.key_prefix}/)."
            ),
            "auth disabled": (
                f"user/password were given but etcd at {s.endpoint_text} has authentication "
                "disabled. Drop user/password from --rdzv-conf, or enable auth on the cluster "
                "(etcdctl auth enable)."
            ),
            "no user": (
                f"etcd at {s.endpoint_text} requires authentication for {what}. Pass "
                "user=...,password=... in --rdzv-conf."
            ),
        }
        return EtcdAuthError(messages[problem])

    def close(self) -> None:
        with self._lock:
            current, self._client, self._closed = self._client, None, True
        if current is not None:
            try:
                current.close()
            except Exception:
                log.debug("closing the etcd client failed", exc_info=True)

    def __enter__(self) -> EtcdClient:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
