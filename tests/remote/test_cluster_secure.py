"""The shared tier's guards on a Redis Cluster (issue 30, items 1 and 2 together): the cluster
client connects to every node with the single-server client's credentials and TLS keywords, it
checks them at start-up like the single-server client, and keyed values are written, read back
and refused on the cluster as on one server.

The cluster here is 3 primaries without replicas (the fewest ``redis-cli --cluster create``
takes), every node started with ``--requirepass`` and ``--masterauth``: enough for the
start-up check and the keyed values, and quick to start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _certs import Certs, make_certs
from _redis_cluster import LocalCluster, cli_or_skip
from _remote_helpers import WRONG_LOGINS, chunk_of, content

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    Admission,
    Chunk,
    ClientFault,
    ClusterClient,
    Credentials,
    FleetKey,
    PromoteOutcome,
    RemoteConfig,
    RemoteTier,
    TlsFiles,
    redis_key,
)
from hybridkv.remote.client import connection_kwargs
from hybridkv.remote.cluster import cluster_kwargs

SLOT = 4096
PASSWORD = "cluster-password-5d1e8b"
SECRET = b"fleet-secret-for-the-cluster-tests-0123456789"
AUTHED = Credentials(password=PASSWORD)
GRANT = "~hybridkv:chunk:* -@all +get +set +exists +ping"


# ------------------------------------------------------------------ keywords, no server


def test_the_cluster_client_connects_with_the_single_server_keywords(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = TlsFiles(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    config = RemoteConfig(
        cluster_nodes=(("127.0.0.1", 7000),), credentials=Credentials("engine", "pw"), tls=tls
    )
    single = connection_kwargs(config)
    cluster = cluster_kwargs(config)
    assert {k: v for k, v in cluster.items() if k not in ("retry", "require_full_coverage")} == {
        k: v for k, v in single.items() if k != "retry"
    }
    assert cluster["require_full_coverage"] is False
    assert (cluster["username"], cluster["password"], cluster["ssl"]) == ("engine", "pw", True)
    assert (cluster["ssl_ca_certs"], cluster["ssl_certfile"], cluster["ssl_keyfile"]) == (
        str(certs.ca),
        str(certs.client_cert),
        str(certs.client_key),
    )
    plain = cluster_kwargs(RemoteConfig(cluster_nodes=(("127.0.0.1", 7000),)))
    assert not {"username", "password", "ssl"} & set(plain)


# ------------------------------------------------------------------ a cluster with a password


@pytest.fixture(scope="module")
def locked_cluster(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        redis_binary,
        cli_or_skip(),
        tmp_path_factory.mktemp("locked-cluster"),
        replicas=0,
        password=PASSWORD,
    )
    try:
        started = time.monotonic()
        cluster.start()
        print(f"\n3-primary cluster with requirepass ready in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        cluster.stop()


def config_of(cluster: LocalCluster, **kw: object) -> RemoteConfig:
    return RemoteConfig(**{"cluster_nodes": cluster.seeds, "deadline_s": 2.0, **kw})  # type: ignore[arg-type]


def _one_line(error: HybridKVConfigError) -> str:
    text = str(error)
    assert "\n" not in text
    assert error.__suppress_context__  # raised `from None`: no redis-py traceback under it
    return text


@pytest.mark.remote
@WRONG_LOGINS
def test_a_wrong_password_on_a_cluster_is_one_clean_error_at_start_up(
    locked_cluster: LocalCluster, credentials: Credentials, problem: str
) -> None:
    config = config_of(locked_cluster, credentials=credentials)
    started = time.monotonic()
    with pytest.raises(HybridKVConfigError) as caught:
        RemoteTier(config)
    waited = time.monotonic() - started
    text = _one_line(caught.value)
    assert caught.value.field == "remote_password"
    assert problem in caught.value.problem
    assert "redis+cluster://127.0.0.1:" in caught.value.problem  # names the cluster it asked
    assert "remote_password_env or remote_password_file" in caught.value.fix
    assert "not-the-password-1234" not in text
    assert PASSWORD not in text
    assert waited < config.connect_timeout_s + config.deadline_s


@pytest.mark.remote
def test_a_cluster_acl_user_needs_the_cluster_commands_too(locked_cluster: LocalCluster) -> None:
    # ACLs are per node: the user is made on every node, as an operator must.
    for node in locked_cluster.nodes:
        admin = node.admin()
        admin.execute_command("ACL", "SETUSER", "carol", "on", ">carol-pw-31", *GRANT.split())
        more = ("+cluster|slots", "+command", "+asking")
        admin.execute_command("ACL", "SETUSER", "dave", "on", ">dave-pw-47", *GRANT.split(), *more)
        admin.close()
    # carol has the single server's grant only: the cluster client cannot ask for the slot
    # map. One error naming the grant that works, not faults for ever.
    with pytest.raises(HybridKVConfigError) as caught:
        ClusterClient(config_of(locked_cluster, credentials=Credentials("carol", "carol-pw-31")))
    assert caught.value.field == "remote_username"
    assert f"ACL SETUSER carol {GRANT} +cluster|slots +command +asking" in _one_line(caught.value)
    # dave has that grant: he writes and reads chunks on every shard.
    dave = ClusterClient(config_of(locked_cluster, credentials=Credentials("dave", "dave-pw-47")))
    keys = [redis_key(bytes([i]) * 32) for i in range(12)]
    assert all(dave.set(key, b"v", 0) is None for key in keys)
    assert dave.exists(keys) == (True,) * len(keys)
    assert len({locked_cluster.owner(key) for key in keys}) == 3
    # A slot moving: dave follows the ASK (he may send ASKING), then the MOVED.
    owners = _move(locked_cluster, keys[0])
    target = next(n for n in locked_cluster.nodes if _node_id(locked_cluster, n.port) == owners[1])
    asked = target.info("commandstats").get("cmdstat_asking", {})
    assert dave.get(keys[0]) == b"v"
    assert target.info("commandstats")["cmdstat_asking"] != asked  # ASKING was sent
    _moved(locked_cluster, *owners)
    assert dave.get(keys[0]) == b"v"
    dave.close()


def _node_id(cluster: LocalCluster, port: int) -> str:
    admin = cluster.node(port).admin()
    try:
        return bytes(admin.execute_command("CLUSTER MYID")).decode()
    finally:
        admin.close()


def _move(cluster: LocalCluster, key: bytes) -> tuple[int, str]:
    """Start migrating ``key``'s slot to another primary and move the key: the source answers
    ASK for it. The slot and the new owner's id."""
    source = cluster.owner(key)
    target = next(n.port for n in cluster.nodes if n.port != source)
    admin, target_admin = cluster.node(source).admin(), cluster.node(target).admin()
    slot = int(admin.execute_command("CLUSTER KEYSLOT", key))
    target_admin.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", _node_id(cluster, source))
    admin.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", _node_id(cluster, target))
    admin.execute_command(
        "MIGRATE", "127.0.0.1", target, "", 0, 5000, "AUTH", PASSWORD, "KEYS", key
    )
    admin.close()
    target_admin.close()
    return slot, _node_id(cluster, target)


