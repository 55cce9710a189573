"""``HybridKVARCPolicy`` agrees with native's own ``arc`` wherever its admission rule is silent.

Two of vLLM 0.33's own CPU managers (``CPUOffloadingManager``), one ordered by native's
``ARCCachePolicy`` and one by ``HybridKVARCPolicy`` (loaded by ``cache_policy_module_path``),
take the same random operations: stores (some failing), loads, touches and finished requests,
over prompt chunks only (no chunk ends past its request's prompt, so the admission rule never
refuses). After every operation both answer the same: which chunks a store evicted (in order)
or that it was refused, and every chunk's lookup. Hypothesis profiles set the count
(``HYPOTHESIS_PROFILE=ci``: derandomized).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYS = [bytes([i]) * 36 for i in range(10)]  # a block hash and a group index, as native's
REQUESTS = 3

op = st.one_of(
    st.tuples(
        st.just("store"),
        st.integers(0, REQUESTS - 1),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
        st.booleans(),
    ),
    st.tuples(
        st.just("load"),
        st.integers(0, REQUESTS - 1),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
        st.just(True),
    ),
    st.tuples(
        st.just("touch"),
        st.integers(0, REQUESTS - 1),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
        st.just(True),
    ),
    st.tuples(st.just("finish"), st.integers(0, REQUESTS - 1), st.just([]), st.just(True)),
)


class _Side:
    """One manager and its requests' contexts (every key a prompt chunk of every request)."""

    def __init__(self, policy: str, capacity: int) -> None:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        path = "hybridkv.native" if policy == "HybridKVARCPolicy" else None
        self.manager = CPUOffloadingManager(
            capacity, cache_policy=policy, cache_policy_module_path=path
        )
        self.contexts = [self._context(r, 0) for r in range(REQUESTS)]
        self.generation = [0] * REQUESTS

    @staticmethod
    def _context(request: int, generation: int) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=f"r{request}-{generation}")
        for i, key in enumerate(KEYS):
            ctx.set_offload_key_position(key, 16 * (i + 1))
        return ctx

    def apply(self, kind: str, request: int, keys: list[bytes], ok: bool) -> Any:
        m, ctx = self.manager, self.contexts[request]
        if kind == "store":
            out = m.prepare_store(keys, ctx)
            if out is None:
                return None
            m.complete_store(out.keys_to_store, ctx, success=ok)
            return (list(out.keys_to_store), list(out.evicted_keys))
        if kind == "load":
            ready = [k for k in keys if m.lookup(k, ctx).name == "HIT"]
            if ready:
                m.prepare_load(ready, ctx)
                m.complete_load(ready, ctx)
            return ready
        if kind == "touch":
            m.touch(keys, ctx)
            return None
        m.on_request_finished(ctx)
        self.generation[request] += 1
        self.contexts[request] = self._context(request, self.generation[request])
        return None

    def lookups(self) -> list[str]:
        return [self.manager.lookup(k, self.contexts[0]).name for k in KEYS]


@settings(deadline=None)
@given(st.integers(2, 6), st.lists(op, max_size=40))
def test_the_policy_agrees_with_natives_arc_without_continuations(
    capacity: int, ops: list[tuple[str, int, list[bytes], bool]]
) -> None:
    native, ours = _Side("arc", capacity), _Side("HybridKVARCPolicy", capacity)
    for step in ops:
        assert ours.apply(*step) == native.apply(*step), step
        assert ours.lookups() == native.lookups(), step
    assert ours.manager._policy.refused == 0


def test_the_agreement_covers_evictions_and_ghost_hits() -> None:
    """The guard: a sequence with evictions from T1 and T2 and a ghost hit moving ``p``, on
    which both still agree (so the random runs compare more than empty answers)."""
    native, ours = _Side("arc", 3), _Side("HybridKVARCPolicy", 3)
    a, b, c, d, e = KEYS[:5]
    steps = [
        ("store", 0, [a, b, c], True),
        ("load", 1, [a], True),  # a reused: T1 -> T2 at the request's end
        ("finish", 1, [], True),
        ("store", 0, [d], True),  # evicts b (T1) into B1
        ("store", 2, [b], True),  # b again: a B1 ghost hit raises p; evicts
        ("store", 2, [e], True),
    ]
    answers = []
    for step in steps:
        answers.append(ours.apply(*step))
        assert answers[-1] == native.apply(*step), step
        assert ours.lookups() == native.lookups(), step
    evicted = [keys for answer in answers if isinstance(answer, tuple) for keys in answer[1]]
    assert b in evicted
    assert len(evicted) >= 3
    assert ours.manager._policy.snapshot()["arc"]["extra"]["target"] != (0, 1)
