"""The content model by hand: true content of attention blocks and mamba states, and the checks."""

from __future__ import annotations

import pytest

from spec.errors import ConfigError
from spec.system.content import (
    Content,
    Garbage,
    attention_holds,
    decode,
    encode,
    state_holds,
    true_attention,
    true_state,
)

TOKENS = (5, 6, 7, 8, 9)
BLOCK1 = {"block_index": 1, "block_size": 2, "need_end": 4}


def test_true_attention_covers_block_up_to_last_computed_position() -> None:
    # Block size 2: block 1 holds positions 2, 3; after 3 tokens only position 2 is written.
    assert true_attention(0, TOKENS, 1, 2, 3) == Content(0, (5, 6, 7))
    # After all 5 tokens block 1 is full: prefix up to its end (position 3 inclusive).
    assert true_attention(0, TOKENS, 1, 2, 5) == Content(0, (5, 6, 7, 8))
    assert true_attention(1, TOKENS, 0, 2, 5) == Content(1, (5, 6))


def test_true_attention_refuses_a_block_with_no_computed_position() -> None:
    with pytest.raises(ConfigError):
        true_attention(0, TOKENS, 2, 2, 4)  # block 2 starts at 4: nothing computed in it


def test_true_state_is_the_exact_prefix() -> None:
    assert true_state(1, TOKENS, 3) == Content(1, (5, 6, 7))
    with pytest.raises(ConfigError):
        true_state(1, TOKENS, 0)
    with pytest.raises(ConfigError):
        true_state(1, TOKENS, 6)


def test_attention_holds_accepts_the_true_block_and_a_longer_write_in_it() -> None:
    full = Content(0, (5, 6, 7, 8))
    assert attention_holds(full, 0, TOKENS, block_index=1, block_size=2, need_end=4)
    # Reading positions 2..2 only: a block written up to 3 still holds position 2.
    assert attention_holds(full, 0, TOKENS, block_index=1, block_size=2, need_end=3)


def test_attention_holds_rejects_wrong_group_prefix_index_and_garbage() -> None:
    assert not attention_holds(Content(1, (5, 6, 7, 8)), 0, TOKENS, **BLOCK1)  # other group
    assert not attention_holds(Content(0, (5, 6, 0, 8)), 0, TOKENS, **BLOCK1)  # other tokens
    # Block 2's content (ends at 6) is not block 1's, though its prefix agrees with TOKENS.
    assert not attention_holds(Content(0, (5, 6, 7, 8, 9)), 0, TOKENS, **BLOCK1)
    assert not attention_holds(Content(0, (5, 6, 7)), 0, TOKENS, **BLOCK1)  # not written to 4
    assert not attention_holds(
        Garbage("failed load"), 0, TOKENS, block_index=1, block_size=2, need_end=4
    )


def test_state_holds_only_the_exact_position() -> None:
    assert state_holds(Content(1, (5, 6)), 1, TOKENS, 2)
    assert not state_holds(Content(1, (5, 6, 7)), 1, TOKENS, 2)  # a later state
    assert not state_holds(Content(1, (5,)), 1, TOKENS, 2)  # an earlier state
    assert not state_holds(Content(0, (5, 6)), 1, TOKENS, 2)  # another group's bytes
    assert not state_holds(Garbage("unwritten"), 1, TOKENS, 2)


@pytest.mark.parametrize("value", [Content(2, (1, 2)), Garbage("failed load")])
def test_encode_decode_round_trip(value: Content | Garbage) -> None:
    assert decode(encode(value)) == value
