"""Offload keys read off the engine's own block hashes (``RequestView.block_hashes``).

vLLM's ``request.block_hashes`` fold in multimodal inputs, LoRA and the salt beside the token
ids; a view carrying them must get keys from them, never from hashing the tokens again.
"""

from __future__ import annotations

from hybridkv.connector import ConnectorGeometry, RequestId, RequestView
from hybridkv.connector.requests import RequestKeys
from hybridkv.hashing import RequestHashList
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner

HBS = 4
PLANNER = HybridOffloadPlanner(((GroupKind.FULL, 4), (GroupKind.MAMBA, 8)), HBS, 8, 64)
GEOMETRY = ConnectorGeometry.build(PLANNER, (GroupKind.FULL, GroupKind.MAMBA), ())
TOKENS = tuple(range(16))


def _view(hashes: tuple[bytes, ...] | None) -> RequestView:
    return RequestView(RequestId("r"), TOKENS, len(TOKENS), None, hashes)


def _keys(view: RequestView) -> list[bytes]:
    keys = RequestKeys.for_view(GEOMETRY, view)
    assert keys.matches(view)
    keys.sync(view)
    return [keys.key(0, j) for j in range(2)] + [keys.key(1, 0), keys.key(1, 1)]


def test_engine_hashes_make_the_keys_and_nothing_is_hashed_here() -> None:
    engine = tuple(bytes([i]) * 8 for i in range(len(TOKENS) // HBS))
    keys = RequestKeys.for_view(GEOMETRY, _view(engine))
    assert keys.sync(_view(engine)) == 0
    assert keys.hashes_computed == 0
    full, mamba = GEOMETRY.suffixes
    # full attention: 4-token units, one hash block each; mamba: 8-token units, two each
    assert GEOMETRY.strides == (1, 2)
    expected = [engine[0] + full, engine[1] + full, engine[1] + mamba, engine[3] + mamba]
    assert _keys(_view(engine)) == expected


def test_same_tokens_different_engine_hashes_share_no_key() -> None:
    one = tuple(bytes([i]) * 8 for i in range(4))
    other = tuple(bytes([i + 100]) * 8 for i in range(4))
    assert not set(_keys(_view(one))) & set(_keys(_view(other)))


def test_without_engine_hashes_the_tokens_are_hashed() -> None:
    own = RequestHashList(HBS)
    own.append_tokens(TOKENS)
    assert _keys(_view(None))[0] == own[0] + GEOMETRY.suffixes[0]


def test_a_chain_of_one_source_does_not_match_a_view_of_the_other() -> None:
    engine = tuple(bytes([i]) * 8 for i in range(4))
    hashed = RequestKeys.for_view(GEOMETRY, _view(None))
    assert not hashed.matches(_view(engine))
    assert not RequestKeys.for_view(GEOMETRY, _view(engine)).matches(_view(None))


def test_a_salted_chain_keeps_extending_itself() -> None:
    """A chain is kept while its views match: the same salt, more tokens. One built for a
    salted view matches that view, so the core grows it instead of hashing the request anew."""
    salted = RequestView(RequestId("r"), TOKENS, len(TOKENS), "tenant-a")
    keys = RequestKeys.for_view(GEOMETRY, salted)
    assert keys.matches(salted)
    keys.sync(salted)
    longer = RequestView(RequestId("r"), (*TOKENS, 99, 98, 97, 96), len(TOKENS) + 4, "tenant-a")
    assert keys.matches(longer)
    assert not keys.matches(RequestView(RequestId("r"), TOKENS, len(TOKENS), "tenant-b"))
