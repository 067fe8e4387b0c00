"""A several-member etcd cluster on loopback, to test what survives etcd itself failing.

Production runs etcd as three (or five) members so that losing one, the leader included,
loses nothing: the others elect a new leader within about an election timeout (1 s by
default) and clients move to a live member. :class:`LocalEtcdCluster` reproduces that on one
machine: N :class:`~chameleon_elastic.rendezvous.local_etcd.LocalEtcd` members, each with its
own data directory and its own client and peer ports on one host (127.0.0.1 by default), all
started with an ``--initial-cluster`` that names every member.

- ``start()`` spawns every member first and only then waits: a member of a new cluster is
  healthy only once a quorum runs, so waiting for the first one alone would never end. It
  returns once every member answers ``/health`` (which etcd reports true only with a leader)
  and one member reports itself leader, all polled with one deadline.
- ``leader()`` asks each running member for its status (etcd's maintenance ``Status`` RPC,
  through :class:`~chameleon_elastic.rendezvous.client.EtcdClient`) and returns the index of
  the member that reports *itself* as the leader, in the highest term if two do; a follower
  that has not yet noticed a dead leader still names the old one, so only the leader's own
  word counts.
- ``move_leader(to)`` asks the leader to hand leadership to another member (etcd's maintenance
  ``MoveLeader``, what ``etcdctl move-leader`` sends): a leader change on demand, with every
  member up, as etcd makes one when its leader is starved or restarted; in-flight proposals
  fail with "etcdserver: leader changed" (tests/rendezvous/test_rdzv_leader_change.py,
  benchmarks/coordination_scale.py ``--leader-change``);
- ``kill(i)`` SIGKILLs member i (a crash: no clean hand-over of leadership), ``restart(i)``
  starts it again on the same data directory and ports and waits until it is healthy, which
  needs a quorum of the *other* members to be up.
- ``stop()`` stops every member, each reaped even when another fails to stop; members are
  SIGKILLed by the kernel if the thread that started them exits (``PR_SET_PDEATHSIG``, as for
  ``LocalEtcd``).

Like ``LocalEtcd`` this is for development, tests and benchmarks, never production.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from chameleon_elastic.rendezvous.errors import EtcdServerError
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd, find_etcd_binary

__all__ = ["LocalEtcdCluster"]

_LEADER_POLL_S = 0.05
_STATUS_RPC_S = 1.0


def _distinct_free_ports(count: int) -> list[int]:
    """``count`` different free loopback ports (held open together, so none repeats)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


