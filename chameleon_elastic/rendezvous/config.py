"""Connection settings of the etcd v3 rendezvous, resolved once and validated up front.

Sources, strongest first: an explicit argument, ``--rdzv-conf key=value`` (torch's
``RendezvousParameters`` config), an environment variable ``CHAMELEON_ETCD_<KEY>``, the default.
``--rdzv-endpoint`` takes one or more ``host:port`` client endpoints of the same etcd cluster,
separated by commas (an ``http://``/``https://`` scheme is accepted and ignored: TLS is on
exactly when ``cacert`` is given).

Every check that can fail is done here, before any connection: endpoint syntax, that TLS files
exist and hold PEM data, that ``user`` and ``password`` come together, that numbers are
positive. A bad value raises :class:`EtcdConfigError` naming the option and the fix.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chameleon_elastic.rendezvous.errors import EtcdConfigError

__all__ = ["DEFAULT_ETCD_PORT", "DEFAULT_KEY_PREFIX", "EtcdSettings", "parse_endpoints"]

DEFAULT_ETCD_PORT = 2379
DEFAULT_KEY_PREFIX = "/chameleon/rdzv"
_ENV_PREFIX = "CHAMELEON_ETCD_"
_RUN_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``"h1:2379,https://h2:2379,h3"`` -> ``(("h1", 2379), ("h2", 2379), ("h3", 2379))``."""
    endpoints: list[tuple[str, int]] = []
    for raw in (part.strip() for part in (text or "").split(",")):
        if not raw:
            continue
        item = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", "", raw).rstrip("/")
        host, port = item, DEFAULT_ETCD_PORT
        if item.startswith("["):  # [ipv6]:port
            close = item.find("]")
            host, rest = item[1:close], item[close + 1 :]
            if rest.startswith(":"):
                port = _parse_port(rest[1:], raw)
        elif item.count(":") == 1:
            host, port_text = item.split(":")
            port = _parse_port(port_text, raw)
        if not host:
            raise EtcdConfigError(
                f"--rdzv-endpoint entry {raw!r} has no host. Give the etcd client URL(s) as "
                "host:port, comma-separated for a cluster, e.g. 10.0.0.1:2379,10.0.0.2:2379."
            )
        if not _is_host(host):
            raise EtcdConfigError(
                f"--rdzv-endpoint entry {raw!r} is not host:port ({host!r} is neither a host "
                "name nor an IP address). Give the etcd client URL(s) as host:port, "
                "comma-separated for a cluster, e.g. 10.0.0.1:2379,10.0.0.2:2379."
            )
        endpoints.append((host, port))
    if not endpoints:
        raise EtcdConfigError(
            "--rdzv-endpoint is empty, but the etcd-v3 rendezvous needs the client endpoint(s) of "
            "an etcd cluster. Pass e.g. --rdzv-endpoint 10.0.0.1:2379 (comma-separated for "
            "several members)."
        )
    return tuple(endpoints)


