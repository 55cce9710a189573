"""The shared tier's guards against a real server (issue 30, item 1): a password, ACL users, TLS
with certificates the test makes, and the fleet key.

Each attack is played by a client that holds what the threat model gives it (docs/howto/
share-prefix-cache.md, "Threat model"): a network peer without the password, a peer without
TLS, a holder of the server's password without the fleet secret. Where today's unkeyed format
lets the attack through, the test shows that first (the control), then the refusal.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _certs import Certs, make_certs
from _redis_server import RedisServer
from _remote_helpers import (
    WRONG_LOGINS,
    check_counters,
    chunk_of,
    content,
    host_bytes,
    store_from_gpu,
)

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    Admission,
    Chunk,
    ClientFault,
    Credentials,
    FleetKey,
    PromoteOutcome,
    RedisClient,
    RemoteConfig,
    RemoteTier,
    SlotBuffer,
    TlsFiles,
    TwoTierStore,
    ValueFormat,
    decode_chunk,
    encode_chunk,
    redis_key,
)
from hybridkv.store import HostStore

pytestmark = pytest.mark.remote

SLOT = 4096
PASSWORD = "server-password-7f3a9c"
SECRET = b"fleet-secret-for-the-tests-0123456789abcdef"
KEYS = {"mac": FleetKey(SECRET), "encrypted": FleetKey(SECRET, encrypt=True)}


def engine(port: int, **config: Any) -> TwoTierStore:
    """One engine's host store over the server (writes run when the test says)."""
    tier = RemoteTier(RemoteConfig(port=port, deadline_s=2.0, **config), background=False)
    return TwoTierStore(HostStore(8), tier, SlotBuffer.allocate(8, SLOT))


def publish(store: TwoTierStore, chunk: Chunk) -> None:
    store_from_gpu(store, chunk)
    assert store.write_behind(chunk) is Admission.ENQUEUED
    assert store.tier.write_pending() == 1
    assert store.snapshot()["counters"]["written"] == 1


def assert_refused(store: TwoTierStore, chunk: Chunk, kind: str) -> None:
    """CORRUPT, nothing of ``chunk`` in the host, the refusal counted under ``kind``."""
    assert store.promote(chunk) is PromoteOutcome.CORRUPT
    assert all(store.host.status(k).value == "miss" for k in chunk.members)
    assert store.tier.refusals.counts()[kind] == 1
    assert store.tier.refusals.unauthenticated() == 1
    check_counters(store.snapshot())


def _one_line(error: HybridKVConfigError) -> str:
    text = str(error)
    assert "\n" not in text
    assert error.__cause__ is None
    assert error.__suppress_context__  # raised `from None`: no redis-py traceback under it
    return text


@pytest.fixture
def password_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(
        redis_binary, tmp_path, ["--requirepass", PASSWORD], {"password": PASSWORD}
    )
    server.start()
    yield server
    server.stop()


AUTHED = {"credentials": Credentials(password=PASSWORD)}


# --- a password and ACL users ---


@WRONG_LOGINS
def test_a_wrong_password_is_one_clean_error_at_start_up(
    password_server: RedisServer, credentials: Credentials, problem: str
) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        RemoteTier(RemoteConfig(port=password_server.port, credentials=credentials))
    text = _one_line(caught.value)
    assert caught.value.field == "remote_password"
    assert problem in caught.value.problem
    assert "remote_password_env or remote_password_file" in caught.value.fix
    assert "not-the-password-1234" not in text
    assert PASSWORD not in text


def test_the_right_password_shares_chunks(password_server: RedisServer) -> None:
    a, b = engine(password_server.port, **AUTHED), engine(password_server.port, **AUTHED)
    chunk = chunk_of(0, groups=2, slot=SLOT)
    publish(a, chunk)
    assert b.promote(chunk) is PromoteOutcome.PROMOTED
    assert host_bytes(b, chunk) == [content(k, SLOT) for k in chunk.members]


