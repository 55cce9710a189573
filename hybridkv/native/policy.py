"""hybridkv's ARC with its admission rule as a native ``CachePolicy`` for the CPU tier.

Native's CPU manager keeps the slots, ref counts and events; its policy orders chunks and picks
victims (the same split as :mod:`hybridkv.store`). :class:`HybridKVARCPolicy` holds the chunks
native hands it and orders their keys with :class:`hybridkv.store.ARCPolicy` (hybridkv's ARC,
checked against the reference ``spec.policies.arc``; ``p`` an exact fraction), mapping native's
hooks onto it: ``insert`` -> ``on_insert``, ``touch`` and a reuse at ``on_request_finished`` ->
``on_access`` (T1 -> T2 once READY), ``on_store_miss`` -> ``on_miss`` (a ghost adapts ``p``),
``evict`` -> ``victims`` + ``on_evict``.

The admission rule (prompt before continuation, as ``HybridKVConnector``'s host store keeps it:
``hybridkv.store.StorePriority.LOW``): a chunk that ends past the request's prompt holds tokens
the request generated, and only the same conversation's next turn can reuse it, while the
prompt's chunks serve every request sharing the prefix. So a store whose every new chunk is a
continuation takes free slots only: it never displaces a cached chunk (``evict`` answers None,
which native's manager reads as "no room": the store is skipped and the request goes on). A
store that also carries prompt chunks evicts as plain ARC does, the continuation chunks with
it (native offers them in one call; the rule cannot split it).

Where the prompt ends: native's scheduler records, for every key of a request, the token at
which its chunk ends (``ReqContext.set_offload_key_position``), and at the request's first
lookup (``get_num_new_matched_tokens``, before any store) it has recorded exactly the prompt's
full chunks. The policy reads that record once, at the first hook that names the request, and
keeps the largest end as the prompt's. A later chunk ending past it is a continuation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from hybridkv.store import ARCPolicy

__all__ = ["HybridKVARCPolicy", "PromptEnd"]


class PromptEnd(int):
    """A request's prompt end in tokens (its full chunks), kept in its ``ReqContext``."""


class HybridKVARCPolicy(CachePolicy):
    """ARC + the prompt-before-continuation admission (the module docstring).

    Loaded by native's keys alone: ``"eviction_policy": "HybridKVARCPolicy",
    "cache_policy_module_path": "hybridkv.native"``.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._arc = ARCPolicy(cache_capacity)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        # Offered continuation chunks not yet resident: what ``evict`` refuses to make room for.
        self._continuations: set[OffloadKey] = set()
        self.refused = 0  # stores refused by the rule (they displaced nothing)

    # --- native's CachePolicy ---

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self._arc.on_insert(key)
        self._chunks[key] = chunk
        self._continuations.discard(key)

    def remove(self, key: OffloadKey) -> None:
        if self._chunks.pop(key, None) is not None:
            self._arc.on_remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):  # tail first: the head ends most recent
            chunk = self._chunks.get(key)
            if chunk is None:
                self._arc.on_miss(key)
            else:
                self._arc.on_access(key, ready=chunk.is_ready)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self._classify(keys, req_context)
        for key in reversed(keys):
            self._arc.on_miss(key)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._classify(list(keys), req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """A reuse is one access (T1 -> T2); a chunk the request only stored keeps its list and
        becomes its most recent (ARC's ``on_access`` of a chunk not READY)."""
        for key in reversed(order_request_keys(key_groups, req_context)):
            self._continuations.discard(key)
            if key not in self._chunks:
                continue
            if key in reused_keys:
                self._arc.on_access(key, ready=True)
            elif key in insertion_only_keys:
                self._arc.on_access(key, ready=False)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """``n`` victims (idle, not ``protected``), or None, changing nothing: fewer exist, or
        every chunk the store brings is a continuation (the admission rule)."""
        if n == 0:
            return []
        incoming = [key for key in protected if key not in self._chunks]
        if incoming and all(key in self._continuations for key in incoming):
            self.refused += 1
            return None
        chunks = self._chunks
        victims = self._arc.victims(
            n, lambda key: chunks[key].ref_cnt == 0 and key not in protected, ()
        )
        if len(victims) < n:
            return None
        self._arc.on_evict(victims)
        return [(key, chunks.pop(key)) for key in victims]

    def clear(self) -> None:
        self._arc = ARCPolicy(self.cache_capacity)
        self._chunks.clear()
        self._continuations.clear()

    # --- the rule ---

    def snapshot(self) -> dict[str, Any]:
        """hybridkv's ARC snapshot (T1, T2, ghosts, ``p``) and the refusals. Frame: none."""
        return {"arc": self._arc.snapshot(), "refused": self.refused}

    def _classify(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        end = _prompt_end(req_context)
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is not None and position > end and key not in self._chunks:
                self._continuations.add(key)


def _prompt_end(req_context: ReqContext) -> int:
    """The request's prompt end, read once (the module docstring) and kept in its context."""
    end = req_context.get_state(PromptEnd)
    if end is None:
        recorded = getattr(req_context, "_offload_key_positions", {})
        end = PromptEnd(max(recorded.values(), default=0))
        req_context.set_state(end)
    return int(end)
