"""The optimized planner agrees with the reference model on every geometry hypothesis draws.

Two properties, each run ``5 x`` the profile's ``max_examples`` (the ci profile's 200 gives
1,000 geometries each, nightly 10,000):

- valid-leaning geometries (1-4 groups of random kinds, blocks that are multiples of h or of c,
  c a multiple of h, max_model_len either random or large enough): same derived fields, same
  snapshot, same answer from every query on many token and chunk counts, PL-* hold on both;
- arbitrary junk (bad types, zeros, malformed groups): both refuse, with corresponding error
  types (spec ConfigError <-> HybridKVConfigError, both ValueError) and the same ``field``;
  or both accept and agree.

A guard test proves the two sides are different code, so agreement is not a tautology.
The one legitimate difference is the error type, written down in ``ERROR_TYPES``.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import hybridkv.errors
import hybridkv.kinds
import hybridkv.planner
import spec.errors
import spec.kinds
import spec.planner
from spec.invariants import check_all

SpecPlanner = spec.planner.HybridOffloadPlanner
FastPlanner = hybridkv.planner.HybridOffloadPlanner
ERROR_TYPES = {spec.errors.ConfigError: hybridkv.errors.HybridKVConfigError}

# ci profile: 200 x 5 = 1,000 examples per property.
EXAMPLES = settings().max_examples * 5
KIND_NAMES = ("full", "sliding", "mamba")


class Raw:
    """A kind passed as is (not converted to either side's GroupKind): a junk kind."""

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __repr__(self) -> str:
        return f"Raw({self.obj!r})"


def _sides(groups: object) -> tuple[object, object]:
    """The same groups in spec kinds and in hybridkv kinds; junk stays junk on both sides."""
    if not isinstance(groups, list):
        return groups, groups

    def convert(kinds: Any) -> list[object]:
        out: list[object] = []
        for entry in groups:
            if isinstance(entry, tuple) and entry and isinstance(entry[0], (str, Raw)):
                kind = entry[0].obj if isinstance(entry[0], Raw) else kinds(entry[0])
                out.append((kind, *entry[1:]))
            else:
                out.append(entry)
        return out

    return convert(spec.kinds.GroupKind), convert(hybridkv.kinds.GroupKind)


def _build_both(groups: object, h: object, c: object, max_len: object) -> tuple[Any, Any]:
    """(spec result, hybridkv result): each a planner or the config error it raised."""
    spec_groups, fast_groups = _sides(groups)
    results: list[Any] = []
    for planner, typed, error in (
        (SpecPlanner, spec_groups, spec.errors.ConfigError),
        (FastPlanner, fast_groups, hybridkv.errors.HybridKVConfigError),
    ):
        try:
            results.append(planner(typed, h, c, max_len))
        except error as err:
            results.append(err)
    return results[0], results[1]


def _assert_same_refusal(spec_err: BaseException, fast_err: BaseException) -> None:
    event(f"refused: {getattr(spec_err, 'field', type(spec_err).__name__)}")
    assert ERROR_TYPES[type(spec_err)] is type(fast_err)  # type: ignore[index]
    assert isinstance(spec_err, ValueError)
    assert isinstance(fast_err, ValueError)
    assert spec_err.field == fast_err.field, (spec_err, fast_err)  # type: ignore[attr-defined]
    assert str(fast_err).startswith(f"{fast_err.field}=")  # type: ignore[attr-defined]


def _assert_same_geometry(slow: Any, fast: Any) -> None:
    event("accepted")
    for name in (
        "hash_block_size",
        "chunk_size",
        "max_model_len",
        "units",
        "hash_factors",
        "splittable",
        "first_storable_chunks",
        "claim_unit",
        "shortest_hit_prompt",
    ):
        assert getattr(slow, name) == getattr(fast, name), name
    assert slow.snapshot() == fast.snapshot()
    assert check_all("planner", slow.snapshot()) == {}
    assert check_all("planner", fast.snapshot()) == {}


@st.composite
def geometries(draw: st.DrawFn) -> tuple[list[tuple[str, int]], int, int, int]:
    h = draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 32]))
    c = h * draw(st.integers(1, 48))
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(KIND_NAMES))
        # Half the blocks are multiples of c (so attention splits), half any multiple of h.
        multiple_of = draw(st.sampled_from([h, c]))
        groups.append((kind, multiple_of * draw(st.integers(1, 64 if multiple_of == h else 8))))
    # lcm(c, every block) is a multiple of the claim unit, so M above it always fits.
    roomy = math.lcm(c, *(block for _, block in groups)) + 1
    max_len = draw(st.one_of(st.integers(1, 1 << 17), st.integers(roomy, roomy + 4096)))
    return groups, h, c, max_len