def test_an_acl_user_gets_in_with_its_password_and_its_rights_only(
    password_server: RedisServer,
) -> None:
    admin = password_server.admin()
    for user, rights in (("alice", ("+get", "+set", "+exists")), ("bob", ("+get",))):
        admin.execute_command(
            "ACL", "SETUSER", user, "on", f">{user}-password-99", "~hybridkv:chunk:*", "-@all",
            *rights,
        )  # fmt: skip
    admin.close()
    port = password_server.port
    alice = {"credentials": Credentials("alice", "alice-password-99")}
    a, b = engine(port, **alice), engine(port, **alice)
    chunk = chunk_of(1, groups=2, slot=SLOT)
    publish(a, chunk)
    assert b.promote(chunk) is PromoteOutcome.PROMOTED
    with pytest.raises(HybridKVConfigError) as caught:
        RedisClient(RemoteConfig(port=port, credentials=Credentials("alice", "bob-password-99")))
    assert "refused ACL user 'alice'" in _one_line(caught.value)
    # bob gets in but may not ask EXISTS: one error naming the grant, not faults for ever.
    with pytest.raises(HybridKVConfigError) as caught:
        RedisClient(RemoteConfig(port=port, credentials=Credentials("bob", "bob-password-99")))
    assert caught.value.field == "remote_username"
    assert "ACL SETUSER bob ~hybridkv:chunk:* -@all +get +set +exists +ping" in _one_line(
        caught.value
    )


# --- the fleet key: planted and tampered values ---


def test_without_a_secret_a_planted_chunk_loads(password_server: RedisServer) -> None:
    # The control, today's behaviour: a peer with the server's password writes other bytes
    # under a chunk's key, and an engine without a fleet key loads them.
    port = password_server.port
    victim, attacker = engine(port, **AUTHED), engine(port, **AUTHED)
    chunk = chunk_of(2, groups=2, slot=SLOT)
    planted = [b"P" * SLOT, b"Q" * SLOT]
    assert attacker.tier.write_behind(chunk, planted) is Admission.ENQUEUED
    attacker.tier.write_pending()
    assert victim.promote(chunk) is PromoteOutcome.PROMOTED
    assert host_bytes(victim, chunk) == planted


@pytest.mark.parametrize("mode", sorted(KEYS))
def test_a_client_without_the_secret_cannot_plant_a_chunk_that_loads(
    password_server: RedisServer, mode: str
) -> None:
    port = password_server.port
    key = KEYS[mode]
    victim = engine(port, key=key, **AUTHED)
    # 1. An engine (or anyone) without the secret writes the chunk the only way it can.
    unkeyed = engine(port, **AUTHED)
    chunk = chunk_of(3, groups=2, slot=SLOT)
    assert unkeyed.tier.write_behind(chunk, [b"P" * SLOT, b"Q" * SLOT]) is Admission.ENQUEUED
    unkeyed.tier.write_pending()
    assert_refused(victim, chunk, "keying")
    # 2. A forger labels its value keyed and guesses the seal: the MAC (or tag) fails.
    other = chunk_of(4, groups=2, slot=SLOT)
    forged = encode_chunk(other.members, [b"P" * SLOT, b"Q" * SLOT])
    forged = forged[:4] + struct.pack(">H", ValueFormat.MAC) + forged[6:]
    admin = password_server.admin()
    admin.set(redis_key(other.key), forged)
    admin.close()
    victim2 = engine(port, key=key, **AUTHED)
    assert_refused(victim2, other, "mac")
    # 3. Engines holding the secret share chunks as before.
    writer = engine(port, key=key, **AUTHED)
    mine = chunk_of(5, groups=2, slot=SLOT)
    publish(writer, mine)
    assert victim.promote(mine) is PromoteOutcome.PROMOTED
    assert host_bytes(victim, mine) == [content(k, SLOT) for k in mine.members]


