"""The pyetcd internals we rely on are still there, and nothing else reaches into pyetcd.

If a pyetcd upgrade breaks a test here, re-read its source, adapt
``chameleon_elastic/rendezvous/pyetcd_compat.py`` and bump ``CHECKED_VERSION``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pyetcd
import pytest

from chameleon_elastic.rendezvous import pyetcd_compat
from chameleon_elastic.rendezvous.pyetcd_compat import (
    PRIVATE_CLIENT_METHODS,
    drop_cached_stubs,
    is_failed_node_error,
)

pytestmark = pytest.mark.timeout(30)

_PACKAGE = Path(pyetcd_compat.__file__).resolve().parent.parent


@pytest.mark.parametrize("name", PRIVATE_CLIENT_METHODS)
def test_private_client_methods_exist(name: str) -> None:
    member = getattr(pyetcd.MultiEndpointEtcd3Client, name, None)
    assert callable(member), f"pyetcd.MultiEndpointEtcd3Client.{name} is gone"
    assert list(inspect.signature(member).parameters) == ["self"]


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
