"""hybridkv.hashing's contract at its edges: refusals, view indexing and the NONE_HASH value.

The differential tests compare the library with the spec on accepted inputs and on the field a
refusal names; these pin the rest of what a caller sees: each refusal's value, problem, fix and
one-line message, the boundaries of every check, Python's sequence rules on the lazy views
(negative indices, slices, an out-of-range index), and the exact bytes of NONE_HASH, derived
here from the pickle format rather than by calling ``pickle.dumps``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest

import hybridkv.hashing as H
from hybridkv.errors import HybridKVConfigError

BLOCK = 4
ALGO_FIX = 'use "sha256", vLLM\'s default'
NEEDS_PACKAGES = "needs cbor2 or xxhash, which hybridkv does not depend on"
NOT_AN_ALGO = "is not a vLLM 0.33 prefix_caching_hash_algo"


def loose(value: object) -> Any:
    """``value`` typed as Any: the refusals below pass what the signatures forbid on purpose."""
    return value


def grown(blocks: int, hash_block_size: int = BLOCK) -> H.RequestHashList:
    hl = H.RequestHashList(hash_block_size)
    hl.append_tokens(list(range(blocks * hash_block_size)))
    return hl


def refusal(
    call: Callable[[], object], field: str, value: object, problem: str, fix: str
) -> HybridKVConfigError:
    """Run ``call``, which must refuse; check every part of the error and its message."""
    with pytest.raises(HybridKVConfigError) as info:
        call()
    err = info.value
    assert (err.field, err.problem, err.fix) == (field, problem, fix)
    assert type(err.value) is type(value)
    assert err.value == value
    assert str(err) == f"{field}={value!r}: {problem}; {fix}"
    return err


# (call, field, value, problem, fix): one row per refusal the module raises.
REFUSALS: list[tuple[str, Callable[[], object], str, object, str, str]] = [
    (
        "block-size-zero",
        lambda: H.RequestHashList(0),
        "hash_block_size",
        0,
        "must be a positive int",
        "pass an int >= 1",
    ),
    (
        "block-size-bool",
        lambda: H.RequestHashList(loose(True)),
        "hash_block_size",
        True,
        "must be a positive int",
        "pass an int >= 1",
    ),
    (
        "scale-zero",
        lambda: grown(2).coarse(0),
        "scale",
        0,
        "must be a positive int",
        "pass an int >= 1",
    ),
    (
        "chunk-size-negative",
        lambda: grown(2).chunk_view(-4, (4,)),
        "chunk_size",
        -4,
        "must be a positive int",
        "pass an int >= 1",
    ),
    (
        "algo-needs-package",
        lambda: H.RequestHashList(BLOCK, hash_algo="xxhash"),
        "hash_algo",
        "xxhash",
        NEEDS_PACKAGES,
        ALGO_FIX,
    ),
    (
        "algo-cbor",
        lambda: H.compute_none_hash("1", hash_algo="sha256_cbor"),
        "hash_algo",
        "sha256_cbor",
        NEEDS_PACKAGES,
        ALGO_FIX,
    ),
    (
        "algo-unknown",
        lambda: H.compute_none_hash("1", hash_algo="md5"),
        "hash_algo",
        "md5",
        NOT_AN_ALGO,
        ALGO_FIX,
    ),
    (
        "algo-case",
        lambda: H.RequestHashList(BLOCK, hash_algo="SHA256"),
        "hash_algo",
        "SHA256",
        NOT_AN_ALGO,
        ALGO_FIX,
    ),
    (
        "seed-not-str",
        lambda: H.compute_none_hash(loose(7)),
        "seed",
        7,
        "must be a str",
        "pass the PYTHONHASHSEED string",
    ),
    (
        "group-bool",
        lambda: H.make_offload_key(b"k", loose(True)),
        "group_idx",
        True,
        "must be an int",
        "pass the group index",
    ),
    (
        "group-str",
        lambda: grown(1).offload_key(0, loose("0")),
        "group_idx",
        "0",
        "must be an int",
        "pass the group index",
    ),
    (
        "group-negative",
        lambda: H.make_offload_key(b"k", -1),
        "group_idx",
        -1,
        "must lie in [0, 2**32)",
        "pass the KV cache group index",
    ),
    (
        "group-past-limit",
        lambda: grown(1).offload_key(0, 2**32),
        "group_idx",
        2**32,
        "must lie in [0, 2**32)",
        "pass the KV cache group index",
    ),
    (
        "chunk-not-multiple",
        lambda: grown(2).chunk_view(6, (4,)),
        "chunk_size",
        6,
        "not a multiple of hash_block_size 4",
        "pick a multiple of hash_block_size",
    ),
    (
        "units-empty",
        lambda: grown(2).chunk_view(8, ()),
        "units",
        (),
        "must be a non-empty sequence",
        "one per group",
    ),
    (
        "units-str",
        lambda: grown(2).chunk_view(8, loose("48")),
        "units",
        "48",
        "must be a non-empty sequence",
        "one per group",
    ),
    (
        "units-set",
        lambda: grown(2).chunk_keys(0, 8, loose({4})),
        "units",
        {4},
        "must be a non-empty sequence",
        "one per group",
    ),
    (
        "unit-not-multiple",
        lambda: grown(2).chunk_view(8, (4, 6)),
        "units",
        6,
        "not a positive multiple of hash_block_size 4",
        "pass each group's offload unit in tokens",
    ),
    (
        "unit-zero",
        lambda: grown(2).chunk_view(8, (0,)),
        "units",
        0,
        "not a positive multiple of hash_block_size 4",
        "pass each group's offload unit in tokens",
    ),
    (
        "salt-empty",
        lambda: H.RequestHashList(BLOCK, cache_salt=""),
        "cache_salt",
        "",
        "must be None or a non-empty str",
        "pass None for no salt",
    ),
    (
        "salt-bytes",
        lambda: H.RequestHashList(BLOCK, cache_salt=loose(b"s")),
        "cache_salt",
        b"s",
        "must be None or a non-empty str",
        "pass None for no salt",
    ),
    (
        "lora-one-part",
        lambda: H.RequestHashList(BLOCK, lora=loose(("name",))),
        "lora",
        ("name",),
        "must be LoRAKey(name, path)",
        "pass LoRAKey",
    ),
    (
        "lora-path-not-str",
        lambda: H.RequestHashList(BLOCK, lora=loose(("name", 3))),
        "lora",
        ("name", 3),
        "must be LoRAKey(name, path)",
        "pass LoRAKey",
    ),
    (
        "none-hash-short",
        lambda: H.RequestHashList(BLOCK, none_hash=b"x" * 31),
        "none_hash",
        b"x" * 31,
        "must be 32 bytes",
        "use compute_none_hash(seed)",
    ),
    (
        "none-hash-str",
        lambda: H.RequestHashList(BLOCK, none_hash=loose("x" * 32)),
        "none_hash",
        "x" * 32,
        "must be 32 bytes",
        "use compute_none_hash(seed)",
    ),
    (
        "token-negative",
        lambda: H.RequestHashList(BLOCK).append_tokens([1, -1]),
        "tokens",
        -1,
        "a token id must be a non-negative int",
        "pass plain Python ints",
    ),
    (
        "token-bool",
        lambda: H.RequestHashList(BLOCK).append_tokens(loose([0, True])),
        "tokens",
        True,
        "a token id must be a non-negative int",
        "pass plain Python ints",
    ),
]


@pytest.mark.parametrize(
    ("call", "field", "value", "problem", "fix"),
    [pytest.param(*row[1:], id=row[0]) for row in REFUSALS],
)
def test_refusal_names_field_value_problem_and_fix(
    call: Callable[[], object], field: str, value: object, problem: str, fix: str
) -> None:
    refusal(call, field, value, problem, fix)


def test_refusal_keeps_the_value_given_not_a_copy() -> None:
    lora = loose(("name",))
    err = refusal(
        lambda: H.RequestHashList(BLOCK, lora=lora),
        "lora",
        ("name",),
        "must be LoRAKey(name, path)",
        "pass LoRAKey",
    )
    assert err.value is lora


def test_accepted_boundaries() -> None:
    """Each check's smallest and largest accepted value is accepted, and gives what it should."""
    assert H.RequestHashList(1).hash_block_size == 1
    hl = grown(3)
    assert hl.coarse(1)[2] == hl[2]
    assert H.make_offload_key(b"k", 0) == b"k\x00\x00\x00\x00"
    assert H.make_offload_key(b"k", 2**32 - 1) == b"k\xff\xff\xff\xff"
    # Four big-endian bytes: 0x01020304, not its little-endian mirror.
    assert H.make_offload_key(b"ab", 0x01020304) == b"ab\x01\x02\x03\x04"
    assert hl.offload_key(-1, 258) == hl[2] + b"\x00\x00\x01\x02"
    assert H.compute_none_hash("", hash_algo="sha256") == H.compute_none_hash("")
    assert H.RequestHashList(BLOCK, cache_salt="s", lora=H.LoRAKey("", "")).append_tokens([]) == 0


