"""hybridkv.hashing (incremental, optimized) against spec.hashing (from scratch), byte for byte.

Legitimate differences, written down: the library's views are Python sequences and accept
negative indices; the spec's ``chunk_keys`` takes only a non-negative chunk index. Both raise
IndexError for an incomplete chunk, so the comparisons below use non-negative indices only.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridkv.hashing as H
import spec.hashing as S
from hybridkv.errors import HybridKVConfigError
from spec.errors import ConfigError

# The ci profile (200) gives 1,000 agreement cases; dev (50) stays quick at 250.
MANY = settings.default.max_examples * 5

HASH_BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32])
TOKENS = st.lists(st.integers(0, 2**31 + 5), max_size=300)
SALTS = st.one_of(st.none(), st.text(min_size=1, max_size=8))
LORAS = st.one_of(st.none(), st.tuples(st.text(max_size=4), st.text(max_size=4)))
SEEDS = st.one_of(st.none(), st.text(max_size=6))


def split_points(draw: st.DrawFn, n: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=12)))
    return [0, *cuts, n]


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int]]]:
    h = draw(HASH_BLOCK_SIZES)
    tokens = draw(TOKENS)
    points = split_points(draw, len(tokens))
    return h, tokens, list(itertools.pairwise(points))


def spec_lora(lora: tuple[str, str] | None) -> S.LoRAKey | None:
    return None if lora is None else S.LoRAKey(*lora)


def lib_lora(lora: tuple[str, str] | None) -> H.LoRAKey | None:
    return None if lora is None else H.LoRAKey(*lora)


@settings(max_examples=MANY)
@given(stream=streams(), salt=SALTS, lora=LORAS, seed=SEEDS)
def test_incremental_hashes_equal_spec_from_scratch(
    stream: tuple[int, list[int], list[tuple[int, int]]],
    salt: str | None,
    lora: tuple[str, str] | None,
    seed: str | None,
) -> None:
    h, tokens, pieces = stream
    spec_seed = S.resolve_none_hash_seed(seed)
    lib_none = H.compute_none_hash(seed) if seed is not None else H.DEFAULT_NONE_HASH
    assert lib_none == S.none_hash(spec_seed)
    lib = H.RequestHashList(h, cache_salt=salt, lora=lib_lora(lora), none_hash=lib_none)
    for lo, hi in pieces:
        before = len(lib)
        new = lib.append_tokens(tokens[lo:hi])
        expected = S.request_block_hashes(
            tokens[:hi],
            h,
            cache_salt=salt,
            lora=spec_lora(lora),
            none_hash=S.none_hash(spec_seed),
        )
        assert new == len(expected) - before
        assert list(lib.hashes) == expected
        assert lib.num_tokens == hi
    assert lib.hashes_computed == len(lib)


@settings(max_examples=MANY)
@given(
    stream=streams(),
    chunk_mult=st.integers(1, 4),
    unit_mults=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    scale=st.integers(1, 6),
    group=st.integers(0, 2**32 - 1),
)
def test_views_and_keys_agree(
    stream: tuple[int, list[int], list[tuple[int, int]]],
    chunk_mult: int,
    unit_mults: list[int],
    scale: int,
    group: int,
) -> None:
    h, tokens, pieces = stream
    c, units = h * chunk_mult, [h * m for m in unit_mults]
    lib = H.RequestHashList(h)
    chunks = lib.chunk_view(c, units)  # lazy: must follow the appends below
    coarse = lib.coarse(scale)
    for lo, hi in pieces:
        lib.append_tokens(tokens[lo:hi])
        fine = S.request_block_hashes(tokens[:hi], h)
        assert list(coarse) == S.coarse_block_hashes(fine, scale)
        assert [coarse[i] for i in range(len(coarse))] == S.coarse_block_hashes(fine, scale)
        want = S.complete_chunk_keys(fine, h, c, units)
        assert list(chunks) == want
        assert len(chunks) == len(want)
        for k in range(len(want)):
            assert lib.chunk_keys(k, c, units) == S.chunk_keys(fine, h, c, units, k)
        if fine:
            assert lib.offload_key(len(fine) - 1, group) == S.offload_key(fine[-1], group)
    with pytest.raises(IndexError):
        chunks[len(chunks)]


def test_no_hash_is_ever_recomputed_across_many_appends() -> None:
    h = 16
    lib = H.RequestHashList(h, cache_salt="salt")
    first_objects: list[bytes] = []
    token = 0
    for step in range(2000):
        piece = list(range(token, token + step % 7 + 1))
        token += len(piece)
        lib.append_tokens(piece)
        assert lib.hashes_computed == len(lib) == token // h
        if len(lib) and not first_objects:
            first_objects = [lib[0]]
    # The very first hash object is still the one computed first: never replaced.
    assert lib[0] is first_objects[0]
    assert list(lib.hashes) == S.request_block_hashes(list(range(token)), h, cache_salt="salt")


def test_refused_append_changes_nothing() -> None:
    lib = H.RequestHashList(2)
    lib.append_tokens([1, 2, 3])
    snapshot = (list(lib.hashes), lib.num_tokens, lib.hashes_computed)
    with pytest.raises(HybridKVConfigError) as err:
        lib.append_tokens([4, -1])
    assert err.value.field == "tokens"
    assert (list(lib.hashes), lib.num_tokens, lib.hashes_computed) == snapshot
    lib.append_tokens([4])
    assert list(lib.hashes) == S.request_block_hashes([1, 2, 3, 4], 2)


# ---------------------------------------------------------------------- errors: same field


BAD_SIZES = st.one_of(st.integers(max_value=0), st.just(True), st.just(2.0), st.just("4"))
BAD_TOKEN = st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(), st.text(max_size=2))


def fields_of(spec_call: object, lib_call: object) -> tuple[str, str]:
    with pytest.raises(ConfigError) as spec_err:
        spec_call()  # type: ignore[operator]
    with pytest.raises(HybridKVConfigError) as lib_err:
        lib_call()  # type: ignore[operator]
    return spec_err.value.field, lib_err.value.field


@given(bad=BAD_SIZES)
def test_bad_hash_block_size_same_field(bad: object) -> None:
    got = fields_of(
        lambda: S.request_block_hashes([1], bad),  # type: ignore[arg-type]
        lambda: H.RequestHashList(bad),  # type: ignore[arg-type]
    )
    assert got == ("hash_block_size", "hash_block_size")


@given(good=st.lists(st.integers(0, 99), max_size=5), bad=BAD_TOKEN, at=st.integers(0, 5))
def test_bad_token_same_field(good: list[int], bad: object, at: int) -> None:
    tokens = [*good[:at], bad, *good[at:]]
    got = fields_of(
        lambda: S.request_block_hashes(tokens, 1),  # type: ignore[arg-type]
        lambda: H.RequestHashList(1).append_tokens(tokens),  # type: ignore[arg-type]
    )
    assert got == ("tokens", "tokens")


@given(
    case=st.sampled_from(
        [
            ("cache_salt", ""),
            ("cache_salt", 3),
            ("cache_salt", b"s"),
            ("lora", ("a",)),
            ("lora", ("a", 1)),
            ("none_hash", b""),
            ("none_hash", "x" * 32),
            ("hash_algo", "sha256_cbor"),
            ("hash_algo", "xxhash"),
            ("hash_algo", "xxhash_cbor"),
            ("hash_algo", "SHA256"),
        ]
    )
)
def test_bad_request_option_same_field(case: tuple[str, object]) -> None:
    field, value = case
    got = fields_of(
        lambda: S.request_block_hashes([1], 1, **{field: value}),  # type: ignore[arg-type]
        lambda: H.RequestHashList(1, **{field: value}),  # type: ignore[arg-type]
    )
    assert got == (field, field)


@given(bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32), st.just(False)))
def test_bad_group_idx_same_field(bad: object) -> None:
    lib = H.RequestHashList(1)
    lib.append_tokens([7])
    got = fields_of(
        lambda: S.offload_key(lib[0], bad),  # type: ignore[arg-type]
        lambda: lib.offload_key(0, bad),  # type: ignore[arg-type]
    )
    assert got == ("group_idx", "group_idx")


@given(bad=BAD_SIZES)
def test_bad_scale_same_field(bad: object) -> None:
    got = fields_of(
        lambda: S.coarse_block_hashes([], bad),  # type: ignore[arg-type]
        lambda: H.RequestHashList(1).coarse(bad),  # type: ignore[arg-type]
    )
    assert got == ("scale", "scale")


@given(
    h=st.integers(1, 8),
    chunk=st.one_of(BAD_SIZES, st.integers(1, 64)),
    units=st.one_of(
        st.just([]),
        st.just("ab"),
        st.lists(st.one_of(st.integers(-4, 64), st.just(True)), min_size=1, max_size=3),
    ),
)
def test_bad_chunk_geometry_same_field(h: int, chunk: object, units: object) -> None:
    spec_field = lib_field = "accepted"
    try:
        S.complete_chunk_keys([], h, chunk, units)  # type: ignore[arg-type]
    except ConfigError as err:
        spec_field = err.field
    try:
        H.RequestHashList(h).chunk_view(chunk, units)  # type: ignore[arg-type]
    except HybridKVConfigError as err:
        lib_field = err.field
    assert spec_field == lib_field
    assert spec_field in {"chunk_size", "units", "accepted"}


# ---------------------------------------------------------------------- guard


def test_guard_the_two_sides_are_different_code() -> None:
    lib_file = Path(inspect.getfile(H.RequestHashList))
    assert lib_file != Path(inspect.getfile(S.request_block_hashes))
    tree = ast.parse(lib_file.read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "spec" not in imported
    assert H.RequestHashList.append_tokens.__module__ == "hybridkv.hashing"
    assert H.GroupKey is not S.GroupKey
    assert HybridKVConfigError is not ConfigError


def test_bench_hashing_quick_runs_and_its_three_ways_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The benchmark returns 1 when its three ways of hashing disagree; no timing is asserted.
    bench_path = Path(__file__).parents[2] / "tools" / "bench_hashing.py"
    module_spec = importlib.util.spec_from_file_location("bench_hashing", bench_path)
    assert module_spec is not None
    assert module_spec.loader is not None
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--piece", "2048"]) == 0
    assert "naive / incremental" in capsys.readouterr().out