def _token_counts(draw: st.DrawFn, planner: Any) -> list[int]:
    # Bounded so the reference model's chunk-by-chunk loop stays cheap.
    c, claim = planner.chunk_size, planner.claim_unit
    top = min(64 * c, 3 * claim + 2)
    edges = [0, 1, c - 1, c, c + 1, claim - 1, claim, claim + 1, 2 * claim, 2 * claim + 1]
    edges = [n for n in edges if 0 <= n <= top]
    return edges + draw(st.lists(st.integers(0, top), min_size=1, max_size=6))


@settings(max_examples=EXAMPLES)
@given(geometry=geometries(), data=st.data())
def test_planners_agree_on_every_query(
    geometry: tuple[list[tuple[str, int]], int, int, int], data: st.DataObject
) -> None:
    groups, h, c, max_len = geometry
    slow, fast = _build_both(groups, h, c, max_len)
    if isinstance(slow, Exception) or isinstance(fast, Exception):
        _assert_same_refusal(slow, fast)
        return
    _assert_same_geometry(slow, fast)
    for n in _token_counts(data.draw, slow):
        assert slow.chunk_count_for_tokens(n) == fast.chunk_count_for_tokens(n), n
        assert slow.storable_prefix_tokens(n) == fast.storable_prefix_tokens(n), n
        assert slow.claimable_prefix_tokens(n) == fast.claimable_prefix_tokens(n), n
    for k in [0, 1, *data.draw(st.lists(st.integers(0, 200), max_size=4), label="num_chunks")]:
        assert slow.group_covered_tokens(k) == fast.group_covered_tokens(k), k
    group = data.draw(st.integers(0, len(groups) - 1), label="group_index")
    unit = data.draw(st.integers(0, 10_000), label="unit_index")
    assert slow.unit_hash_index(group, unit) == fast.unit_hash_index(group, unit)


def _good_sizes() -> st.SearchStrategy[object]:
    return st.one_of(
        st.sampled_from([1, 2, 4, 8, 16, 32, 48, 64, 272, 544, 1088, 4096, 8192]),
        st.integers(1, 9000),
    )


def _sizes() -> st.SearchStrategy[object]:
    junk = st.one_of(
        st.integers(-3, 0),
        st.booleans(),
        st.floats(-10, 600, allow_nan=False),
        st.none(),
        st.text(max_size=2),
    )
    # Mostly plausible sizes, so the relational checks (and acceptance) are reached too.
    return st.one_of(_good_sizes(), _good_sizes(), _good_sizes(), junk)


def _junk_groups() -> st.SearchStrategy[object]:
    kind = st.one_of(
        st.sampled_from(KIND_NAMES),
        st.sampled_from(KIND_NAMES),
        st.sampled_from([Raw("full"), Raw(None), Raw(0), Raw(1.5)]),
    )
    pair = st.tuples(kind, _sizes())
    good_pair = st.tuples(st.sampled_from(KIND_NAMES), _good_sizes())
    entry = st.one_of(pair, st.tuples(kind), st.tuples(kind, _sizes(), _sizes()))
    return st.one_of(
        st.lists(good_pair, min_size=1, max_size=4),
        st.lists(good_pair, min_size=1, max_size=4),
        st.lists(pair, min_size=0, max_size=3),
        st.lists(entry, min_size=1, max_size=3),
        st.sampled_from([None, "full", 16, ()]),
    )


