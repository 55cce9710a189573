"""tools/bench_native_plugins.py: its rows are what happened, under each engine loop.

On the quick sliding + full chat with a host tier of 0.5x the working set (every variant the
same bytes): every run reads no wrong KV and finishes every request; engine B of the native +
hybridkv tier row promotes what engine A wrote to the server and computes fewer prompt tokens
than native alone; the tier rows' counts are the tiers' own.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.remote]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402
from _two_engines import redis_binary_or_skip  # noqa: E402

tool = load_tool("bench_native_plugins")


@pytest.mark.parametrize("loop", ["async", "sync"])  # `nox -s remote` runs it once
def test_the_side_by_side_rows_are_what_happened(loop: str) -> None:
    redis_binary_or_skip()
    (case,) = (c for c in tool.bench._cases(quick=True) if c.name == "sliding+full")
    with tool.own_server() as port:
        lines, clean = tool.bench_case(case, port, 0.5, loop)
    assert clean
    rows = {line[:34].strip(): line[34:].split() for line in lines[2:]}
    assert list(rows) == [
        "native lru",
        "native arc",
        "native + hybridkv policy",
        "native + hybridkv tier, A",
        "native + hybridkv tier, B",
        "hybridkv lru",
        "hybridkv + shared tier, A",
        "hybridkv + shared tier, B",
    ]
    computed = {name: int(cols[0]) for name, cols in rows.items()}
    written = {name: int(cols[4]) for name, cols in rows.items()}
    promoted = {name: int(cols[5]) for name, cols in rows.items()}
    assert all(int(cols[6]) == 0 for cols in rows.values())  # wrong reads
    assert written["native + hybridkv tier, A"] > 0
    assert promoted["native + hybridkv tier, B"] > 0
    assert computed["native + hybridkv tier, B"] < computed["native lru"]
    assert written["native lru"] == promoted["native lru"] == 0