def _moved(cluster: LocalCluster, slot: int, target: str) -> None:
    """End the migration: every node gives ``slot`` to ``target`` (the others answer MOVED)."""
    for node in cluster.nodes:
        admin = node.admin()
        admin.execute_command("CLUSTER SETSLOT", slot, "NODE", target)
        admin.close()
    cluster.wait_ready()


def _publish(tier: RemoteTier, chunk: Chunk, payloads: list[bytes]) -> None:
    assert tier.write_behind(chunk, payloads) is Admission.ENQUEUED
    assert tier.write_pending() == 1


def _fetch(tier: RemoteTier, chunk: Chunk) -> tuple[PromoteOutcome, tuple[bytes, ...]]:
    assert tier.begin_promotion(chunk)
    fetched = tier.fetch(chunk)
    return fetched.outcome, tuple(bytes(p) for p in fetched.payloads)


@pytest.mark.remote
@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "encrypted"])
def test_keyed_values_on_a_cluster(locked_cluster: LocalCluster, encrypt: bool) -> None:
    key = FleetKey(SECRET, encrypt=encrypt)
    writer = RemoteTier(config_of(locked_cluster, credentials=AUTHED, key=key), background=False)
    reader = RemoteTier(config_of(locked_cluster, credentials=AUTHED, key=key), background=False)
    unkeyed = RemoteTier(config_of(locked_cluster, credentials=AUTHED), background=False)
    # Keyed values written through the cluster client come back whole from every shard.
    salt = b"enc" if encrypt else b"mac"
    mine = [chunk_of(i, groups=2, salt=salt, slot=SLOT) for i in range(9)]
    for chunk in mine:
        _publish(writer, chunk, [content(k, SLOT) for k in chunk.members])
    assert len({locked_cluster.owner(redis_key(c.key)) for c in mine}) == 3
    assert reader.lookup(mine) == len(mine)
    for chunk in mine:
        expected = tuple(content(k, SLOT) for k in chunk.members)
        assert _fetch(reader, chunk) == (PromoteOutcome.PROMOTED, expected)
    # A value written without the secret (the only way a client without it can) is refused.
    planted = chunk_of(100, groups=2, salt=salt, slot=SLOT)
    _publish(unkeyed, planted, [b"P" * SLOT, b"Q" * SLOT])
    assert _fetch(reader, planted) == (PromoteOutcome.CORRUPT, ())
    assert reader.refusals.counts()["keying"] == 1
    # A valid keyed value moved under another chunk's key is refused: the MAC covers the key.
    moved = chunk_of(101, groups=2, salt=salt, slot=SLOT)
    admin = locked_cluster.client()
    admin.set(redis_key(moved.key), admin.get(redis_key(mine[0].key)))
    admin.close()
    moved_here = Chunk(moved.key, mine[0].members)  # the members the moved value names
    assert _fetch(reader, moved_here) == (PromoteOutcome.CORRUPT, ())
    assert reader.refusals.counts()["mac"] == 1
    assert reader.refusals.unauthenticated() == 2
    for tier in (writer, reader, unkeyed):
        tier.close()


