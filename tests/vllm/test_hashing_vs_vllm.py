"""spec.hashing (and hybridkv.hashing) against vLLM 0.33's own request block hasher.

The vLLM side is the real path: a ``vllm.v1.request.Request`` built with ``SamplingParams`` and
the hasher from ``get_request_block_hasher(hash_block_size, sha256)``; output tokens arrive
through ``append_output_token_ids`` as in decoding.

PYTHONHASHSEED: vLLM reads it inside ``init_none_hash``. Each case sets or removes it in
``os.environ`` explicitly, re-initializes vLLM's NONE_HASH, and restores both afterwards, so the
seed under test is the one the case names (not whatever the shell exported).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given
from hypothesis import strategies as st

# Not importorskip("vllm"): with tests/ on sys.path, tests/vllm itself imports as a namespace
# package named vllm, so only a real submodule proves vLLM is installed.
pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="needs vLLM 0.33 (run by `nox -s vllm`)")

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

import hybridkv.hashing as H
import spec.hashing as S

pytestmark = pytest.mark.vllm

# vLLM's API layer refuses '@', '/', '\\' and NUL in a cache salt and caps it at 128 chars.
SALT_ALPHABET = st.characters(blacklist_characters="@/\\\x00", blacklist_categories=["Cs"])
SALTS = st.one_of(st.none(), st.text(SALT_ALPHABET, min_size=1, max_size=16))
SEEDS = st.one_of(st.none(), st.sampled_from(["0", "1234", "vllm"]))
LORAS = st.one_of(st.none(), st.tuples(st.sampled_from(["ad", "x"]), st.sampled_from(["/a", "/p"])))


@contextmanager
def vllm_none_hash(pythonhashseed: str | None) -> Iterator[bytes]:
    """Run with vLLM's NONE_HASH derived from ``pythonhashseed`` (None: the variable unset)."""
    saved = os.environ.get("PYTHONHASHSEED")
    try:
        if pythonhashseed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = pythonhashseed
        kcu.init_none_hash(sha256)
        yield kcu.NONE_HASH
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
        kcu.init_none_hash(sha256)


def make_request(
    prompt: list[int], h: int, salt: str | None, lora: tuple[str, str] | None
) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1000),
        pooling_params=None,
        cache_salt=salt,
        lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
        block_hasher=kcu.get_request_block_hasher(h, sha256),
    )


@pytest.mark.parametrize("seed", [None, "0", "1234"])
def test_none_hash_matches_for_seed(seed: str | None) -> None:
    with vllm_none_hash(seed) as vllm_none:
        assert vllm_none == S.none_hash(S.resolve_none_hash_seed(seed))
        assert vllm_none == (H.DEFAULT_NONE_HASH if seed is None else H.compute_none_hash(seed))


@given(
    h=st.sampled_from([1, 4, 16, 32]),
    prompt=st.lists(st.integers(0, 200_000), min_size=1, max_size=200),
    outputs=st.lists(st.lists(st.integers(0, 200_000), max_size=40), max_size=4),
    salt=SALTS,
    lora=LORAS,
    seed=SEEDS,
)
def test_block_hashes_match_vllm_request_hasher(
    *,
    h: int,
    prompt: list[int],
    outputs: list[list[int]],
    salt: str | None,
    lora: tuple[str, str] | None,
    seed: str | None,
) -> None:
    spec_none = S.none_hash(S.resolve_none_hash_seed(seed))
    spec_lora = None if lora is None else S.LoRAKey(*lora)
    lib = H.RequestHashList(
        h,
        cache_salt=salt,
        lora=None if lora is None else H.LoRAKey(*lora),
        none_hash=spec_none,
    )
    with vllm_none_hash(seed):
        req = make_request(prompt, h, salt, lora)
        lib.append_tokens(prompt)
        tokens = list(prompt)
        for piece in [[], *outputs]:
            req.append_output_token_ids(piece)
            lib.append_tokens(piece)
            tokens += piece
            want = S.request_block_hashes(
                tokens, h, cache_salt=salt, lora=spec_lora, none_hash=spec_none
            )
            assert list(req.block_hashes) == want
            assert list(lib.hashes) == want


@given(
    prompt=st.lists(st.integers(0, 50_000), min_size=16, max_size=160),
    scale=st.integers(1, 5),
    group=st.integers(0, 2**32 - 1),
)
def test_coarse_view_and_offload_key_match_vllm(prompt: list[int], scale: int, group: int) -> None:
    with vllm_none_hash(None):
        req = make_request(prompt, 4, None, None)
        fine = S.request_block_hashes(prompt, 4)
        vllm_view = kcu.BlockHashListWithBlockSize(req.block_hashes, 4, 4 * scale)
        assert list(vllm_view) == S.coarse_block_hashes(fine, scale)
        assert make_offload_key(fine[-1], group) == S.offload_key(fine[-1], group)
        assert kcu.make_block_hash_with_group_id(fine[0], group) == S.offload_key(fine[0], group)