def _pickled_short_str(text: str) -> bytes:
    """``text`` pickled at protocol 5, written out from the pickle format (PEP 3154, PEP 574).

    PROTO 5; one FRAME holding SHORT_BINUNICODE (1-byte length), MEMOIZE and STOP.
    """
    data = text.encode()
    assert len(data) < 256
    body = b"\x8c" + bytes([len(data)]) + data + b"\x94" + b"."
    return b"\x80\x05" + b"\x95" + len(body).to_bytes(8, "little") + body


def test_none_hash_is_sha256_of_the_pickled_seed() -> None:
    # vLLM 0.33: NONE_HASH = sha256(pickle.dumps(seed, HIGHEST_PROTOCOL)), seed
    # PYTHONHASHSEED when set, else "vllm-none-hash" for sha256.
    assert H.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    for seed in ("vllm-none-hash", "0", "1234", ""):
        expected = hashlib.sha256(_pickled_short_str(seed)).digest()
        assert H.compute_none_hash(seed) == expected
    assert H.compute_none_hash() == hashlib.sha256(_pickled_short_str("vllm-none-hash")).digest()


def test_append_returns_an_int_count_and_counts_ints() -> None:
    hl = H.RequestHashList(BLOCK)
    assert (n := hl.append_tokens(list(range(2 * BLOCK + 1)))) == 2
    assert type(n) is int
    assert (n := hl.append_tokens(list(range(BLOCK - 1)))) == 1
    assert type(n) is int
    assert (n := hl.append_tokens([5])) == 0
    assert type(n) is int
    assert hl.hashes_computed == 3
    assert type(hl.hashes_computed) is int
    assert hl.num_tokens == 3 * BLOCK + 1


