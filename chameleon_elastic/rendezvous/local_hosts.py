"""Several "hosts" on one machine: network namespaces joined by a bridge, for tests and benchmarks.

A kill cannot show what a partition does: a killed node resets its sockets, a cut-off node goes
silent. Each host here is a network namespace with its own address on a bridge in the root
namespace (which can also serve etcd on the bridge address), so cutting one host off is
``ip link set <its side of the veth> down`` and healing it is ``up``. Needs root and iproute2;
:func:`unavailable` says why not, for a skip. Like ``LocalEtcd`` this is never for production.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from types import TracebackType

__all__ = ["Host", "LocalHosts", "unavailable"]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"chprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns is not permitted here ({exc})"
    return None


@dataclass(frozen=True)
class Host:
    ns: str          # network namespace
    ip: str          # its address on the bridge
    inside: str      # its interface (GLOO_SOCKET_IFNAME)
    outside: str     # the bridge side of its link (cut here)

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.ns]


class LocalHosts:
    """``count`` hosts on a fresh bridge; ``bridge_ip`` is the root namespace's address."""

    def __init__(self, count: int = 2, subnet: str | None = None) -> None:
        self.tag = f"ch{uuid.uuid4().hex[:5]}"
        self.subnet = subnet or f"10.{88 + os.getpid() % 10}.{os.getpid() % 250}"
        self.bridge = f"{self.tag}br"
        self.bridge_ip = f"{self.subnet}.1"
        self.hosts: list[Host] = []
        self._count = count

    def start(self) -> LocalHosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self._count):
                host = Host(f"{self.tag}h{i}", f"{self.subnet}.{i + 2}", f"{self.tag}{i}i",
                            f"{self.tag}{i}o")
                _ip("netns", "add", host.ns)
                self.hosts.append(host)
                _ip("link", "add", host.outside, "type", "veth", "peer", "name", host.inside)
                _ip("link", "set", host.inside, "netns", host.ns)
                _ip("link", "set", host.outside, "master", self.bridge)
                _ip("link", "set", host.outside, "up")
                for args in (("addr", "add", f"{host.ip}/24", "dev", host.inside),
                             ("link", "set", host.inside, "up"), ("link", "set", "lo", "up")):
                    _ip("netns", "exec", host.ns, "ip", *args)
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, host: Host) -> None:
        _ip("link", "set", host.outside, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.outside, "up")

    def close(self) -> None:
        """Remove every namespace and the bridge (best effort: whatever was created goes)."""
        for host in self.hosts:
            _ip("netns", "del", host.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts = []

    def __enter__(self) -> LocalHosts:  # noqa: PYI034
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
