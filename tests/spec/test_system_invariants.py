"""TR-1, TR-2 and DATA-1 on hand-built engine snapshots: sound ones pass, bad ones fail."""

from __future__ import annotations

from typing import Any

from spec.invariants import ALL_INVARIANTS, check_all
from spec.system.content import Content, Garbage, encode

G0 = Content(0, (1, 2))


def snap(**changes: Any) -> dict[str, Any]:
    """Block 1 (group 0) of r0 is stored by job 7; block 2 of r1 is being loaded by job 8."""
    base: dict[str, Any] = {
        "ref_counts": (1, 1, 1, 0),
        "tables": ((0, "r0", (1,)), (0, "r1", (0, 2))),
        "in_flight": (
            (7, "store", "r0", ((0, 1, 2, encode(G0)),)),
            (8, "load", "r1", ((0, 2, 2, None),)),
        ),
        "gpu": ((1, encode(G0)),),
        "reads": (("r0", 0, 1, "attention", 0, 2, 2, (1, 2), encode(G0)),),
    }
    base.update(changes)
    return base


def test_sound_snapshot_breaks_nothing() -> None:
    assert check_all("system", snap()) == {}
    assert {"TR-1", "TR-2", "DATA-1"} <= set(ALL_INVARIANTS)


def test_tr1_block_freed_under_a_transfer() -> None:
    broken = check_all("system", snap(ref_counts=(1, 1, 0, 0)))
    assert list(broken) == ["TR-1"]
    assert "block 2" in broken["TR-1"][0]


def test_tr1_block_reallocated_to_another_group_or_request() -> None:
    other_group = snap(tables=((0, "r0", (1,)), (0, "r1", (0, 2)), (1, "r0", (1,))))
    assert "group(s) [1]" in check_all("system", other_group)["TR-1"][0]
    other_request = snap(tables=((0, "r0", (1,)), (0, "r1", (0, 2)), (0, "r2", (2,))))
    assert "held by ['r2']" in check_all("system", other_request)["TR-1"][0]


def test_tr1_store_source_may_be_shared_by_a_prefix_hit() -> None:
    shared = snap(tables=((0, "r0", (1,)), (0, "r1", (0, 2)), (0, "r2", (1,))))
    assert check_all("system", shared) == {}


def test_tr2_source_rewritten_mid_store() -> None:
    rewritten = snap(gpu=((1, encode(Content(0, (1, 9)))),))
    assert list(check_all("system", rewritten)) == ["TR-2"]
    garbage = snap(gpu=((1, encode(Garbage("failed load"))),))
    assert list(check_all("system", garbage)) == ["TR-2"]


def test_tr2_appending_past_the_stored_positions_is_no_rewrite() -> None:
    # The store covers positions up to 2; a decode writing position 2 of the block keeps them.
    appended = snap(gpu=((1, encode(Content(0, (1, 2, 3)))),))
    assert check_all("system", appended) == {}


def test_data1_stale_or_foreign_read() -> None:
    stale = ("r0", 0, 1, "attention", 0, 2, 2, (1, 2), encode(Content(0, (1, 3))))
    assert list(check_all("system", snap(reads=(stale,)))) == ["DATA-1"]
    state = ("r0", 1, 3, "state", 1, 1, 2, (1, 2), encode(Content(1, (1,))))
    broken = check_all("system", snap(reads=(state,)))
    assert "the state after 2 tokens" in broken["DATA-1"][0]
    good_state = ("r0", 1, 3, "state", 1, 1, 2, (1, 2), encode(Content(1, (1, 2))))
    assert check_all("system", snap(reads=(good_state,))) == {}