#: one label of a host name (RFC 1123, with the underscore that container names carry)
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def _is_host(host: str) -> bool:
    """A host name of dot-separated labels, or an IPv4/IPv6 address: what a resolver can look
    up. Checked here so that a stray word (``'^step +15'`` pasted from a log) is refused at
    once rather than after ``connect_timeout`` of failed lookups."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_LABEL.match(label) for label in labels)


def _parse_port(text: str, raw: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise EtcdConfigError(
            f"--rdzv-endpoint entry {raw!r} has an invalid port {text!r}. Use host:port with a "
            "port between 1 and 65535 (etcd's client port is 2379 by default)."
        )
    return port


def _read_pem(option: str, path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    try:
        head = file.read_bytes()[:65536]
    except OSError as exc:
        raise EtcdConfigError(
            f"--rdzv-conf {option}={path}: the file cannot be read ({exc.strerror or exc}). "
            f"Point {option} at a readable PEM file (the etcd cluster's CA for cacert, this "
            "client's certificate and private key for cert/key)."
        ) from exc
    if b"-----BEGIN " not in head:
        raise EtcdConfigError(
            f"--rdzv-conf {option}={path}: the file is not PEM (no '-----BEGIN' line). Use the "
            "PEM-encoded certificate / key that etcd was configured with, not DER or another "
            "format (convert with `openssl x509 -inform der -in F -out F.pem`)."
        )
    return str(file)


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is, how to authenticate, and how long to wait and retry.

    Attributes:
        endpoints: ``(host, port)`` of every client endpoint of one etcd cluster.
        cacert, cert, key: PEM file paths; TLS is used when ``cacert`` is set, and mutual TLS
            when ``cert`` and ``key`` are set too.
        user, password: etcd RBAC credentials (both or neither).
        key_prefix: root of our keys; each run lives under ``<key_prefix>/<run_id>/``.
        lease_ttl: seconds a node's liveness key outlives its last keep-alive.
        rpc_timeout: seconds for one etcd request.
        retry_timeout: seconds to keep retrying while no endpoint answers (an etcd restart or a
            leader election) before raising :class:`EtcdConnectionError`.
        connect_timeout: seconds the first contact may take before a clear error (a wrong
            endpoint should fail fast, not after ``retry_timeout``); by default 10, or
            ``read_timeout`` when that is smaller.
    """

    endpoints: tuple[tuple[str, int], ...]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    key_prefix: str = DEFAULT_KEY_PREFIX
    lease_ttl: int = 5
    rpc_timeout: float = 5.0
    retry_timeout: float = 60.0
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise EtcdConfigError("EtcdSettings needs at least one endpoint (host, port).")
        object.__setattr__(self, "cacert", _read_pem("cacert", self.cacert))
        object.__setattr__(self, "cert", _read_pem("cert", self.cert))
        object.__setattr__(self, "key", _read_pem("key", self.key))
        if (self.cert is None) != (self.key is None):
            raise EtcdConfigError(
                "--rdzv-conf: cert and key must be given together (the client certificate and "
                "its private key for mutual TLS); pass both, or neither for server-only TLS."
            )
        if self.cert is not None and self.cacert is None:
            raise EtcdConfigError(
                "--rdzv-conf: cert/key were given without cacert. TLS needs the CA that signed "
                "the etcd server's certificate: add cacert=/path/to/ca.pem."
            )
        if (self.user is None) != (self.password is None):
            raise EtcdConfigError(
                "--rdzv-conf: user and password must be given together (etcd RBAC credentials); "
                "pass both, e.g. user=trainer,password=..., or neither when auth is disabled."
            )
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise EtcdConfigError(
                f"--rdzv-conf key_prefix={self.key_prefix!r} must start with '/' and not end with "
                f"it, e.g. key_prefix={DEFAULT_KEY_PREFIX}."
            )
        if self.lease_ttl < 1:
            raise EtcdConfigError(
                f"--rdzv-conf lease_ttl={self.lease_ttl} must be a whole number of seconds >= 1 "
                "(etcd leases have one-second granularity)."
            )
        for name in ("rpc_timeout", "retry_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise EtcdConfigError(
                    f"--rdzv-conf {name}={getattr(self, name)} must be a positive number of "
                    "seconds."
                )

    @property
    def secure(self) -> bool:
        return self.cacert is not None

    @property
    def endpoint_text(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def run_prefix(self, run_id: str) -> str:
        """``<key_prefix>/<run_id>/``: every key of one run lives below it."""
        if not run_id or not _RUN_ID.match(run_id):
            raise EtcdConfigError(
                f"run id {run_id!r} cannot be used in an etcd key. Use --rdzv-id with letters, "
                "digits, '.', '_' or '-' only (e.g. --rdzv-id job-42)."
            )
        return f"{self.key_prefix}/{run_id}/"

    @classmethod
    def from_config(
        cls,
        endpoint: str,
        config: Mapping[str, object] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> EtcdSettings:
        """Build settings from an endpoint string and ``--rdzv-conf`` style options."""
        config = dict(config or {})
        environ = os.environ if environ is None else environ

        def pick(key: str) -> str | None:
            value = config.get(key)
            if value is None or value == "":
                value = environ.get(_ENV_PREFIX + key.upper())
            return None if value is None or value == "" else str(value)

        def number(key: str, default: float, kind: type = float) -> float:
            text = pick(key)
            if text is None:
                return default
            try:
                return kind(text)
            except ValueError as exc:
                raise EtcdConfigError(
                    f"--rdzv-conf {key}={text!r} is not a {'whole ' if kind is int else ''}"
                    f"number; give seconds, e.g. {key}={kind(default)}."
                ) from exc

        defaults = cls.__dataclass_fields__
        # The first contact gives up by read_timeout when that is shorter (torch's c10d
        # backend bounds its connect by read_timeout); an explicit connect_timeout wins.
        connect_default = defaults["connect_timeout"].default
        read_timeout = number("read_timeout", 60, int)  # checked again by the handler
        if read_timeout > 0:
            connect_default = min(connect_default, float(read_timeout))
        return cls(
            endpoints=parse_endpoints(endpoint),
            cacert=pick("cacert"),
            cert=pick("cert"),
            key=pick("key"),
            user=pick("user"),
            password=pick("password"),
            key_prefix=pick("key_prefix") or DEFAULT_KEY_PREFIX,
            lease_ttl=int(number("lease_ttl", defaults["lease_ttl"].default, int)),
            rpc_timeout=number("rpc_timeout", defaults["rpc_timeout"].default),
            retry_timeout=number("retry_timeout", defaults["retry_timeout"].default),
            connect_timeout=number("connect_timeout", connect_default),
        )