class LocalEtcdCluster:
    """``members`` etcd members on one host forming one cluster; a context manager.

    Args:
        members: how many members (3 tolerates the loss of one, 5 of two).
        work_dir: parent of the members' data directories and logs; a fresh temporary
            directory (removed on ``cleanup()``) when omitted.
        startup_timeout: seconds ``start()`` and ``restart()`` wait for health and a leader.
        binary: the etcd binary (default: ``find_etcd_binary()``).
        host: the address clients reach the members on (see ``LocalEtcd``).
    """

    def __init__(
        self,
        members: int = 3,
        work_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        binary: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if members < 1:
            raise EtcdServerError(f"A cluster needs at least one member, not {members}.")
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="chameleon-etcd-cluster-"))
        self.startup_timeout = startup_timeout
        binary = binary or find_etcd_binary()
        ports = _distinct_free_ports(2 * members)
        names = [f"member{i}" for i in range(members)]
        initial = ",".join(
            f"{name}=http://127.0.0.1:{ports[2 * i + 1]}" for i, name in enumerate(names)
        )
        self.members = [
            LocalEtcd(
                data_dir=self.work_dir / name / "data",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                startup_timeout=startup_timeout,
                binary=binary,
                name=name,
                initial_cluster=initial,
                host=host,
            )
            for i, name in enumerate(names)
        ]

    @property
    def endpoints(self) -> str:
        """Every member's ``host:port``, comma-separated: the value for ``--rdzv-endpoint``."""
        return ",".join(member.endpoint for member in self.members)

    def running(self) -> list[int]:
        """Indexes of the members whose process is alive."""
        return [i for i, member in enumerate(self.members) if member.is_running()]

    def start(self) -> LocalEtcdCluster:
        """Start every member that is not running; return once all are healthy with a leader."""
        deadline = time.monotonic() + self.startup_timeout
        try:
            for member in self.members:
                member.start(wait=False)
            for member in self.members:
                member.wait_healthy(max(0.1, deadline - time.monotonic()))
            self.leader(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop(kill=True)
            raise
        return self

    def member_id(self, index: int, timeout: float = 5.0) -> int:
        """etcd's numeric id of member ``index`` (it must be running)."""
        return int(self.status(index, timeout).header.member_id)

    def term(self, index: int, timeout: float = 5.0) -> int:
        """The raft term member ``index`` is in; every election raises it."""
        return int(self.status(index, timeout).raftTerm)

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the member that reports itself leader, polled until ``timeout`` seconds."""
        return self.leader_claim(timeout)[0]

    def leader_claim(self, timeout: float = 10.0) -> tuple[int, int]:
        """The leader's index and the term it claims to lead, from one status answer.

        A term read apart, after ``leader()``, may already be the next one's: a busy machine
        misses a heartbeat, the members elect again, and the index read before is a follower
        in that new term (a full test run: the member killed next was no longer leader, and
        the survivor's term equalled the "old" one). A leader whose followers all died still
        claims the role until it steps down, about an election timeout later (etcd's
        check-quorum). Raises EtcdServerError if no running member is leader by then (no
        majority runs).
        """
        deadline = time.monotonic() + timeout
        last_error = "no member answered"
        while True:
            claims: dict[int, int] = {}  # member index -> the term it claims to lead
            for index in self.running():
                try:
                    status = self.status(index, _STATUS_RPC_S)
                except Exception as exc:  # noqa: BLE001 - a member just killed, or starting
                    last_error = f"member{index}: {exc}"
                    continue
                if status.leader and status.leader == status.header.member_id:
                    claims[index] = int(status.raftTerm)
            if claims:  # a deposed leader that missed the election claims an older term
                return max(claims.items(), key=lambda claim: claim[1])
            if time.monotonic() >= deadline:
                raise EtcdServerError(
                    f"No member of the local etcd cluster ({self.endpoints}) reported itself "
                    f"leader within {timeout:.0f} s (running: {self.running()}; last error: "
                    f"{last_error}); a majority of members must run for a leader to exist, "
                    "so restart the stopped ones."
                )
            time.sleep(_LEADER_POLL_S)

    def status(self, index: int, timeout: float = 5.0) -> Any:
        """etcd's ``StatusResponse`` of member ``index``, asked of that member alone.

        ``header.member_id`` is its id, ``leader`` the id of the leader it follows, ``raftTerm``
        its term. Raises EtcdConnectionError if it does not answer within ``timeout``.
        """
        # imported here: the helper itself needs no gRPC until someone asks for a status
        from chameleon_elastic.rendezvous.client import EtcdClient
        from chameleon_elastic.rendezvous.config import EtcdSettings

        member = self.members[index]
        settings = EtcdSettings(
            endpoints=((member.host, member.client_port),),
            rpc_timeout=min(timeout, _STATUS_RPC_S),
            retry_timeout=timeout,
            connect_timeout=timeout,
        )
        with EtcdClient(settings, verify=False) as client:
            return client.status(timeout=timeout)

    def move_leader(self, to: int | None = None, timeout: float = 10.0) -> tuple[int, int]:
        """Make the leader step down in favour of member ``to`` (default: the next running
        member); returns (old leader, new leader) once ``to`` reports itself leader.

        A leader change on demand, every member up: what etcd does by itself when its leader
        is starved of CPU or restarted, so that tests and benchmarks can place one inside a
        recovery round. Raises EtcdServerError if ``to`` is the leader already, or is not
        leader within ``timeout``.
        """
        from pyetcd import etcdrpc

        from chameleon_elastic.rendezvous.client import EtcdClient
        from chameleon_elastic.rendezvous.config import EtcdSettings

        deadline = time.monotonic() + timeout
        old = self.leader(timeout)
        running = self.running()
        target = running[(running.index(old) + 1) % len(running)] if to is None else to
        if target == old:
            raise EtcdServerError(f"member{target} is the leader already: nothing to move.")
        target_id = self.member_id(target, timeout)
        member = self.members[old]   # only the leader may hand its role over
        settings = EtcdSettings(endpoints=((member.host, member.client_port),),
                                rpc_timeout=timeout, retry_timeout=timeout,
                                connect_timeout=timeout)
        with EtcdClient(settings, verify=False) as client:
            client.call("move leader", lambda c: c.maintenancestub.MoveLeader(
                etcdrpc.MoveLeaderRequest(targetID=target_id), timeout,
                credentials=c.call_credentials, metadata=c.metadata), timeout=timeout)
        while (now := self.leader(max(0.1, deadline - time.monotonic()))) != target:
            if time.monotonic() >= deadline:
                raise EtcdServerError(
                    f"member{target} was not leader {timeout:.0f} s after member{old} handed "
                    f"it leadership (member{now} is).")
            time.sleep(_LEADER_POLL_S)
        return old, target

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` and reap it (a crash: its data directory stays)."""
        self.members[index].stop(kill=True)

    def restart(self, index: int) -> None:
        """Start member ``index`` again on its data directory and ports; wait until healthy."""
        member = self.members[index]
        member.stop(kill=True)
        member.start()

    def stop(self, kill: bool = False) -> None:
        """Stop every member (SIGTERM, or SIGKILL with ``kill``); each is reaped."""
        errors: list[BaseException] = []
        for member in self.members:
            try:
                member.stop(kill=kill)
            except BaseException as exc:  # noqa: BLE001 - stop the others first
                errors.append(exc)
        if errors:
            raise errors[0]

    def cleanup(self) -> None:
        """Stop every member and remove the temporary directory this object created."""
        try:
            self.stop()
        finally:
            if self._own_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcdCluster:  # noqa: PYI034
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
