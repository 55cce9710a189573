"""hybridkv.connector.selection: the weighted multi-connector's choice of the loading child and
the validation of its children's names and weights (no vLLM needed)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.connector.selection import (
    ChildSpec,
    Chosen,
    NoHit,
    Pending,
    SelectionTally,
    parse_children,
    select,
)
from hybridkv.errors import HybridKVConfigError

# ------------------------------------------------------------------ select


def test_the_largest_product_wins_not_the_most_tokens() -> None:
    # 96 tokens at weight 1 lose to 64 at weight 2 (128 > 96).
    assert select([96, 64], [1.0, 2.0]) == Chosen(1, 64, 128.0)
    assert select([96, 64], [1.0, 1.0]) == Chosen(0, 96, 96.0)


def test_ties_go_to_the_first_listed_child() -> None:
    assert select([64, 32], [1.0, 2.0]) == Chosen(0, 64, 64.0)
    assert select([0, 32, 32], [5.0, 1.0, 1.0]) == Chosen(1, 32, 32.0)


def test_any_pending_child_makes_the_answer_pending() -> None:
    assert select([128, None], [1.0, 1.0]) == Pending()
    assert select([None, 0], [1.0, 1.0]) == Pending()


def test_no_positive_score_is_no_hit() -> None:
    assert select([0, 0], [1.0, 1.0]) == NoHit()
    # Weight 0: a store-only child is never chosen, whatever it holds.
    assert select([512, 0], [0.0, 1.0]) == NoHit()
    assert select([512, 32], [0.0, 1.0]) == Chosen(1, 32, 32.0)


def test_select_refuses_malformed_input() -> None:
    with pytest.raises(ValueError, match="2 answers for 1 children"):
        select([1, 2], [1.0])
    with pytest.raises(ValueError, match="child 1 answered -3"):
        select([1, -3], [1.0, 1.0])


@given(
    st.lists(
        st.tuples(st.integers(0, 4096), st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])),
        min_size=1,
        max_size=6,
    )
)
def test_select_matches_the_definition(children: list[tuple[int, float]]) -> None:
    """The chosen child has the maximal positive score and no earlier child reaches it."""
    answers = [tokens for tokens, _ in children]
    weights = [weight for _, weight in children]
    scores = [tokens * weight for tokens, weight in children]
    found = select(answers, weights)
    if max(scores) <= 0:
        assert found == NoHit()
        return
    assert isinstance(found, Chosen)
    assert found.score == max(scores) == scores[found.index]
    assert found.tokens == answers[found.index]
    assert all(score < found.score for score in scores[: found.index])


# ------------------------------------------------------------------ parse_children


def _entry(name: object = "host", **more: object) -> dict[str, object]:
    return {"name": name, "kv_connector": "HybridKVConnector", "kv_role": "kv_both", **more}


def test_children_parse_in_order_with_the_vllm_fields_kept() -> None:
    parsed = parse_children(
        {"connectors": [_entry("host", load_weight=2), _entry("native", kv_connector="X")]}
    )
    assert parsed == (
        ChildSpec("host", 2.0, {"kv_connector": "HybridKVConnector", "kv_role": "kv_both"}),
        ChildSpec("native", 1.0, {"kv_connector": "X", "kv_role": "kv_both"}),
    )
    assert isinstance(parsed[0].load_weight, float)


@pytest.mark.parametrize(
    ("extra", "field", "fix"),
    [
        ({}, "kv_connector_extra_config.connectors", "list at least one child"),
        ({"connectors": []}, "kv_connector_extra_config.connectors", "list at least one child"),
        ({"connectors": ["host"]}, "kv_connector_extra_config.connectors[0]", "write {"),
        ({"connectors": [_entry(None)]}, "kv_connector_extra_config.connectors[0].name", "add"),
        ({"connectors": [_entry("  ")]}, "kv_connector_extra_config.connectors[0].name", "add"),
        (
            {"connectors": [_entry("a"), _entry("a")]},
            "kv_connector_extra_config.connectors[1].name",
            "its own name",
        ),
        (
            {"connectors": [_entry(load_weight=-1)]},
            "kv_connector_extra_config.connectors[0].load_weight",
            "store-only",
        ),
        (
            {"connectors": [_entry(load_weight=math.inf)]},
            "kv_connector_extra_config.connectors[0].load_weight",
            "store-only",
        ),
        (
            {"connectors": [_entry(load_weight=True)]},
            "kv_connector_extra_config.connectors[0].load_weight",
            "store-only",
        ),
        (
            {"connectors": [_entry(load_weight="2")]},
            "kv_connector_extra_config.connectors[0].load_weight",
            "store-only",
        ),
    ],
)
def test_bad_children_name_the_field_and_the_fix(
    extra: dict[str, object], field: str, fix: str
) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        parse_children(extra)
    assert caught.value.field == field
    assert fix in caught.value.fix
    assert field in str(caught.value)


# ------------------------------------------------------------------ SelectionTally


def test_the_tally_counts_each_answer_once() -> None:
    tally = SelectionTally(["host", "native"])
    for selection in (Chosen(0, 64, 64.0), Chosen(1, 32, 64.0), Chosen(0, 96, 96.0)):
        tally.record(selection)
    tally.record(Pending())
    tally.record(NoHit())
    tally.record(NoHit())
    assert tally.chosen == {"host": 2, "native": 1}
    assert tally.tokens == {"host": 160, "native": 32}
    assert (tally.pending, tally.no_hit) == (1, 2)
    assert tally.answers == 6
