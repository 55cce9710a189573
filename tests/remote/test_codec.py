"""Chunk keys and chunk values (hybridkv.remote.codec): no server needed.

Every Corruption kind is produced by a concrete damaged value and each is told apart, so a
decoder that skipped one check would fail here.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    FORMAT_VERSION,
    MAGIC,
    Corruption,
    ValueFormat,
    chunk_key,
    decode_chunk,
    encode_chunk,
    make_chunk,
    redis_key,
)

MEMBERS = (b"k-attn-0", b"k-swa-1", b"k-mamba-2")
PAYLOADS = (b"a" * 16, b"bb" * 5, b"")


def test_chunk_key_is_sha256_over_namespace_nul_and_length_prefixed_members() -> None:
    expected = hashlib.sha256(
        b"ns\x00" + b"".join(struct.pack(">I", len(m)) + m for m in MEMBERS)
    ).digest()
    assert chunk_key(b"ns", MEMBERS) == expected
    assert make_chunk(b"ns", MEMBERS).key == expected
    assert make_chunk(b"ns", MEMBERS).members == MEMBERS


def test_chunk_key_separates_namespace_order_and_boundaries() -> None:
    base = chunk_key(b"ns", [b"ab", b"c"])
    assert chunk_key(b"ns2", [b"ab", b"c"]) != base
    assert chunk_key(b"ns", [b"c", b"ab"]) != base
    assert chunk_key(b"ns", [b"a", b"bc"]) != base  # same concatenation, other members
    assert chunk_key(b"n", [b"sab", b"c"]) != base


@pytest.mark.parametrize(
    ("members", "field"),
    [([], "members"), (b"key", "members"), ([b"a", b"a"], "members"), ([b""], "members")],
)
def test_bad_members_name_the_field(members: object, field: str) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        chunk_key(b"ns", members)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_namespace_must_be_bytes() -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        chunk_key("ns", MEMBERS)  # type: ignore[arg-type]
    assert caught.value.field == "namespace"


def test_one_payload_per_member() -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        encode_chunk(MEMBERS, PAYLOADS[:2])
    assert caught.value.field == "payloads"


def test_round_trip_and_header() -> None:
    value = encode_chunk(MEMBERS, PAYLOADS)
    assert value[:4] == MAGIC
    assert struct.unpack(">H", value[4:6]) == (FORMAT_VERSION,)
    decoded = decode_chunk(value, MEMBERS)
    assert decoded.corruption is None
    assert decoded.payloads == PAYLOADS


def test_digest_is_sha256_over_length_prefixed_payloads_in_format_2() -> None:
    # The layout the module docstring gives, byte for byte (format 2: SHA-256; 1 was BLAKE2b).
    value = encode_chunk(MEMBERS, PAYLOADS)
    assert FORMAT_VERSION == 2
    at = 10 + sum(4 + len(m) for m in MEMBERS) + 8 * len(MEMBERS)
    expected = hashlib.sha256(b"".join(struct.pack(">Q", len(p)) + p for p in PAYLOADS))
    assert value[at : at + 32] == expected.digest()
    assert value[at + 32 :] == b"".join(PAYLOADS)


def test_redis_key_is_readable_and_distinct() -> None:
    key = chunk_key(b"ns", MEMBERS)
    assert redis_key(key) == b"hybridkv:chunk:" + key.hex().encode()


@given(
    st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=4, unique=True),
    st.data(),
)
def test_round_trip_any_members(members: list[bytes], data: st.DataObject) -> None:
    payloads = [data.draw(st.binary(max_size=64)) for _ in members]
    assert decode_chunk(encode_chunk(members, payloads), members).payloads == tuple(payloads)


def _damaged() -> dict[str, tuple[bytes, Corruption]]:
    value = encode_chunk(MEMBERS, PAYLOADS)
    head = 4 + 2 + 4
    flipped = bytearray(value)
    flipped[-20] ^= 0xFF  # inside the first payload
    other_version = value[:4] + struct.pack(">H", max(ValueFormat) + 1) + value[6:]
    version_one = value[:4] + struct.pack(">H", 1) + value[6:]  # the old BLAKE2b digest
    return {
        "empty": (b"", Corruption.TRUNCATED),
        "header only": (value[:head], Corruption.TRUNCATED),
        "cut in the keys": (value[: head + 6], Corruption.TRUNCATED),
        "cut in the lengths": (value[: head + 40], Corruption.TRUNCATED),
        "magic": (b"XXXX" + value[4:], Corruption.MAGIC),
        "version": (other_version, Corruption.VERSION),
        "version 1": (version_one, Corruption.VERSION),
        "other count": (encode_chunk(MEMBERS[:2], PAYLOADS[:2]), Corruption.MEMBERS),
        "other order": (encode_chunk(MEMBERS[::-1], PAYLOADS[::-1]), Corruption.MEMBERS),
        "other key": (encode_chunk((b"k-attn-X", *MEMBERS[1:]), PAYLOADS), Corruption.MEMBERS),
        "one byte more": (value + b"!", Corruption.LENGTHS),
        "one byte less": (value[:-1], Corruption.LENGTHS),
        "payload flipped": (bytes(flipped), Corruption.DIGEST),
    }


@pytest.mark.parametrize("case", sorted(_damaged()))
def test_every_damage_is_corrupt_and_loads_nothing(case: str) -> None:
    value, corruption = _damaged()[case]
    decoded = decode_chunk(value, MEMBERS)
    assert decoded.corruption is corruption
    assert decoded.payloads == ()


def test_payloads_swapped_between_members_fail_the_digest() -> None:
    # Same lengths, same bytes overall, but each member's payload moved: only the digest
    # (length-prefixed per payload, in member order) tells.
    value = encode_chunk(MEMBERS[:2], (b"xx", b"yy"))
    swapped = value[:-4] + b"yyxx"
    assert decode_chunk(swapped, MEMBERS[:2]).corruption is Corruption.DIGEST
