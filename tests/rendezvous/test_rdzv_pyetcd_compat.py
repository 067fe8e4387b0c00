"""The pyetcd internals we rely on are still there, and nothing else reaches into pyetcd.

If a pyetcd upgrade breaks a test here, re-read its source, adapt
``chameleon_elastic/rendezvous/pyetcd_compat.py`` and bump ``CHECKED_VERSION``.
"""

from __future__ import annotations

import ast
import inspect
import threading
from pathlib import Path

import grpc
import pyetcd
import pytest

from chameleon_elastic.rendezvous import pyetcd_compat
from chameleon_elastic.rendezvous.pyetcd_compat import (
    OVERRIDDEN_CLIENT_METHODS,
    PRIVATE_CLIENT_ATTRIBUTES,
    Etcd3Client,
    add_watch,
    drop_cached_stubs,
    is_failed_node_error,
)

pytestmark = pytest.mark.timeout(30)

_PACKAGE = Path(pyetcd_compat.__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(OVERRIDDEN_CLIENT_METHODS))
def test_overridden_client_methods_exist(name: str) -> None:
    member = getattr(pyetcd.MultiEndpointEtcd3Client, name, None)
    assert callable(member), f"pyetcd.MultiEndpointEtcd3Client.{name} is gone"
    assert tuple(inspect.signature(member).parameters) == OVERRIDDEN_CLIENT_METHODS[name]


def test_private_client_attributes_exist() -> None:
    endpoint = pyetcd.Endpoint("127.0.0.1", 1, secure=False)
    try:
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint])
        for name in PRIVATE_CLIENT_ATTRIBUTES:
            assert isinstance(getattr(client, name, None), dict), f"client.{name} is gone"
    finally:
        endpoint.close()


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "etcdserver: leader changed"


def test_our_client_leaves_fail_over_to_us() -> None:
    """pyetcd's own handler marks the member failed on any UNAVAILABLE, "leader changed"
    included; ours hands the gRPC error on untouched (client.classify decides)."""
    endpoint = pyetcd.Endpoint("127.0.0.1", 1, secure=False, time_retry=60)
    try:
        client = Etcd3Client(endpoints=[endpoint])
        error = _Unavailable()
        with pytest.raises(_Unavailable) as caught:
            client._manage_grpc_errors(error)
        assert caught.value is error and not endpoint.is_failed()
        with pytest.raises(pyetcd.exceptions.ConnectionFailedError):   # what pyetcd does
            pyetcd.MultiEndpointEtcd3Client._manage_grpc_errors(client, error)
        assert endpoint.is_failed()
    finally:
        endpoint.close()


def test_dropping_cached_stubs_rebuilds_them(etcd_client) -> None:
    """pyetcd caches stubs per service; after the drop a new stub (on a freshly picked channel)
    answers requests."""
    client = etcd_client.client()
    before = client.kvstub
    assert client.kvstub is before  # cached: this is what defeats fail-over
    drop_cached_stubs(client)
    assert client.kvstub is not before
    client.put("/compat-probe", b"ok")
    assert client.get("/compat-probe")[0] == b"ok"


def test_a_watch_is_cancelled_on_its_own_stream_after_the_stubs_are_dropped(etcd_client) -> None:
    """etcd numbers watches per stream: after a drop (a fail-over) the new stream's first watch
    has the old one's number. Cancelling the old watch by number (pyetcd's cancel_watch) went
    to the new stream and silenced the other watch; our handle cancels it where it lives, and
    the old stream's watches go on until then."""
    client = etcd_client.client()
    seen = {"a": threading.Event(), "b": threading.Event()}

    def on(name: str):
        def callback(response) -> None:
            if getattr(response, "events", None):
                seen[name].set()
        return callback

    old = add_watch(client, "/compat/a", on("a"))
    drop_cached_stubs(client)
    new = add_watch(client, "/compat/b", on("b"))
    assert old.watch_id == new.watch_id   # the collision the handle exists for
    client.put("/compat/a", b"1")
    assert seen["a"].wait(10), "the old stream's watch stopped when the stubs were dropped"
    old.cancel()
    client.put("/compat/b", b"1")
    assert seen["b"].wait(10), "cancelling the old watch cancelled the new stream's watch"
    new.cancel()


def test_failed_endpoint_error_is_recognised() -> None:
    endpoint = pyetcd.Endpoint("127.0.0.1", 1, secure=False, time_retry=60)
    try:
        endpoint.fail()
        with pytest.raises(ValueError) as caught:
            endpoint.use()
        assert is_failed_node_error(caught.value)
        assert not is_failed_node_error(ValueError("some other problem"))
    finally:
        endpoint.close()


def _private_pyetcd_names() -> set[str]:
    """Private names of pyetcd's client and endpoint classes and instances (no server needed:
    channels connect lazily)."""
    endpoint = pyetcd.Endpoint("127.0.0.1", 1, secure=False)
    try:
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint])
        objects = (client, endpoint, pyetcd.Etcd3Client, pyetcd.MultiEndpointEtcd3Client)
        names = {n for obj in objects for n in dir(obj)}
    finally:
        endpoint.close()
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_private_pyetcd_member_outside_the_compat_module() -> None:
    """``obj._name`` for a private name of pyetcd's classes, on anything but ``self``/``cls``,
    appears only in pyetcd_compat.py."""
    private = _private_pyetcd_names()
    offenders = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.name == "pyetcd_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offenders.append(f"{path.relative_to(_PACKAGE.parent)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders
