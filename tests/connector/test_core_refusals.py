"""Every refusal of :class:`hybridkv.connector.ConnectorCore`, whole: field, value, problem, fix
and the one-line message.

tests/connector/test_connector_errors.py checks that each bad configuration and call is refused
naming its field and changes nothing; these tests pin the words as well, so a message that loses
its value or its fix fails here. They were written for the mutants mutmut left alive in
``tools/mutants.py``'s run over ``hybridkv/connector/core.py`` (docs/explanation/mutations.md,
"Whole modules under mutmut").
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    LoadMode,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
FIX = "build it with hybridkv (planner, store) for this layout"
TABLE = ((1, 2, 3), (0, 0, 4))


def _planner(hash_block_size: int = 2) -> HybridOffloadPlanner:
    return HybridOffloadPlanner(((FULL, 2), (MAMBA, 2)), hash_block_size, 2, 64)


def _core() -> ConnectorCore:
    return ConnectorCore(_planner(), HostStore(8), (FULL, MAMBA), 2, 2)


def _view(rid: str, n: int = 8) -> RequestView:
    tokens = tuple(range(1, n + 1))
    return RequestView(RequestId(rid), tokens, len(tokens))


def _whole(call: Any, *args: Any, **kwargs: Any) -> tuple[str, object, str, str, str]:
    with pytest.raises(HybridKVConfigError) as caught:
        call(*args, **kwargs)
    e = caught.value
    return (e.field, e.value, e.problem, e.fix, str(e))


def _expected(
    field: str, value: object, problem: str, fix: str
) -> tuple[str, object, str, str, str]:
    return (field, value, problem, fix, f"{field}={value!r}: {problem}; {fix}")


@pytest.mark.parametrize(
    ("args", "options", "expected"),
    [
        (
            ("a planner", HostStore(4), (FULL, MAMBA), 2, 2),
            {},
            _expected("planner", "a planner", "is not a HybridOffloadPlanner", FIX),
        ),
        (
            (_planner(), HostStore(4), (FULL, MAMBA), 4, 2),
            {},
            _expected("hash_block_size", 4, "differs from the planner's 2", "match"),
        ),
        (
            (_planner(1), HostStore(4), (FULL, MAMBA), True, 2),  # True == 1, yet not an int
            {},
            _expected("hash_block_size", True, "differs from the planner's 1", "match"),
        ),
        (
            (_planner(), HostStore(4), (FULL, MAMBA), 2, 4),
            {},
            _expected("chunk_size", 4, "differs from the planner's 2", "match"),
        ),
        (
            (_planner(), HostStore(4), (FULL, MAMBA), 2, 2),
            {"load_mode": "async"},
            _expected("load_mode", "async", "not a LoadMode", "LoadMode.ASYNC"),
        ),
        (
            (_planner(), "a store", (FULL, MAMBA), 2, 2),
            {},
            _expected("store", "a store", "is not a hybridkv HostStore", FIX),
        ),
    ],
    ids=["planner", "hash-block", "hash-block-bool", "chunk", "load-mode", "store"],
)
def test_a_bad_configuration_is_refused_whole(
    args: tuple[Any, ...], options: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    assert _whole(ConnectorCore, *args, **options) == expected


def test_the_matching_sizes_and_both_load_modes_are_accepted() -> None:
    for mode in LoadMode:
        core = ConnectorCore(_planner(1), HostStore(4), (FULL, MAMBA), 1, 2, load_mode=mode)
        assert core.load_mode is mode


@pytest.mark.parametrize("value", [1, -2, True, 3.0])
def test_an_ask_off_the_scheduler_grid_is_refused_whole(value: object) -> None:
    assert _whole(_core().get_num_new_matched_tokens, _view("A"), value) == _expected(
        "num_computed_tokens", value, "not a multiple of 2 >= 0", "align it"
    )


class _Position(int):
    """A caller's own integer type (an ``int`` subclass other than ``bool``)."""


@pytest.mark.parametrize("value", [0, 4])
def test_an_int_subclass_on_the_grid_is_asked_as_it_is(value: int) -> None:
    # The hot path checks plain ints inline and sends every other value to the full check,
    # which takes an int subclass on the grid (0 included) and refuses only what is off it.
    claim = _core().get_num_new_matched_tokens(_view("A"), _Position(value))
    assert claim.kind is ClaimKind.NONE  # asked, nothing stored: no claim, no refusal


def test_calls_out_of_order_are_refused_whole() -> None:
    core = _core()
    a = _view("A")
    assert _whole(core.update_state_after_alloc, a, TABLE, 2) == _expected(
        "num_external_tokens", 2, "no claim was asked", "ask first"
    )
    assert _whole(
        core.update_connector_output,
        KVConnectorOutput(completed_jobs=(JobResult(JobId(77), True),)),
    ) == _expected("completed_jobs", 77, "no such job", "report once")
    assert _whole(core.invalid_blocks, RequestId("nobody")) == _expected(
        "request_id", "nobody", "has no load recorded", "ask after a load"
    )
    assert _whole(core._set_salvage, 1) == _expected(
        "enabled", 1, "not a bool", "pass True or False"
    )


def test_a_second_allocation_during_a_load_is_refused_whole() -> None:
    core = _core()
    core.seed(_view("A"), 6)
    b = _view("B")
    assert core.get_num_new_matched_tokens(b, 0).num_tokens == 6
    core.update_state_after_alloc(b, TABLE, 6)
    core.get_num_new_matched_tokens(b, 0)  # asked again: DEFER while its load is in flight
    assert _whole(core.update_state_after_alloc, b, TABLE, 6) == _expected(
        "request", "B", "has a load in flight", "wait for finished_recving"
    )


def test_binding_a_pool_while_stores_are_in_flight_is_refused_whole() -> None:
    core = _core()
    row = ScheduledRequest(_view("A"), TABLE, 0, 6)
    assert core.build_connector_meta(StepView(1, (row,))).store_jobs

    class Pool:
        def touch(self, blocks: Any) -> None: ...

        def free_blocks(self, blocks: Any) -> None: ...

    pool = Pool()
    field, value, problem, fix, _ = _whole(core.bind_gpu_block_pool, pool)
    assert (field, value, problem, fix) == (
        "pool",
        pool,
        "bound while stores are in flight",
        "bind first",
    )