# ------------------------------------------------------------------ a cluster speaking only TLS


@pytest.fixture(scope="module")
def tls_cluster(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, Certs]]:
    certs = make_certs(tmp_path_factory.mktemp("cluster-certs"))
    cluster = LocalCluster(
        redis_binary,
        cli_or_skip(),
        tmp_path_factory.mktemp("tls-cluster"),
        replicas=0,
        password=PASSWORD,
        tls=certs,
    )
    try:
        started = time.monotonic()
        cluster.start()
        print(f"\n3-primary TLS cluster ready in {time.monotonic() - started:.1f} s")
        yield cluster, certs
    finally:
        cluster.stop()


@pytest.mark.remote
def test_a_tls_cluster_serves_keyed_values_to_tls_clients_only(
    tls_cluster: tuple[LocalCluster, Certs], caplog: pytest.LogCaptureFixture
) -> None:
    cluster, certs = tls_cluster
    tls = TlsFiles(str(certs.ca))
    key = FleetKey(SECRET)
    writer = RemoteTier(config_of(cluster, credentials=AUTHED, tls=tls, key=key), background=False)
    reader = RemoteTier(config_of(cluster, credentials=AUTHED, tls=tls, key=key), background=False)
    items = [chunk_of(i, groups=2, salt=b"tls", slot=SLOT) for i in range(9)]
    for chunk in items:
        _publish(writer, chunk, [content(k, SLOT) for k in chunk.members])
    assert len({cluster.owner(redis_key(c.key)) for c in items}) == 3  # every node, over TLS
    for chunk in items:
        expected = tuple(content(k, SLOT) for k in chunk.members)
        assert _fetch(reader, chunk) == (PromoteOutcome.PROMOTED, expected)
    # A certificate the client's CA did not sign: one clean error at start-up.
    with pytest.raises(HybridKVConfigError) as caught:
        ClusterClient(config_of(cluster, credentials=AUTHED, tls=TlsFiles(str(certs.other_ca))))
    assert caught.value.field == "remote_tls_ca_file"
    assert "CERTIFICATE_VERIFY_FAILED" in _one_line(caught.value)
    # A plaintext client gets nothing: no answer at start-up (logged), every call a fault.
    with caplog.at_level(logging.WARNING, logger="hybridkv.remote"):
        plaintext = ClusterClient(config_of(cluster, credentials=AUTHED, deadline_s=0.5))
    assert any("did not answer at start-up" in r.getMessage() for r in caplog.records)
    assert plaintext.get(redis_key(items[0].key)) is ClientFault.FAULT
    plaintext.close()
    for tier in (writer, reader):
        tier.close()
