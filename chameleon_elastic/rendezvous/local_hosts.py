"""Several "hosts" on one machine: network namespaces joined by a bridge, for tests and benchmarks.

A kill cannot show what a partition does: a killed node resets its sockets, a cut-off node goes
silent. Each host here is a network namespace with its own address on a bridge in the root
namespace (which can also serve etcd on the bridge address), so cutting one host off is
``ip link set <its side of the veth> down`` and healing it is ``up``. Needs root and iproute2;
:func:`unavailable` says why not, for a skip. Like ``LocalEtcd`` this is never for production.

**Shaped links.** Loopback moves gigabytes a second with no latency, so a transfer costs
nothing there and the restorer's choices cannot show. With ``link=Link(rate_mbit, delay_ms)``
each host's veth is shaped on both ends (``tc``: an HTB class at the rate, a ``netem`` delay
under it): every byte a host sends or receives goes through its own link of that rate and
one-way delay, as through a host's NIC on a switch (the bridge). Traffic between two hosts
crosses both of their links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from types import TracebackType

__all__ = ["Host", "Link", "LocalHosts", "unavailable"]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)


def _tc(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "tc", *args], check=True, capture_output=True, timeout=10)


def unavailable(shaped: bool = False, delayed: bool = False) -> str | None:
    """Why network namespaces (``shaped``: and rate-limited links; ``delayed``: and delayed
    ones) cannot be used here, or None when they can."""
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
    if (shaped or delayed) and shutil.which("tc") is None:
        return "the tc command (iproute2) is missing: links cannot be shaped"
    for kind, wanted in (("htb", shaped or delayed), ("netem", delayed)):
        if wanted and not _has_qdisc(kind):
            return f"this kernel has no {kind} qdisc: links cannot be " + (
                "rate-limited" if kind == "htb" else "delayed")
    return None


def _has_qdisc(kind: str) -> bool:
    """Whether ``tc`` can attach a ``kind`` qdisc (tried on a throwaway veth)."""
    name = f"chq{os.getpid() % 100000}"
    try:
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    except (subprocess.CalledProcessError, OSError):
        return False
    try:
        _tc("qdisc", "add", "dev", name, "root", kind)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False
    finally:
        _ip("link", "del", name, check=False)


@dataclass(frozen=True)
class Link:
    """A host's link: ``rate_mbit`` megabits a second each way, ``delay_ms`` one-way delay
    (needs the kernel's ``netem`` qdisc, which the development machine's kernel lacks)."""

    rate_mbit: float
    delay_ms: float = 0.0

    def shape(self, dev: str, ns: str | None = None) -> None:
        """Shape the egress of ``dev``: an HTB class at the rate (burst-free: ``ceil`` is the
        rate), then the delay under it when there is one."""
        rate = f"{self.rate_mbit}mbit"
        _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
        _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
            "ceil", rate, ns=ns)
        if self.delay_ms:
            _tc("qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem",
                "delay", f"{self.delay_ms}ms", ns=ns)


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

    def __init__(self, count: int = 2, subnet: str | None = None,
                 link: Link | None = None) -> None:
        self.tag = f"ch{uuid.uuid4().hex[:5]}"
        self.link = link
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
                if self.link is not None:
                    self.link.shape(host.outside)
                    self.link.shape(host.inside, ns=host.ns)
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