def test_refused_append_changes_nothing() -> None:
    hl = H.RequestHashList(BLOCK)
    hl.append_tokens([1, 2, 3, 4, 5])
    before = (list(hl.hashes), hl.num_tokens, hl.hashes_computed)
    with pytest.raises(HybridKVConfigError):
        hl.append_tokens([6, 7, -8])
    assert (list(hl.hashes), hl.num_tokens, hl.hashes_computed) == before
    # The tail [5] is still there: three more tokens complete the second block as if no refusal.
    ref = H.RequestHashList(BLOCK)
    ref.append_tokens([1, 2, 3, 4, 5, 6, 7, 8])
    assert hl.append_tokens([6, 7, 8]) == 1
    assert list(hl.hashes) == list(ref.hashes)


def test_block_view_indexes_like_a_sequence() -> None:
    hl = grown(6)
    fine = [hl[i] for i in range(6)]
    view = hl.hashes
    assert len(view) == 6
    assert view[-1] == fine[5]
    assert view[-6] == fine[0]
    assert view[1:4] == tuple(fine[1:4])
    assert view[::-2] == tuple(fine[::-2])
    assert view[4:100] == tuple(fine[4:])
    assert view[:] == tuple(fine)
    assert view[6:] == ()
    coarse = hl.coarse(4)  # one entry: fine hash 3; fine 4 and 5 do not fill a second
    assert len(coarse) == 1
    assert coarse[0] == coarse[-1] == fine[3]
    assert coarse[:] == (fine[3],)
    assert coarse[-5:5] == (fine[3],)
    two = hl.coarse(2)
    assert two[-1] == fine[5]
    assert two[-3] == fine[1]
    assert two[::2] == (fine[1], fine[5])


@pytest.mark.parametrize("index", [6, -7, 50])
def test_block_view_out_of_range(index: int) -> None:
    view = grown(6).hashes
    with pytest.raises(IndexError) as info:
        view[index]
    assert str(info.value) == f"block index {index} out of range for 6 hashes"


@pytest.mark.parametrize("index", [2, -3])
def test_coarse_view_out_of_range(index: int) -> None:
    view = grown(5).coarse(2)  # 5 fine hashes: 2 coarse entries and a spare fine hash
    with pytest.raises(IndexError) as info:
        view[index]
    assert str(info.value) == f"block index {index} out of range for 2 hashes"


def test_chunk_view_indexes_like_a_sequence() -> None:
    hl = grown(8)  # 32 tokens: chunks of 8 tokens end at fine hashes 1, 3, 5, 7
    fine = [hl[i] for i in range(8)]
    view = hl.chunk_view(8, (4, 16))

    def keys(k: int) -> tuple[H.GroupKey, ...]:
        end = fine[2 * k + 1]
        g1 = (H.GroupKey(1, end + b"\x00\x00\x00\x01"),) if k % 2 else ()
        return (H.GroupKey(0, end + b"\x00\x00\x00\x00"), *g1)

    assert len(view) == 4
    assert [view[k] for k in range(4)] == [keys(k) for k in range(4)]
    assert view[-1] == keys(3)
    assert view[-4] == keys(0)
    assert view[1:3] == (keys(1), keys(2))
    assert view[::-1] == tuple(keys(k) for k in (3, 2, 1, 0))
    assert view[2:99] == (keys(2), keys(3))
    assert view[4:] == ()
    assert hl.chunk_keys(-1, 8, (4, 16)) == keys(3)


@pytest.mark.parametrize("index", [3, -4, 10])
def test_chunk_view_out_of_range(index: int) -> None:
    # 7 fine hashes of 4 tokens = 28 tokens: three complete chunks of 8 and a partial one.
    view = grown(7).chunk_view(8, (8,))
    with pytest.raises(IndexError) as info:
        view[index]
    assert str(info.value) == f"chunk index {index} out of range for 3 complete chunks"
