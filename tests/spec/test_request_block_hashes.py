"""The scheduler's memoized block hashes agree with hashing every token from scratch.

``spec.scheduler.block_hashes`` hashes each full block of a request once in its life (the
decode-step cost must not grow with the context); ``spec.hashing.request_block_hashes`` hashes
all the tokens at every call. Every answer of the first must equal the second, whatever the
order of the calls: a request growing token by token, copies of a request whose outputs
branch (the explorer's states), another salt or block size over the same prompt, a bad token.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.block_pool import BlockHash
from spec.errors import ConfigError
from spec.hashing import next_block_hashes, request_block_hashes
from spec.managers import coarse_hashes
from spec.scheduler import Request, block_hashes
from spec.scheduler.block_hashes import _MAX_CHAINS


def from_scratch(r: Request, size: int) -> tuple[BlockHash, ...]:
    raw = request_block_hashes(r.token_ids, size, cache_salt=r.cache_salt)
    return tuple(BlockHash(h.hex()) for h in raw)


tokens = st.lists(st.integers(0, 50), min_size=1, max_size=40)


@given(
    prompt=tokens,
    outputs=st.lists(st.integers(0, 50), max_size=40),
    size=st.integers(1, 9),
    salt=st.sampled_from([None, "a", "b"]),
)
def test_a_request_growing_token_by_token_agrees_at_every_step(
    prompt: list[int], outputs: list[int], size: int, salt: str | None
) -> None:
    r = Request("r", tuple(prompt), 64, cache_salt=salt)
    assert block_hashes(r, size) == from_scratch(r, size)
    for token in outputs:
        r = r.evolve(output_token_ids=(*r.output_token_ids, token))
        assert block_hashes(r, size) == from_scratch(r, size)


@given(
    prompt=tokens,
    branches=st.lists(st.lists(st.integers(0, 50), max_size=20), min_size=2, max_size=4),
    asks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20)), min_size=1, max_size=30),
    size=st.integers(1, 6),
)
def test_copies_whose_outputs_branch_never_borrow_another_branchs_hashes(
    prompt: list[int], branches: list[list[int]], asks: list[tuple[int, int]], size: int
) -> None:
    # One prompt object shared by every copy, as Request.evolve shares it; the calls jump
    # between branches and back to shorter outputs in any order.
    base = Request("r", tuple(prompt), 64)
    for branch, length in asks:
        outputs = tuple(branches[branch % len(branches)][:length])
        r = base.evolve(output_token_ids=outputs)
        assert block_hashes(r, size) == from_scratch(r, size)


def test_one_prompt_under_other_salts_and_sizes_keeps_each_chain_apart() -> None:
    prompt = tuple(range(20))
    for salt in (None, "x", None, "y"):
        for size in (1, 4, 3, 4):
            r = Request("r", prompt, 8, cache_salt=salt, output_token_ids=(7, 8, 9))
            assert block_hashes(r, size) == from_scratch(r, size)


def test_the_hashes_of_a_request_are_reused_not_recomputed() -> None:
    # The decode step's promise: after the first call, a step hashes only what filled up.
    # Observed through the identity of the returned tuple: unchanged tokens, the same tuple.
    r = Request("r", tuple(range(64)), 8)
    first = block_hashes(r, 4)
    assert block_hashes(r.evolve(num_computed_tokens=10), 4) is first
    grown = r.evolve(output_token_ids=(1,))
    assert block_hashes(grown, 4)[: len(first)] == first


def test_a_bad_output_token_is_refused_before_it_fills_a_block() -> None:
    r = Request("r", (1, 2, 3), 8)
    assert block_hashes(r, 4) == ()
    bad = r.evolve(output_token_ids=(-1,))
    with pytest.raises(ConfigError, match="tokens"):
        block_hashes(bad, 4)
    with pytest.raises(ConfigError, match="tokens"):
        request_block_hashes(bad.token_ids, 4)
    # The refusal changed nothing: the good request still gets its (empty) chain, then grows.
    good = r.evolve(output_token_ids=(4,))
    assert block_hashes(good, 4) == from_scratch(good, 4)


def test_the_memo_forgets_the_least_recent_requests_and_stays_right() -> None:
    prompts = [tuple(range(i, i + 8)) for i in range(_MAX_CHAINS + 5)]
    for p in prompts:
        block_hashes(Request("r", p, 4), 4)
    again = Request("r", prompts[0], 4, output_token_ids=(1, 2, 3, 4))
    assert block_hashes(again, 4) == from_scratch(again, 4)


def test_next_block_hashes_continues_a_chain_and_refuses_a_wrong_start() -> None:
    whole = request_block_hashes(tuple(range(12)), 4, cache_salt="s")
    head = next_block_hashes(None, 0, tuple(range(4)), 4, cache_salt="s")
    tail = next_block_hashes(head[-1], 4, tuple(range(4, 12)), 4, cache_salt="s")
    assert head + tail == whole
    for parent, start in ((None, 4), (head[-1], 0), (head[-1], 6), (head[-1], -4)):
        with pytest.raises(ConfigError, match="start"):
            next_block_hashes(parent, start, (1, 2, 3, 4), 4)


@given(
    fine=st.lists(st.text(min_size=1, max_size=3), max_size=30),
    scale=st.integers(1, 5),
)
def test_coarse_hashes_take_the_last_fine_hash_of_each_whole_coarse_block(
    fine: list[str], scale: int
) -> None:
    hashes = [BlockHash(h) for h in fine]
    expected = tuple(hashes[(i + 1) * scale - 1] for i in range(len(hashes) // scale))
    assert coarse_hashes(hashes, 2, 2 * scale) == expected
