"""The JSONL trace format: round trips, and every malformed line refused with its number."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import HybridKVConfigError
from hybridkv.testbed.trace import TraceRequest, dump_trace, load_trace, parse_trace
from hybridkv.testbed.workloads import MultiTurn, SharedPrefix, builtin_workload

GOOD = '{"arrival_step": 0, "prompt": [1, 2, 3], "max_tokens": 4}'


def test_a_minimal_line_parses() -> None:
    (request,) = parse_trace([GOOD])
    assert request == TraceRequest(0, (1, 2, 3), 4)


def test_comments_and_blank_lines_are_skipped_but_count_for_line_numbers() -> None:
    lines = ["# a comment", "", GOOD, '{"arrival_step": 0, "prompt": [], "max_tokens": 1}']
    with pytest.raises(HybridKVConfigError) as info:
        parse_trace(lines, "t.jsonl")
    assert info.value.field == "t.jsonl:4: prompt"


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ("{not json", "t:1", "is not JSON"),
        ("[1, 2]", "t:1", "is not a JSON object"),
        ('{"prompt": [1], "max_tokens": 1}', "t:1: arrival_step", "is missing"),
        ('{"arrival_step": 0, "max_tokens": 1}', "t:1: prompt", "is missing"),
        ('{"arrival_step": 0, "prompt": [1]}', "t:1: max_tokens", "is missing"),
        ('{"arrival_step": -1, "prompt": [1], "max_tokens": 1}', "t:1: arrival_step", ">= 0"),
        ('{"arrival_step": 0, "prompt": [1], "max_tokens": 0}', "t:1: max_tokens", ">= 1"),
        ('{"arrival_step": 0, "prompt": "hi", "max_tokens": 1}', "t:1: prompt", "not a list"),
        ('{"arrival_step": 0, "prompt": [1, -2], "max_tokens": 1}', "t:1: prompt", ">= 0"),
        ('{"arrival_step": 0, "prompt": [1.5], "max_tokens": 1}', "t:1: prompt", "int"),
        ('{"arrival_step": true, "prompt": [1], "max_tokens": 1}', "t:1: arrival_step", "int"),
        (
            '{"arrival_step": 0, "prompt": [1], "max_tokens": 1, "salt": "x"}',
            "t:1: salt",
            "not a trace key",
        ),
        (
            '{"arrival_step": 0, "prompt": [1], "max_tokens": 1, "cache_salt": 3}',
            "t:1: cache_salt",
            "string",
        ),
    ],
)
def test_bad_lines_are_refused_naming_line_and_key(line: str, field: str, problem: str) -> None:
    with pytest.raises(HybridKVConfigError) as info:
        parse_trace([line], "t")
    assert info.value.field == field
    assert problem in info.value.problem


def test_a_conversation_keeps_one_salt() -> None:
    first = (
        '{"arrival_step": 0, "prompt": [1], "max_tokens": 1, "conversation": "c", '
        '"cache_salt": "a"}'
    )
    second = '{"arrival_step": 0, "prompt": [2], "max_tokens": 1, "conversation": "c"}'
    with pytest.raises(HybridKVConfigError) as info:
        parse_trace([first, second], "t")
    assert info.value.field == "t:2: cache_salt"
    assert "line 1" in info.value.problem


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(HybridKVConfigError, match="holds no request"):
        parse_trace(["# nothing"], "t")


def test_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HybridKVConfigError) as info:
        load_trace(tmp_path / "nope.jsonl")
    assert info.value.field == "--trace"


requests = st.builds(
    TraceRequest,
    st.integers(0, 50),
    st.lists(st.integers(0, 99_999), min_size=1, max_size=20).map(tuple),
    st.integers(1, 64),
    st.none() | st.sampled_from(["a", "b"]),
)


@given(st.lists(requests, min_size=1, max_size=8))
def test_dump_and_parse_round_trip(trace: list[TraceRequest]) -> None:
    assert parse_trace(dump_trace(trace).splitlines()) == tuple(trace)


def test_file_round_trip(tmp_path: Path) -> None:
    trace = MultiTurn(num_requests=5, system_tokens=16, message_tokens=(4, 8)).requests()
    path = tmp_path / "w.jsonl"
    path.write_text(dump_trace(trace))
    assert load_trace(path) == trace


def test_multi_turn_shapes_conversations_and_shares_system_prompts() -> None:
    w = MultiTurn(
        num_requests=10, turns=4, system_prompts=2, system_tokens=50, message_tokens=(5, 9)
    )
    trace = w.requests()
    assert len(trace) == 10
    names = [r.conversation for r in trace]
    # 4 + 4 + 2 turns, conversation by conversation.
    assert names == ["c0"] * 4 + ["c1"] * 4 + ["c2"] * 2
    firsts = [trace[0], trace[4], trace[8]]  # the first turn of c0, c1, c2
    assert all(55 <= len(r.prompt) <= 59 for r in firsts)  # system prompt + one message
    assert firsts[0].prompt[:50] == firsts[2].prompt[:50]  # tenants alternate: c0 and c2
    assert firsts[0].prompt[:50] != firsts[1].prompt[:50]
    later = [r for r in trace if r not in firsts]
    assert all(5 <= len(r.prompt) <= 9 for r in later)
    assert w.requests() == trace  # deterministic


def test_isolated_tenants_get_their_own_salt() -> None:
    trace = MultiTurn(num_requests=8, isolate_tenants=True, system_tokens=8).requests()
    assert {r.cache_salt for r in trace} == {"tenant-0", "tenant-1"}


def test_shared_prefix_requests_share_exactly_the_prefix() -> None:
    trace = SharedPrefix(num_requests=4, prefix_tokens=30, suffix_tokens=(3, 5)).requests()
    assert all(r.prompt[:30] == trace[0].prompt[:30] for r in trace)
    assert [r.arrival_step for r in trace] == [0, 2, 4, 6]


def test_builtin_names_and_refusals() -> None:
    assert len(builtin_workload("shared-prefix", 3)) == 3
    with pytest.raises(HybridKVConfigError) as info:
        builtin_workload("chat", 3)
    assert info.value.field == "--trace"
    with pytest.raises(HybridKVConfigError) as info:
        builtin_workload("multi-turn", 0)
    assert info.value.field == "--requests"
