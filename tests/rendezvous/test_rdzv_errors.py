"""Configuration and connection errors: wrong endpoint, bad TLS files, TLS, bad credentials."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pyetcd import etcdrpc

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings, parse_endpoints
from chameleon_elastic.rendezvous.errors import (
    EtcdAuthError,
    EtcdConfigError,
    EtcdConnectionError,
)
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd, LocalEtcdTls, free_port
from chameleon_elastic.rendezvous.store import EtcdStore

pytestmark = pytest.mark.timeout(60)


# -- configuration (no server) ---------------------------------------------------------------


def test_endpoints_parse_cluster_lists() -> None:
    assert parse_endpoints("h1:1,https://h2:2, h3 ,[::1]:4") == (
        ("h1", 1),
        ("h2", 2),
        ("h3", 2379),
        ("::1", 4),
    )
    # container and Kubernetes service names, a fully qualified name, a bare IPv6 address
    assert parse_endpoints("etcd_1:2379,etcd-0.etcd.default.svc.:2379,fe80::1") == (
        ("etcd_1", 2379), ("etcd-0.etcd.default.svc.", 2379), ("fe80::1", 2379))


@pytest.mark.parametrize("bad", ["", " , ", "host:0", "host:http", ":2379", "^step +15",
                                 "two words:2379", "-host:2379", "a..b:2379", "[:::1]:2379"])
def test_bad_endpoint_is_config_error(bad: str) -> None:
    with pytest.raises(EtcdConfigError, match="rdzv-endpoint"):
        parse_endpoints(bad)


def test_missing_tls_file(tmp_path: Path) -> None:
    with pytest.raises(EtcdConfigError, match="cacert=.*cannot be read"):
        EtcdSettings.from_config("h:1", {"cacert": str(tmp_path / "nope.pem")})


def test_non_pem_tls_file(tmp_path: Path) -> None:
    junk = tmp_path / "ca.der"
    junk.write_bytes(b"\x30\x82\x01\x0a not pem")
    with pytest.raises(EtcdConfigError, match="not PEM"):
        EtcdSettings.from_config("h:1", {"cacert": str(junk)})


def test_cert_without_key(tls_files: dict[str, str]) -> None:
    with pytest.raises(EtcdConfigError, match="together"):
        EtcdSettings.from_config("h:1", {"cacert": tls_files["ca"], "cert": tls_files["cert"]})


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"user": "u"}, "user and password"),
        ({"lease_ttl": "0"}, "lease_ttl"),
        ({"lease_ttl": "two"}, "not a whole number"),
        ({"retry_timeout": "-1"}, "retry_timeout"),
        ({"key_prefix": "no-slash"}, "key_prefix"),
    ],
)
def test_bad_options(conf: dict[str, str], match: str) -> None:
    with pytest.raises(EtcdConfigError, match=match):
        EtcdSettings.from_config("h:1", conf)


def test_environment_fills_gaps() -> None:
    settings = EtcdSettings.from_config(
        "h:1", {"lease_ttl": "7"}, environ={"CHAMELEON_ETCD_LEASE_TTL": "3",
                                           "CHAMELEON_ETCD_KEY_PREFIX": "/p"}
    )
    assert settings.lease_ttl == 7 and settings.key_prefix == "/p"


def test_bad_run_id() -> None:
    with pytest.raises(EtcdConfigError, match="rdzv-id"):
        EtcdSettings.from_config("h:1").run_prefix("a/b")


# -- connection ------------------------------------------------------------------------------


def test_wrong_endpoint_fails_fast_with_a_hint() -> None:
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    settings = EtcdSettings.from_config(endpoints, {"connect_timeout": "1.5"})
    with pytest.raises(EtcdConnectionError) as info:
        EtcdClient(settings)
    message = str(info.value)
    assert message.startswith(f"no etcd answered at {endpoints} within 1.5 s (connection refused")
    assert "start etcd there" in message and "\n" not in message
    assert info.value.__cause__ is None  # gRPC's error is summed up, not chained


@pytest.mark.parametrize(
    ("conf", "expected"),
    [({}, 10.0), ({"read_timeout": "3"}, 3.0), ({"read_timeout": "3", "connect_timeout": "20"},
                                                  20.0), ({"read_timeout": "40"}, 10.0)],
)
def test_connect_gives_up_by_read_timeout_when_smaller(conf: dict[str, str],
                                                         expected: float) -> None:
    assert EtcdSettings.from_config("h:1", conf).connect_timeout == expected


# -- TLS -------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _make_ca(folder: Path, name: str) -> tuple[str, str]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             f"/CN={name}", "-keyout", str(key), "-out", str(cert))
    return str(cert), str(key)


def _make_signed(folder: Path, name: str, ca: tuple[str, str]) -> tuple[str, str]:
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    ext = folder / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", ca[0], "-CAkey", ca[1],
             "-CAcreateserial", "-days", "1", "-out", str(cert), "-extfile", str(ext))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("tls")
    ca = _make_ca(folder, "ca")
    other_ca = _make_ca(folder, "other-ca")
    server = _make_signed(folder, "server", ca)
    client = _make_signed(folder, "client", ca)
    return {"ca": ca[0], "other_ca": other_ca[0], "server_cert": server[0],
            "server_key": server[1], "cert": client[0], "key": client[1]}


@pytest.fixture
def tls_server(tls_files: dict[str, str], tmp_path: Path):
    tls = LocalEtcdTls(ca=tls_files["ca"], server_cert=tls_files["server_cert"],
                       server_key=tls_files["server_key"], client_cert_auth=True,
                       health_cert=tls_files["cert"], health_key=tls_files["key"])
    server = LocalEtcd(data_dir=tmp_path / "tls-data", tls=tls)
    try:
        yield server.start()
    finally:
        server.stop(kill=True)


def test_mutual_tls_works(tls_server: LocalEtcd, tls_files: dict[str, str]) -> None:
    conf = {"cacert": tls_files["ca"], "cert": tls_files["cert"], "key": tls_files["key"]}
    with EtcdClient(EtcdSettings.from_config(tls_server.endpoint, conf)) as client:
        store = EtcdStore(client, "/chameleon/rdzv/tls/")
        store.set("k", "over tls")
        assert store.get("k") == b"over tls"


def test_wrong_ca_is_a_connection_error_naming_tls(
    tls_server: LocalEtcd, tls_files: dict[str, str]
) -> None:
    conf = {"cacert": tls_files["other_ca"], "cert": tls_files["cert"],
            "key": tls_files["key"], "connect_timeout": "1.5"}
    with pytest.raises(EtcdConnectionError, match="cacert is the CA"):
        EtcdClient(EtcdSettings.from_config(tls_server.endpoint, conf))


def test_plaintext_client_to_tls_server_hints_cacert(tls_server: LocalEtcd) -> None:
    settings = EtcdSettings.from_config(tls_server.endpoint, {"connect_timeout": "1.5"})
    with pytest.raises(EtcdConnectionError, match="pass cacert"):
        EtcdClient(settings)


# -- authentication --------------------------------------------------------------------------


def _enable_auth(client: EtcdClient, root_password: str) -> None:
    def setup(c):  # type: ignore[no-untyped-def]
        stub = c.authstub
        stub.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password), 5)
        stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), 5)
        stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), 5)
        stub.AuthEnable(etcdrpc.AuthEnableRequest(), 5)

    client.call("enable auth", setup)


def _add_prefix_user(root: EtcdClient, user: str, password: str, prefix: str) -> None:
    def setup(c):  # type: ignore[no-untyped-def]
        auth = {"credentials": c.call_credentials, "metadata": c.metadata}
        c.authstub.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password), 5, **auth)
        c.authstub.RoleAdd(etcdrpc.AuthRoleAddRequest(name=user), 5, **auth)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE,
                                  key=prefix.encode(), range_end=end.encode())
        c.authstub.RoleGrantPermission(
            etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=perm), 5, **auth)
        c.authstub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=user), 5,
                                 **auth)

    root.call("add user", setup)


def test_credentials(etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    _enable_auth(etcd_client, "rootpw")
    endpoint = etcd_server.endpoint
    with pytest.raises(EtcdAuthError, match="user name or password is wrong"):
        EtcdClient(EtcdSettings.from_config(endpoint, {"user": "root", "password": "nope"}))
    anon = EtcdClient(EtcdSettings.from_config(endpoint, {"connect_timeout": "2"}))
    with anon, pytest.raises(EtcdAuthError, match="requires authentication"):
        EtcdStore(anon, "/chameleon/rdzv/r/").set("k", "v")
    root_conf = {"user": "root", "password": "rootpw", "retry_timeout": "20"}
    with EtcdClient(EtcdSettings.from_config(endpoint, root_conf)) as root:
        _add_prefix_user(root, "trainer", "trainpw", "/chameleon/rdzv/")
    trainer_conf = {"user": "trainer", "password": "trainpw", "retry_timeout": "20"}
    with EtcdClient(EtcdSettings.from_config(endpoint, trainer_conf)) as trainer:
        EtcdStore(trainer, "/chameleon/rdzv/r/").set("k", "v")
        with pytest.raises(EtcdAuthError, match="denied"):
            EtcdStore(trainer, "/elsewhere/r/").set("k", "v")
        # etcd forgets simple auth tokens when it restarts: the client logs in again
        etcd_server.restart()
        assert EtcdStore(trainer, "/chameleon/rdzv/r/").get("k") == b"v"
