"""Keyed chunk values (format 3, HMAC-SHA256; format 4, AES-256-GCM) and the secrets behind them
(hybridkv.remote.codec, hybridkv.remote.security): no server needed.

The MAC is recomputed here from the documented construction (HMAC-SHA256 under the key
derived from the secret with the label ``hybridkv/remote/mac/v1``, over the length-prefixed
chunk key, the header and the payloads), so a codec that MACed fewer bytes fails. Every forgery
an attacker without the secret can make is refused, each with its kind.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import sys
from pathlib import Path

import pytest
from _certs import Certs, make_certs
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    AUTH_REFUSALS,
    Corruption,
    Credentials,
    FleetKey,
    Refusals,
    RemoteConfig,
    TlsFiles,
    ValueFormat,
    chunk_key,
    decode_chunk,
    encode_chunk,
    read_secret,
)
from hybridkv.remote.client import connection_kwargs

MEMBERS = (b"k-attn-0", b"k-swa-1", b"k-mamba-2")
PAYLOADS = (b"SECRET-KV-" * 8, b"bb" * 5, b"")
SECRET = b"fleet-secret-0123456789abcdef-0123456789"
KEY = chunk_key(b"ns", MEMBERS)
MAC_KEY = FleetKey(SECRET)
SEAL_KEY = FleetKey(SECRET, encrypt=True)
HEAD = 10 + sum(4 + len(m) for m in MEMBERS) + 8 * len(MEMBERS)  # where the seal starts


def _version(value: bytes) -> int:
    return int(struct.unpack(">H", value[4:6])[0])


@pytest.mark.parametrize("key", [MAC_KEY, SEAL_KEY], ids=["mac", "sealed"])
def test_keyed_round_trip(key: FleetKey) -> None:
    value = encode_chunk(MEMBERS, PAYLOADS, key, KEY)
    assert _version(value) == (ValueFormat.SEALED if key.encrypt else ValueFormat.MAC)
    decoded = decode_chunk(value, MEMBERS, key, KEY)
    assert decoded.corruption is None
    assert decoded.payloads == PAYLOADS


@given(
    st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=4, unique=True),
    st.booleans(),
    st.data(),
)
def test_keyed_round_trip_any_members(
    members: list[bytes], encrypt: bool, data: st.DataObject
) -> None:
    key = SEAL_KEY if encrypt else MAC_KEY
    payloads = [data.draw(st.binary(max_size=64)) for _ in members]
    ck = chunk_key(b"ns", members)
    decoded = decode_chunk(encode_chunk(members, payloads, key, ck), members, key, ck)
    assert decoded.payloads == tuple(payloads)


def test_the_mac_is_hmac_sha256_over_chunk_key_header_and_payloads() -> None:
    value = encode_chunk(MEMBERS, PAYLOADS, FleetKey(SECRET), KEY)
    mac_key = hmac.new(SECRET, b"hybridkv/remote/mac/v1", hashlib.sha256).digest()
    message = struct.pack(">I", 32) + KEY + value[:HEAD] + b"".join(PAYLOADS)
    assert value[HEAD : HEAD + 32] == hmac.new(mac_key, message, hashlib.sha256).digest()
    assert value[HEAD + 32 :] == b"".join(PAYLOADS)  # MAC-only: the payloads in the clear


def test_a_sealed_value_opens_by_the_documented_construction() -> None:
    # AES-256-GCM under HMAC-SHA256(aead key, salt), a zero nonce, and as associated data the
    # length-prefixed chunk key, the header and the salt; the tag after the ciphertext.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    value = encode_chunk(MEMBERS, PAYLOADS, FleetKey(SECRET, encrypt=True), KEY)
    aead_key = hmac.new(SECRET, b"hybridkv/remote/aes-gcm/v1", hashlib.sha256).digest()
    salt = value[HEAD : HEAD + 32]
    own = hmac.new(aead_key, salt, hashlib.sha256).digest()
    aad = struct.pack(">I", 32) + KEY + value[:HEAD] + salt
    assert AESGCM(own).decrypt(bytes(12), value[HEAD + 32 :], aad) == b"".join(PAYLOADS)


def test_a_sealed_value_shows_no_payload_byte_and_never_repeats() -> None:
    first = encode_chunk(MEMBERS, PAYLOADS, SEAL_KEY, KEY)
    second = encode_chunk(MEMBERS, PAYLOADS, SEAL_KEY, KEY)
    assert b"SECRET-KV" not in first
    assert len(first) == HEAD + 32 + sum(map(len, PAYLOADS)) + 16  # salt, ciphertext, tag
    assert first[HEAD:] != second[HEAD:]  # a fresh salt, so a fresh key, per value
    assert decode_chunk(second, MEMBERS, SEAL_KEY, KEY).payloads == PAYLOADS


def test_a_reader_with_the_secret_reads_either_keyed_format() -> None:
    # The encrypt setting decides what an engine writes; both formats are sealed under the
    # same secret, so a fleet can turn encryption on engine by engine.
    for writer, reader in ((MAC_KEY, SEAL_KEY), (SEAL_KEY, MAC_KEY)):
        value = encode_chunk(MEMBERS, PAYLOADS, writer, KEY)
        assert decode_chunk(value, MEMBERS, reader, KEY).payloads == PAYLOADS


def _flip(value: bytes, at: int) -> bytes:
    damaged = bytearray(value)
    damaged[at] ^= 0x01
    return bytes(damaged)


def _forgeries(key: FleetKey) -> dict[str, tuple[bytes, FleetKey | None, bytes, Corruption]]:
    """Values a writer without the secret can make, as (value, reader key, chunk key, kind)."""
    value = encode_chunk(MEMBERS, PAYLOADS, key, KEY)
    plain = encode_chunk(MEMBERS, (b"PLANTED!" * 10, *PAYLOADS[1:]))  # today's format
    as_mac = plain[:4] + struct.pack(">H", ValueFormat.MAC) + plain[6:]  # digest as a MAC
    other = FleetKey(b"another-fleet-secret-0123456789abcdef")
    return {
        "unkeyed value": (plain, key, KEY, Corruption.KEYING),
        "digest relabelled as a MAC": (as_mac, key, KEY, Corruption.MAC),
        "payload byte flipped": (_flip(value, HEAD + 40), key, KEY, Corruption.MAC),
        "last byte flipped": (_flip(value, len(value) - 1), key, KEY, Corruption.MAC),
        "seal flipped": (_flip(value, HEAD), key, KEY, Corruption.MAC),
        "length byte flipped": (_flip(value, HEAD - 1), key, KEY, Corruption.LENGTHS),
        "under another chunk key": (value, key, bytes(32), Corruption.MAC),
        "by another secret": (encode_chunk(MEMBERS, PAYLOADS, other, KEY), key, KEY,
                              Corruption.MAC),
        "keyed value, reader without a key": (value, None, b"", Corruption.KEYING),
    }  # fmt: skip


@pytest.mark.parametrize("key", [MAC_KEY, SEAL_KEY], ids=["mac", "sealed"])
@pytest.mark.parametrize("case", sorted(_forgeries(MAC_KEY)))
def test_every_forgery_is_refused_and_loads_nothing(key: FleetKey, case: str) -> None:
    value, reader, ck, kind = _forgeries(key)[case]
    decoded = decode_chunk(value, MEMBERS, reader, ck)
    assert decoded.corruption is kind
    assert decoded.payloads == ()


def test_without_a_key_a_recomputed_digest_is_accepted() -> None:
    # What format 2 exposes (the docs' threat model): anyone who can write to the server can
    # replace a payload and recompute the digest; only a fleet key refuses it.
    forged = (b"PLANTED!" * 10, *PAYLOADS[1:])
    planted = encode_chunk(MEMBERS, forged)
    assert decode_chunk(planted, MEMBERS).payloads == forged
    assert decode_chunk(planted, MEMBERS, MAC_KEY, KEY).corruption is Corruption.KEYING


@pytest.mark.parametrize("call", ["encode", "decode"])
@pytest.mark.parametrize("bad", [b"", b"short", "text"])
def test_a_keyed_value_needs_its_chunk_key(call: str, bad: object) -> None:
    def run() -> object:
        if call == "encode":
            return encode_chunk(MEMBERS, PAYLOADS, MAC_KEY, bad)  # type: ignore[arg-type]
        return decode_chunk(b"", MEMBERS, MAC_KEY, bad)  # type: ignore[arg-type]

    with pytest.raises(HybridKVConfigError) as caught:
        run()
    refused = caught.value
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "chunk_key",
        bad,
        "a keyed value needs its 32-byte chunk key",
        "pass chunk.key",
    )


# --- the fleet key ---


def test_a_fleet_key_hides_its_secret_and_names_itself_by_a_derived_id() -> None:
    assert SECRET.decode() not in repr(MAC_KEY)
    assert repr(MAC_KEY) == f"FleetKey(encrypt=False, key_id='{MAC_KEY.key_id}')"
    assert MAC_KEY.key_id == FleetKey(SECRET, encrypt=True).key_id
    assert MAC_KEY.key_id != FleetKey(SECRET + b"!").key_id
    assert MAC_KEY.key_id not in SECRET.hex()


FIX_SECRET = "make one: openssl rand -base64 32 > fleet.secret"


@pytest.mark.parametrize(
    ("secret", "encrypt", "whole"),
    [
        (b"", False, ("remote_secret", "<0 bytes>", "must be at least 32 bytes", FIX_SECRET)),
        (b"x" * 31, False,
         ("remote_secret", "<31 bytes>", "must be at least 32 bytes", FIX_SECRET)),
        ("a string secret of forty characters..", False,
         ("remote_secret", "<str>", "must be at least 32 bytes", FIX_SECRET)),
        (b"x" * 32, "yes", ("remote_encrypt", "yes", "must be a bool", "pass one")),
    ],
)  # fmt: skip
def test_a_bad_fleet_key_is_refused_whole(
    secret: object, encrypt: object, whole: tuple[str, object, str, str]
) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        FleetKey(secret, encrypt)  # type: ignore[arg-type]
    refused = caught.value
    assert (refused.field, refused.value, refused.problem, refused.fix) == whole
    assert "x" * 31 not in str(refused)


def test_a_secret_of_exactly_32_bytes_is_accepted() -> None:
    assert FleetKey(b"x" * 32).key_id


def test_encryption_without_cryptography_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    FleetKey(SECRET)  # MAC only: cryptography is not needed
    with pytest.raises(HybridKVConfigError) as caught:
        FleetKey(SECRET, encrypt=True)
    refused = caught.value
    assert (refused.field, refused.value) == ("remote_encrypt", True)
    assert refused.problem.startswith(
        "encryption needs the cryptography package, which does not import ("
    )
    assert refused.fix == (
        "install it: pip install 'hybridkv[remote-crypto]' (or pip install cryptography)"
    )


# --- secrets from the environment or a file ---


def test_a_secret_comes_from_an_environment_variable_or_a_file(tmp_path: Path) -> None:
    assert read_secret("remote_secret", None, None, {}) is None
    assert read_secret("remote_secret", "FLEET", None, {"FLEET": "abc"}) == b"abc"
    path = tmp_path / "secret"
    path.write_bytes(b"from-a-file\n")
    assert read_secret("remote_secret", None, str(path), {}) == b"from-a-file"
    path.write_bytes(b"crlf\r\n")
    assert read_secret("remote_secret", None, str(path), {}) == b"crlf"


def test_each_missing_secret_is_refused_whole_and_never_shows_the_secret(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    nope = str(tmp_path / "nope")
    export = "export FLEET in the engine's environment (every vLLM process inherits it)"
    unset = "names an environment variable that is unset or empty in this process"
    cases = [
        (("FLEET", None, {}), ("remote_secret_env", "FLEET", unset, export)),
        (("FLEET", None, {"FLEET": ""}), ("remote_secret_env", "FLEET", unset, export)),
        ((None, nope, {}),
         ("remote_secret_file", nope, "cannot be read (No such file or directory)",
          "fix the path")),
        ((None, str(empty), {}),
         ("remote_secret_file", str(empty), "is empty", "write the secret in it")),
        (("FLEET", str(empty), {"FLEET": "hunter2"}),
         ("remote_secret_file", str(empty), "is given with remote_secret_env too",
          "give only one")),
    ]  # fmt: skip
    for (env, path, environ), whole in cases:
        with pytest.raises(HybridKVConfigError) as caught:
            read_secret("remote_secret", env, path, environ)
        refused = caught.value
        assert (refused.field, refused.value, refused.problem, refused.fix) == whole
        assert "hunter2" not in str(refused)


# --- credentials, TLS files, redis-py's keywords ---


def test_credentials_hide_the_password_and_are_refused_whole() -> None:
    assert "hunter2" not in repr(Credentials("alice", "hunter2"))
    must = ("must be a non-empty str", "pass one")
    give = "give the user's password through remote_password_env or remote_password_file"
    cases = [
        ({"username": 7, "password": "pw"}, ("remote_username", 7, *must)),
        ({"username": "", "password": "pw"}, ("remote_username", "", *must)),
        ({"password": ""}, ("remote_password", "<hidden>", *must)),
        ({"password": 7}, ("remote_password", "<hidden>", *must)),
        ({"username": "alice"}, ("remote_username", "alice", "is set without a password", give)),
    ]
    for arguments, whole in cases:
        with pytest.raises(HybridKVConfigError) as caught:
            Credentials(**arguments)
        refused = caught.value
        assert (refused.field, refused.value, refused.problem, refused.fix) == whole


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_files_must_load_and_are_refused_whole(tmp_path: Path, certs: Certs) -> None:
    ca, cert, key = str(certs.ca), str(certs.client_cert), str(certs.client_key)
    assert TlsFiles(ca, cert, key) == TlsFiles(ca, cert, key)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    missing = str(tmp_path / "missing.crt")
    unread = ("is not a readable file", "fix the path")
    pem_fix = "give the CA certificate (PEM) that signed the server's"
    key_fix = "give the client certificate and its unencrypted private key (PEM)"
    cases = [
        ((missing,), ("remote_tls_ca_file", missing, *unread)),
        ((ca, missing, key), ("remote_tls_cert_file", missing, *unread)),
        ((ca, cert, missing), ("remote_tls_key_file", missing, *unread)),
        ((ca, cert), ("remote_tls_cert_file", cert,
                      "and remote_tls_key_file come together (a client certificate needs its key)",
                      "give both, or neither")),
        ((str(garbage),),
         ("remote_tls_ca_file", str(garbage), "holds no PEM certificate", pem_fix)),
        ((ca, cert, str(certs.other_key)), ("remote_tls_cert_file", cert,
         "and remote_tls_key_file do not load as a certificate and its key", key_fix)),
    ]  # fmt: skip
    for files, (field, value, problem, fix) in cases:
        with pytest.raises(HybridKVConfigError) as caught:
            TlsFiles(*files)
        refused = caught.value
        assert (refused.field, refused.value, refused.fix) == (field, value, fix)
        assert refused.problem.startswith(problem)


def test_connection_keywords_carry_credentials_and_tls(certs: Certs) -> None:
    pem = certs.ca
    plain = connection_kwargs(RemoteConfig(port=7000, deadline_s=0.2, connect_timeout_s=0.3))
    assert plain.keys() == {"socket_connect_timeout", "socket_timeout", "retry"}
    assert (plain["socket_connect_timeout"], plain["socket_timeout"]) == (0.3, 0.2)
    tls = TlsFiles(str(pem), str(certs.client_cert), str(certs.client_key))
    secure = connection_kwargs(RemoteConfig(credentials=Credentials("alice", "pw"), tls=tls))
    assert {k: v for k, v in secure.items() if k not in plain} == {
        "username": "alice",
        "password": "pw",
        "ssl": True,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
        "ssl_ca_certs": str(pem),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }


# --- refusals: counted, the first of each kind logged ---


def test_refusals_are_counted_and_the_first_forgery_of_each_kind_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="hybridkv.remote"):
        for kind in (Corruption.MAC, Corruption.MAC, Corruption.DIGEST, Corruption.KEYING):
            refusals.note(kind, KEY)
    assert refusals.counts()["mac"] == 2
    assert refusals.counts()["digest"] == refusals.counts()["keying"] == 1
    assert refusals.unauthenticated() == 3
    assert {Corruption.MAC, Corruption.KEYING} == AUTH_REFUSALS
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2  # one per authentication kind; DIGEST is plain corruption
    why = {
        "mac": "its MAC does not verify under this engine's fleet key (written without the "
        "fleet secret, under another secret, for another chunk key, or altered since)",
        "keying": "it is not sealed the way this engine's fleet key expects (an engine with "
        "another remote_secret setting, or none, wrote it into the same namespace)",
    }
    assert logged == [
        f"hybridkv remote tier: refused chunk {KEY.hex()}: {why[kind]} ({kind}); not loaded, "
        "recomputed. Further refusals of this kind are counted, not logged."
        for kind in ("mac", "keying")
    ]
