"""hybridkv.store.capacity at its edges: every refusal whole, and the smallest budgets accepted.

tests/store/test_host_store_unit.py checks that a bad size is refused and that a budget below
one chunk names the chunk's size; these pin the rest of what a user reads (field, value,
problem, fix, the one-line message) and the order of the checks. They were written for the
mutants mutmut left alive in ``tools/mutants.py``'s run over the module
(docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.store import HostCapacity

BAD_SIZES = [0, -1, True, False, 1.0, "2", None]
CHUNK_FIX = "pass the bytes of one offload chunk"


def loose(value: object) -> Any:
    """``value`` typed as Any: the refusals below pass what the signatures forbid on purpose."""
    return value


def refused(call: Callable[[], object], field: str, value: object, problem: str, fix: str) -> None:
    with pytest.raises(HybridKVConfigError) as info:
        call()
    err = info.value
    assert (err.field, err.problem, err.fix) == (field, problem, fix)
    assert type(err.value) is type(value)
    assert err.value == value
    assert str(err) == f"{field}={value!r}: {problem}; {fix}"


@pytest.mark.parametrize("bad", BAD_SIZES)
def test_a_bad_chunk_count_is_refused_whole(bad: object) -> None:
    refused(
        lambda: HostCapacity(loose(bad), 4096),
        "num_chunks",
        bad,
        "must be an int >= 1",
        "give the tier at least one chunk",
    )


@pytest.mark.parametrize("bad", BAD_SIZES)
def test_a_bad_chunk_size_is_refused_whole(bad: object) -> None:
    refused(
        lambda: HostCapacity(3, loose(bad)), "chunk_bytes", bad, "must be an int >= 1", CHUNK_FIX
    )
    refused(
        lambda: HostCapacity.from_budget(8192, bad),
        "chunk_bytes",
        bad,
        "must be an int >= 1",
        CHUNK_FIX,
    )


@pytest.mark.parametrize("bad", BAD_SIZES)
def test_a_bad_budget_is_refused_whole(bad: object) -> None:
    refused(
        lambda: HostCapacity.from_budget(bad, 4096),
        "host_bytes",
        bad,
        "must be an int >= 1",
        "give the host tier a positive size",
    )


def test_the_chunk_size_is_checked_before_the_budget() -> None:
    refused(
        lambda: HostCapacity.from_budget(0, 0), "chunk_bytes", 0, "must be an int >= 1", CHUNK_FIX
    )


@pytest.mark.parametrize(("budget", "chunk"), [(4095, 4096), (1, 2)])
def test_a_budget_below_one_chunk_is_refused_whole(budget: int, chunk: int) -> None:
    refused(
        lambda: HostCapacity.from_budget(budget, chunk),
        "host_bytes",
        budget,
        f"is smaller than one chunk ({chunk} bytes)",
        f"give at least {chunk} bytes or use a smaller chunk_size",
    )


@pytest.mark.parametrize(
    ("budget", "chunk", "chunks"), [(1, 1, 1), (4096, 4096, 1), (8191, 4096, 1), (8192, 4096, 2)]
)
def test_the_whole_chunks_of_a_budget(budget: int, chunk: int, chunks: int) -> None:
    capacity = HostCapacity.from_budget(budget, chunk)
    assert capacity == HostCapacity(chunks, chunk)
    assert capacity.total_bytes == chunks * chunk
    assert [capacity.slot_offset(slot) for slot in range(chunks)] == [
        slot * chunk for slot in range(chunks)
    ]


def test_one_chunk_of_one_byte_is_the_smallest_capacity() -> None:
    capacity = HostCapacity(1, 1)
    assert (capacity.chunks, capacity.chunk_bytes, capacity.total_bytes) == (1, 1, 1)
    assert capacity.slot_offset(0) == 0
