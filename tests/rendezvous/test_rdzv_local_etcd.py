"""The local etcd helper: starts healthy, keeps data across a restart, always reaps the process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from chameleon_elastic.rendezvous.errors import EtcdServerError
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd, find_etcd_binary

pytestmark = pytest.mark.timeout(60)


def test_finds_a_binary() -> None:
    assert os.access(find_etcd_binary(), os.X_OK)


def test_restart_on_same_data_dir_keeps_keys(etcd_server, etcd_client) -> None:
    etcd_client.call("put", lambda c: c.put("/survives", "yes"))
    old_pid = etcd_server.pid
    etcd_server.restart()
    assert etcd_server.pid != old_pid
    value, _ = etcd_client.call("get", lambda c: c.get("/survives"))
    assert value == b"yes"


def test_stop_reaps_process(tmp_path) -> None:
    server = LocalEtcd(data_dir=tmp_path / "d").start()
    pid = server.pid
    assert pid is not None and server.is_running()
    server.stop()
    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_context_manager_removes_its_temp_dir() -> None:
    with LocalEtcd() as server:
        work = server.data_dir.parent
        assert work.exists()
    assert not work.exists()


def test_port_in_use_is_a_clear_error(etcd_server, tmp_path) -> None:
    clash = LocalEtcd(data_dir=tmp_path / "other", client_port=etcd_server.client_port)
    with pytest.raises(EtcdServerError, match="already in use"):
        clash.start()
    assert not clash.is_running()


def test_picked_ports_taken_before_the_start_are_picked_again(tmp_path) -> None:
    """Ports picked here are free when picked, not when etcd binds them: another process can
    take one in between (seen in the suite: "bind: address already in use", exit 1). A lone
    member not yet started picks again; a restart keeps its ports."""
    server = LocalEtcd(data_dir=tmp_path / "d")
    taken = server.client_port
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", taken))
        other.listen()
        try:
            server.start()
            assert server.client_port != taken
            assert server.endpoint == f"127.0.0.1:{server.client_port}"
            server.restart()
            assert server.is_running() and server.client_port != taken
        finally:
            server.cleanup()


def test_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # the parent is killed, so it cannot remove a directory of its own: give it tmp_path's
    code = ("from chameleon_elastic.rendezvous.local_etcd import LocalEtcd; import time; "
            f"e = LocalEtcd(data_dir={str(tmp_path / 'd')!r}).start(); print(e.pid, flush=True); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        etcd_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    finally:
        parent.kill()
        parent.wait(timeout=10)
    deadline = time.monotonic() + 20
    while _running(etcd_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(etcd_pid)
    if alive:
        os.kill(etcd_pid, 9)
    assert not alive, "etcd outlived the process that started it"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
