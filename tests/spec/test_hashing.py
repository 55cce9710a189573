"""Unit tests of spec.hashing, each expected value derived by hand from vLLM 0.33's contract."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from spec import hashing as S
from spec.errors import ConfigError


def by_hand(obj: object) -> bytes:
    # vLLM's sha256: pickle at HIGHEST_PROTOCOL, then SHA-256 (utils/hashing.py).
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE = by_hand("vllm-none-hash")


def test_pickle_protocol_is_5_on_supported_pythons() -> None:
    # The hash bytes depend on the protocol; 5 is the highest on Python 3.10-3.13.
    assert pickle.HIGHEST_PROTOCOL == 5
    assert S.sha256_pickle("x") == hashlib.sha256(pickle.dumps("x", protocol=5)).digest()


def test_none_hash_is_hash_of_the_default_seed() -> None:
    assert S.NONE_HASH == NONE
    assert len(NONE) == 32
    assert S.none_hash() == NONE


def test_none_hash_seed_comes_from_pythonhashseed_when_given() -> None:
    assert S.resolve_none_hash_seed(None) == "vllm-none-hash"
    assert S.resolve_none_hash_seed("0") == "0"
    assert S.none_hash(S.resolve_none_hash_seed("42")) == by_hand("42")
    assert S.none_hash("42") != NONE


def test_first_block_hash_by_hand() -> None:
    tokens = [1, 2, 3, 4]
    expected = by_hand((NONE, (1, 2, 3, 4), None))
    assert S.request_block_hashes(tokens, 4) == [expected]
    assert S.hash_block_tokens(None, tokens, None) == expected


def test_chain_second_block_uses_first_as_parent() -> None:
    first = by_hand((NONE, (5, 6), None))
    second = by_hand((first, (7, 8), None))
    assert S.request_block_hashes([5, 6, 7, 8], 2) == [first, second]


def test_same_block_content_after_different_prefix_hashes_differently() -> None:
    a = S.request_block_hashes([1, 1, 9, 9], 2)
    b = S.request_block_hashes([2, 2, 9, 9], 2)
    assert a[1] != b[1]


def test_partial_block_produces_no_hash() -> None:
    assert S.request_block_hashes([1, 2, 3], 4) == []
    assert S.request_block_hashes([1, 2, 3, 4, 5, 6, 7], 4) == S.request_block_hashes(
        [1, 2, 3, 4], 4
    )
    assert len(S.request_block_hashes(list(range(17)), 4)) == 4


def test_salt_is_on_first_block_only() -> None:
    first = by_hand((NONE, (1, 2), (("cache_salt", "s"),)))
    second = by_hand((first, (3, 4), None))
    assert S.request_block_hashes([1, 2, 3, 4], 2, cache_salt="s") == [first, second]


def test_salt_changes_hashes_only_when_set() -> None:
    plain = S.request_block_hashes([1, 2, 3, 4], 2)
    assert S.request_block_hashes([1, 2, 3, 4], 2, cache_salt=None) == plain
    salted = S.request_block_hashes([1, 2, 3, 4], 2, cache_salt="s")
    # The salt changes block 0 and, through the chain, every later block.
    assert salted[0] != plain[0]
    assert salted[1] != plain[1]


def test_empty_salt_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        S.request_block_hashes([1], 1, cache_salt="")
    assert err.value.field == "cache_salt"


def test_extra_keys_shape() -> None:
    lora = S.LoRAKey("ad", "/p")
    assert S.block_extra_keys(0, None) is None
    assert S.block_extra_keys(0, "s") == (("cache_salt", "s"),)
    assert S.block_extra_keys(16, "s") is None
    assert S.block_extra_keys(0, "s", lora) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert S.block_extra_keys(16, "s", lora) == (("lora", "ad", "/p"),)


def test_lora_is_on_every_block() -> None:
    lora_keys = (("lora", "ad", "/p"),)
    first = by_hand((NONE, (1,), lora_keys))
    second = by_hand((first, (2,), lora_keys))
    assert S.request_block_hashes([1, 2], 1, lora=S.LoRAKey("ad", "/p")) == [first, second]


def test_custom_none_hash_is_the_first_parent() -> None:
    seed_hash = by_hand("7")
    assert S.request_block_hashes([3], 1, none_hash=seed_hash) == [by_hand((seed_hash, (3,), None))]


def test_coarse_view_takes_last_fine_hash() -> None:
    fine = [bytes([i]) * 32 for i in range(7)]
    assert S.coarse_block_hashes(fine, 1) == fine
    assert S.coarse_block_hashes(fine, 2) == [fine[1], fine[3], fine[5]]
    assert S.coarse_block_hashes(fine, 3) == [fine[2], fine[5]]
    assert S.coarse_block_hashes(fine, 8) == []


def test_offload_key_format() -> None:
    h = bytes(range(32))
    assert S.offload_key(h, 0) == h + b"\x00\x00\x00\x00"
    assert S.offload_key(h, 258) == h + b"\x00\x00\x01\x02"
    assert S.offload_key(h, 2**32 - 1) == h + b"\xff\xff\xff\xff"


@pytest.mark.parametrize("bad", [-1, 2**32, True, 1.0])
def test_offload_key_refuses_bad_group(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        S.offload_key(b"x" * 32, bad)  # type: ignore[arg-type]
    assert err.value.field == "group_idx"


def test_chunk_keys_by_hand() -> None:
    # h=4, c=8, units: group 0 every 8 tokens, group 1 every 16, group 2 every 4.
    fine = [bytes([i]) * 32 for i in range(8)]  # 32 tokens hashed
    units = [8, 16, 4]
    chunk0 = S.chunk_keys(fine, 4, 8, units, 0)  # ends at token 8 -> fine index 1
    assert chunk0 == (S.GroupKey(0, fine[1] + b"\0\0\0\0"), S.GroupKey(2, fine[1] + b"\0\0\0\2"))
    chunk1 = S.chunk_keys(fine, 4, 8, units, 1)  # ends at 16 -> fine index 3, all groups
    assert [k.group_idx for k in chunk1] == [0, 1, 2]
    assert all(k.key[:32] == fine[3] for k in chunk1)
    assert len(S.complete_chunk_keys(fine, 4, 8, units)) == 4
    with pytest.raises(IndexError):
        S.chunk_keys(fine, 4, 8, units, 4)


def test_chunk_whose_end_no_unit_divides_carries_nothing() -> None:
    fine = [bytes([i]) * 32 for i in range(6)]
    assert S.chunk_keys(fine, 2, 4, [8], 0) == ()
    assert S.chunk_keys(fine, 2, 4, [8], 1)[0].key[:32] == fine[3]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hash_block_size": 0}, "hash_block_size"),
        ({"hash_block_size": True}, "hash_block_size"),
        ({"tokens": [1, -2]}, "tokens"),
        ({"tokens": [1, True]}, "tokens"),
        ({"tokens": [1.0]}, "tokens"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"hash_algo": "xxhash"}, "hash_algo"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"none_hash": b"short"}, "none_hash"),
        ({"lora": ("only-name",)}, "lora"),
    ],
)
def test_request_block_hashes_refusals(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"tokens": [1, 2], "hash_block_size": 1, **kwargs}
    with pytest.raises(ConfigError) as err:
        S.request_block_hashes(**args)  # type: ignore[arg-type]
    assert err.value.field == field


def test_refused_algo_message_names_sha256() -> None:
    with pytest.raises(ConfigError) as err:
        S.check_hash_algo("sha256_cbor")
    assert "sha256" in err.value.fix


@pytest.mark.parametrize(
    ("h", "c", "units", "field"),
    [
        (0, 4, [4], "hash_block_size"),
        (4, 0, [4], "chunk_size"),
        (4, 6, [4], "chunk_size"),
        (4, 8, [], "units"),
        (4, 8, [6], "units"),
        (4, 8, [0], "units"),
        (4, 8, [True], "units"),
    ],
)
def test_chunk_geometry_refusals(h: int, c: int, units: list[int], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        S.complete_chunk_keys([], h, c, units)
    assert err.value.field == field


def test_scale_refusal() -> None:
    with pytest.raises(ConfigError) as err:
        S.coarse_block_hashes([], 0)
    assert err.value.field == "scale"
