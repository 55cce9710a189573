"""``hybridkv.vllm.views``: a kept request view equals one built from scratch after each of the
ways vLLM 0.33 changes a ``Request`` (tokens appended, a streaming session's update, a new
request object under the same id), and block tables come out as tuples of Python ints."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

import numpy as np  # noqa: E402

from hybridkv.connector import RequestId, RequestView  # noqa: E402
from hybridkv.vllm.views import RequestViews, block_table  # noqa: E402

BLOCK = 4


def _request(rid: str, tokens: list[int], prompt: int, salt: str | None = None) -> SimpleNamespace:
    """The attributes the views read, with vLLM's chained per-block hashes."""
    request = SimpleNamespace(request_id=rid, cache_salt=salt, num_prompt_tokens=prompt)
    request.all_token_ids = tokens
    request.block_hashes = _hashes(tokens, salt)
    return request


def _hashes(tokens: list[int], salt: str | None) -> list[bytes]:
    out, parent = [], str(salt).encode()
    for b in range(len(tokens) // BLOCK):
        parent = repr((parent, tokens[b * BLOCK : (b + 1) * BLOCK])).encode()[-16:]
        out.append(parent)
    return out


def _fresh(request: SimpleNamespace) -> RequestView:
    return RequestView(
        RequestId(request.request_id),
        tuple(request.all_token_ids),
        int(request.num_prompt_tokens),
        request.cache_salt,
        tuple(request.block_hashes),
    )


def test_a_kept_view_equals_a_fresh_one_through_vllms_changes() -> None:
    rng = random.Random(3)
    views = RequestViews()
    tokens = [rng.randint(3, 999) for _ in range(37)]
    request = _request("a", tokens, 37, "salt")
    first = views.view(request)
    assert first == _fresh(request)
    assert views.view(request) is first  # unchanged: the same view, nothing copied
    for _ in range(9):  # decode: one token at a time (append_output_token_ids)
        tokens.append(rng.randint(3, 999))
        request.block_hashes = _hashes(tokens, "salt")
        assert views.view(request) == _fresh(request)
    # A streaming session's update: the last sampled token dropped, new prompt tokens.
    del tokens[-1]
    tokens.extend(rng.randint(3, 999) for _ in range(6))
    request.num_prompt_tokens = len(tokens)
    request.block_hashes = _hashes(tokens, "salt")
    assert views.view(request) == _fresh(request)
    # The same id on a new request object (another arrival): built from scratch.
    other = _request("a", [rng.randint(3, 999) for _ in range(len(tokens))], len(tokens))
    assert views.view(other) == _fresh(other)
    assert len(views) == 1
    views.forget("a")
    assert len(views) == 0


def test_block_tables_are_tuples_of_python_ints() -> None:
    assert block_table(([1, 2, 3], [], [7])) == ((1, 2, 3), (), (7,))
    converted = block_table(([np.int64(5), 6], [np.int32(9)]))
    assert converted == ((5, 6), (9,))
    assert {type(b) for group in converted for b in group} == {int}