@settings(max_examples=EXAMPLES)
@given(groups=_junk_groups(), h=_sizes(), c=_sizes(), max_len=_sizes(), n=_sizes())
def test_planners_refuse_the_same_bad_input(
    groups: object, h: object, c: object, max_len: object, n: object
) -> None:
    slow, fast = _build_both(groups, h, c, max_len)
    if isinstance(slow, Exception) or isinstance(fast, Exception):
        _assert_same_refusal(slow, fast)
        return
    _assert_same_geometry(slow, fast)
    for method in ("chunk_count_for_tokens", "claimable_prefix_tokens", "group_covered_tokens"):
        outcomes = []
        for planner, error in (
            (slow, spec.errors.ConfigError),
            (fast, hybridkv.errors.HybridKVConfigError),
        ):
            # Keep the reference model's loop short on huge counts.
            arg = n if not isinstance(n, int) or n < 5000 else n % 5000
            try:
                outcomes.append(getattr(planner, method)(arg))
            except error as err:
                outcomes.append(err)
        if isinstance(outcomes[0], Exception) or isinstance(outcomes[1], Exception):
            _assert_same_refusal(outcomes[0], outcomes[1])
        else:
            assert outcomes[0] == outcomes[1]


# ----------------------------------------------------------------- guard: different code


def test_the_two_planners_are_different_code() -> None:
    assert SpecPlanner is not FastPlanner
    assert SpecPlanner.__module__ == "spec.planner"
    assert FastPlanner.__module__ == "hybridkv.planner"
    for method in ("chunk_count_for_tokens", "claimable_prefix_tokens", "group_covered_tokens"):
        slow_code = getattr(SpecPlanner, method).__code__
        fast_code = getattr(FastPlanner, method).__code__
        assert slow_code.co_filename != fast_code.co_filename
        assert slow_code.co_code != fast_code.co_code
    # Each side keeps its own kinds: the optimized planner refuses the spec's GroupKind.
    slow, fast = _build_both([(Raw(spec.kinds.GroupKind.FULL), 16)], 16, 16, 64)
    assert isinstance(slow, SpecPlanner)
    assert isinstance(fast, hybridkv.errors.HybridKVConfigError)
    assert fast.field == "groups"


def test_the_optimized_planner_never_imports_spec() -> None:
    source = Path(hybridkv.planner.__file__).read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "spec" not in imported
    assert "hybridkv" in imported  # the scan sees imports at all
    # And at run time: with spec unimportable the optimized planner still loads and works.
    code = (
        "import sys\n"
        "sys.modules['spec'] = None\n"
        "from hybridkv.kinds import GroupKind as K\n"
        "from hybridkv.planner import HybridOffloadPlanner as P\n"
        "p = P([(K.FULL, 544), (K.MAMBA, 544)], 16, 272, 8192)\n"
        "print(p.chunk_count_for_tokens(1088), [m for m in sys.modules if m.startswith('spec')])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4 ['spec']"  # only the blocker entry, never a real module


def test_the_ci_profile_runs_at_least_a_thousand_geometries() -> None:
    assert settings.get_profile("ci").max_examples * 5 >= 1000


def test_the_benchmark_runs_both_sides_and_prints_a_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A smoke run only: it checks the two sides agree on the benchmark's inputs and that the
    # table is printed; timings are never asserted.
    path = Path(__file__).resolve().parents[2] / "tools" / "bench_planner.py"
    loaded = importlib.util.spec_from_file_location("bench_planner", path)
    assert loaded is not None
    assert loaded.loader is not None
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out
    assert "chunk_count_for_tokens / qwen3.5-like" in out
    assert "chunk_count_for_tokens / gpt-oss-like" in out