@pytest.mark.parametrize("mode", [None, *sorted(KEYS)])
def test_a_tampered_value_is_refused(password_server: RedisServer, mode: str | None) -> None:
    port = password_server.port
    key = None if mode is None else KEYS[mode]
    writer, reader = engine(port, key=key, **AUTHED), engine(port, key=key, **AUTHED)
    chunk = chunk_of(6, groups=2, slot=SLOT)
    publish(writer, chunk)
    admin = password_server.admin()
    stored = admin.get(redis_key(chunk.key))
    assert isinstance(stored, bytes)
    if mode == "encrypted":  # whoever reads the server sees no KV
        assert all(content(k, SLOT) not in stored for k in chunk.members)
    # The attacker changes a payload and, where the format lets it, makes the value whole
    # again: without a key it decodes it and re-encodes it, recomputing the digest.
    if key is None:
        payloads = decode_chunk(stored, chunk.members).payloads
        tampered = encode_chunk(chunk.members, [b"T" * SLOT, payloads[1]])
    else:
        flipped = bytearray(stored)
        flipped[-SLOT // 2] ^= 0x01
        tampered = bytes(flipped)
    admin.set(redis_key(chunk.key), tampered)
    admin.close()
    if key is None:  # the control: today's format loads the tampered bytes
        assert reader.promote(chunk) is PromoteOutcome.PROMOTED
        assert host_bytes(reader, chunk)[0] == b"T" * SLOT
        return
    assert_refused(reader, chunk, "mac")


# --- TLS ---


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _tls_server(binary: str, workdir: Path, certs: Certs, *, mutual: bool) -> RedisServer:
    args = [
        "--port", "0", "--tls-port", "{port}",
        "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes" if mutual else "no",
    ]  # fmt: skip
    client: dict[str, Any] = {"host": "127.0.0.1", "ssl": True, "ssl_ca_certs": str(certs.ca)}
    if mutual:
        client.update(ssl_certfile=str(certs.client_cert), ssl_keyfile=str(certs.client_key))
    return RedisServer(binary, workdir, args, client)


@pytest.fixture
def tls_server(redis_binary: str, tmp_path: Path, certs: Certs) -> Iterator[RedisServer]:
    server = _tls_server(redis_binary, tmp_path, certs, mutual=False)
    server.start()
    yield server
    server.stop()


def test_a_tls_server_refuses_a_plaintext_client(
    tls_server: RedisServer, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    port = tls_server.port
    with caplog.at_level(logging.WARNING, logger="hybridkv.remote"):
        plaintext = RedisClient(RemoteConfig(port=port, deadline_s=1.0))
    assert any("did not answer at start-up" in r.getMessage() for r in caplog.records)
    chunk = chunk_of(7, groups=2, slot=SLOT)
    assert plaintext.set(redis_key(chunk.key), b"v", 0) is ClientFault.FAULT
    assert plaintext.exists([redis_key(chunk.key)]) is ClientFault.FAULT
    assert plaintext.get(redis_key(chunk.key)) is ClientFault.FAULT
    plaintext.close()
    admin = tls_server.admin()
    assert admin.dbsize() == 0  # nothing the plaintext client sent was executed
    # Over TLS, with the CA that signed the server's certificate, engines share chunks.
    tls = {"tls": TlsFiles(str(certs.ca))}
    a, b = engine(port, **tls), engine(port, **tls)
    publish(a, chunk)
    assert b.promote(chunk) is PromoteOutcome.PROMOTED
    assert admin.dbsize() == 1
    admin.close()


def test_a_server_certificate_from_another_ca_is_one_clean_error_at_start_up(
    tls_server: RedisServer, certs: Certs
) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        RedisClient(RemoteConfig(port=tls_server.port, tls=TlsFiles(str(certs.other_ca))))
    assert caught.value.field == "remote_tls_ca_file"
    assert "CERTIFICATE_VERIFY_FAILED" in _one_line(caught.value)


def test_a_server_asking_for_client_certificates_admits_only_a_client_with_one(
    redis_binary: str, tmp_path: Path, certs: Certs
) -> None:
    server = _tls_server(redis_binary, tmp_path, certs, mutual=True)
    server.start()
    try:
        with_cert = TlsFiles(str(certs.ca), str(certs.client_cert), str(certs.client_key))
        a = engine(server.port, tls=with_cert)
        chunk = chunk_of(8, groups=2, slot=SLOT)
        publish(a, chunk)
        with pytest.raises(HybridKVConfigError) as caught:
            RedisClient(RemoteConfig(port=server.port, tls=TlsFiles(str(certs.ca))))
        # The server's alert or its cut, whichever the client reads first (TLS 1.3 ends the
        # handshake before the server sees the missing certificate).
        assert caught.value.field == "remote_tls_cert_file"
        assert "TLS handshake" in _one_line(caught.value)
        # A client certificate signed by another CA is refused the same way.
        strange = TlsFiles(str(certs.ca), str(certs.other_ca), str(certs.other_key))
        with pytest.raises(HybridKVConfigError) as caught:
            RedisClient(RemoteConfig(port=server.port, tls=strange))
        assert caught.value.field == "remote_tls_cert_file"
    finally:
        server.stop()
