"""The KV cache coordinator: every group's manager over ONE shared block pool.

This is vLLM 0.33's ``KVCacheManager.allocate_slots`` (``v1/core/kv_cache_manager.py:380-627``)
with the coordinator under it (``v1/core/kv_cache_coordinator.py``), cut down to what the
scheduler model needs:

1. free what the window no longer reads, on the processed-token basis (564-568);
2. sum every group's reservation and refuse when it exceeds ``free - reserved_blocks`` (570-590);
3. adopt hits in EVERY group first, then give every group its external blocks (two-phase,
   ``kv_cache_coordinator.py:295-313``, issue #33775): one group's allocation must not evict
   another group's hit before that hit is touched;
4. grow every group's table for the new tokens (604-610).

Caching is a separate call (:meth:`KVCacheCoordinator.cache_blocks`): vLLM caches at the end of
``allocate_slots`` unless the caller delays it (613-625); the caller here makes the same call.
Frees go group by group, each table tail first (``kv_cache_coordinator.py:404-412``).

Layout facts: ``scheduler_block_size`` is the lcm of the group block sizes, hashes are taken every
``hash_block_size = gcd`` tokens, and hits align to the scheduler block size
(``v1/core/kv_cache_utils.py:816-950``; partial hash hits are not modelled). With several groups,
only whole scheduler blocks are cached (``_align_cacheable``, ``kv_cache_coordinator.py:777-787``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from spec.block_pool import BlockHash, BlockId, BlockPool, Refused
from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.managers.base import SingleTypeManager, coarse_hashes
from spec.managers.full import FullAttentionManager
from spec.managers.group_spec import GroupSpec
from spec.managers.longest_hit import (
    NO_HIT,
    CacheHit,
    find_longest_cache_hit,
    find_longest_cache_hit_per_group,
)
from spec.managers.mamba import MambaManager
from spec.managers.sliding import SlidingWindowManager

__all__ = ["KVCacheCoordinator"]

_MANAGERS: Mapping[GroupKind, type[SingleTypeManager]] = {
    GroupKind.FULL: FullAttentionManager,
    GroupKind.SLIDING: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}


class KVCacheCoordinator:
    """All groups of one model over one pool.

    State: the pool, one manager per group, the processed-token basis each request's windows
    were last trimmed to, and the last allocation's per-group ``(reserved, taken)`` counts, which
    ``GR-6`` and ``GR-7`` check.
    """

    manager_classes: ClassVar[Mapping[GroupKind, type[SingleTypeManager]]] = _MANAGERS
    """Which manager serves each kind (a broken variant in a test swaps one)."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        num_blocks: int,
        retention_interval: int | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        """Pre: at least one group; ``num_blocks >= 2``; ``retention_interval`` is vLLM's
        ``prefix_cache_retention_interval``: ``None`` (dense) or 0 (sparse, vLLM's default);
        ``hash_block_size`` (the tokens per block hash of the request's hash list, vLLM's
        ``KVCacheConfig.hash_block_size``) divides every group's block size; ``None`` means their
        gcd, vLLM's default. Post: an empty pool, empty tables. Refusal: :class:`ConfigError`
        naming the field, nothing built."""
        if not groups or not all(isinstance(g, GroupSpec) for g in groups):
            raise ConfigError("groups", groups, "need one GroupSpec or more", "list the groups")
        if retention_interval not in (None, 0) or isinstance(retention_interval, bool):
            raise ConfigError(
                "retention_interval",
                retention_interval,
                "only dense (None) and sparse (0) retention are modelled",
                "pass None or 0",
            )
        sizes = [g.block_size for g in groups]
        self.scheduler_block_size = math.lcm(*sizes)
        # The hash list's granularity comes from the caller: a coordinator that assumed the gcd
        # while the hashes were finer would read hash i as block i's and report false hits.
        self.hash_block_size = math.gcd(*sizes) if hash_block_size is None else hash_block_size
        if (
            isinstance(self.hash_block_size, bool)
            or not isinstance(self.hash_block_size, int)
            or self.hash_block_size < 1
            or any(size % self.hash_block_size for size in sizes)
        ):
            raise ConfigError(
                "hash_block_size",
                hash_block_size,
                f"does not divide every group's block size {sizes}",
                "pass a divisor of their gcd, or None for the gcd",
            )
        self.pool = BlockPool(num_blocks)
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            self.manager_classes[g.kind](g, i, self.scheduler_block_size, retention_interval)
            for i, g in enumerate(groups)
        )
        self.processed: dict[str, int] = {}
        self.last_allocation: tuple[tuple[int, int], ...] = ((0, 0),) * len(groups)

    # ------------------------------------------------------------ hits
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> CacheHit:
        """The hybrid fixed-point hit (see :mod:`spec.managers.longest_hit`). Pure.

        ``block_hashes`` are the request's hashes every ``hash_block_size`` tokens; callers bound
        ``max_length`` by ``num_tokens - 1`` as vLLM does (``kv_cache_manager.py:296-302``).
        """
        return find_longest_cache_hit(
            self.managers, self.pool, block_hashes, self.hash_block_size, max_length
        )

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[int, ...]:
        """Each group's own hit length, unreconciled. Pure."""
        return find_longest_cache_hit_per_group(
            self.managers, self.pool, block_hashes, self.hash_block_size, max_length
        )

    # ------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        hit: CacheHit = NO_HIT,
        num_external_computed_tokens: int = 0,
        num_in_flight_tokens: int = 0,
        reserved_blocks: int = 0,
        full_sequence_tokens: int | None = None,
        admission_caps: Sequence[int | None] = (),
    ) -> tuple[tuple[BlockId, ...], ...] | Refused:
        """Give the request slots for ``num_new_tokens`` after its computed, hit and external ones.

        ``num_computed_tokens`` is what the request had before; ``hit`` is a new local prefix hit
        (first allocation only); ``num_external_computed_tokens`` are claimed by a connector.
        ``full_sequence_tokens`` (vLLM's ``full_sequence_must_fit``): first check that the whole
        sequence of that many tokens fits the free blocks, each group's count capped by its
        ``admission_caps`` entry (``kv_cache_manager.py:535-552``).

        Pre: at least one of new tokens, hit tokens or external tokens is positive.
        Post: every group's table covers ``computed + hit + external + new`` tokens (mamba: its
        state and scratch positions), windows trimmed to the processed tokens; returns the new
        blocks per group. ``last_allocation`` holds each group's (reserved, taken).
        Refusal: the whole sequence does not fit the free blocks -> :class:`Refused`, nothing
        changes; the reservation exceeds ``free - reserved_blocks`` -> :class:`Refused`, the
        only change is step 1, the release of blocks the windows no longer read (as in vLLM,
        which frees them "even if we cannot schedule this request", ``kv_cache_manager.py
        :556-568``).
        """
        for field, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_computed_tokens", num_computed_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_in_flight_tokens", num_in_flight_tokens),
            ("reserved_blocks", reserved_blocks),
        ):
            _check_count(field, value)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and hit.num_tokens == 0:
            raise ConfigError(
                "num_new_tokens", 0, "nothing to allocate", "schedule tokens or adopt a hit"
            )
        hit_blocks = hit.blocks or ((),) * len(self.managers)
        num_local = num_computed_tokens + hit.num_tokens
        total = num_local + num_external_computed_tokens
        num_tokens = total + num_new_tokens
        if full_sequence_tokens is not None:
            caps = tuple(admission_caps) or (None,) * len(self.managers)
            whole = sum(
                m.get_num_blocks_to_allocate(
                    request_id,
                    full_sequence_tokens,
                    hit_blocks[i],
                    total_computed_tokens=total,
                    num_local_computed_tokens=num_local,
                    pool=self.pool,
                    admission_cap=caps[i],
                )
                for i, m in enumerate(self.managers)
            )
            if whole > self.pool.get_num_free_blocks():
                return Refused(needed=whole, available=self.pool.get_num_free_blocks())
        self.remove_skipped_blocks(request_id, max(0, total - num_in_flight_tokens))
        counts = tuple(
            m.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                hit_blocks[i],
                total_computed_tokens=total,
                num_local_computed_tokens=num_local,
                pool=self.pool,
            )
            for i, m in enumerate(self.managers)
        )
        available = self.pool.get_num_free_blocks() - reserved_blocks
        if sum(counts) > available:
            return Refused(needed=sum(counts), available=available)
        for manager in self.managers:
            manager.taken = 0
        self._adopt(request_id, hit, hit_blocks, num_local, num_external_computed_tokens)
        new = tuple(m.allocate_new_blocks(request_id, num_tokens, self.pool) for m in self.managers)
        taken = tuple(m.taken for m in self.managers)
        self.last_allocation = tuple(zip(counts, taken, strict=True))
        self.processed[request_id] = max(0, total - num_in_flight_tokens)
        return new

    def _adopt(
        self,
        request_id: str,
        hit: CacheHit,
        hit_blocks: Sequence[Sequence[BlockId]],
        num_local: int,
        num_external: int,
    ) -> None:
        """Two-phase adoption: every group's hit is touched before any external block is taken."""
        if hit.num_tokens == 0 and not any(hit.blocks) and num_external == 0:
            return
        if any(request_id in m.num_cached_block for m in self.managers):
            return  # a running request adopts nothing new (kv_cache_coordinator.py:286-291)
        self._adopt_groups(request_id, hit_blocks, num_local, num_external)

    def _adopt_groups(
        self,
        request_id: str,
        hit_blocks: Sequence[Sequence[BlockId]],
        num_local: int,
        num_external: int,
    ) -> None:
        """Phase 1: every group touches its hit. Phase 2: every group takes its external blocks."""
        for i, manager in enumerate(self.managers):
            manager.add_local_computed_blocks(
                request_id, hit_blocks[i], num_local, num_external, self.pool
            )
        if num_external > 0:
            for manager in self.managers:
                manager.allocate_external_computed_blocks(
                    request_id, num_local, num_external, self.pool
                )

    def new_step_starts(self) -> None:
        """A scheduler step starts: every manager forgets what it cached in the last one
        (``kv_cache_coordinator.py:474-477``). Never refuses."""
        for manager in self.managers:
            manager.new_step_starts()

    # ------------------------------------------------------------ release and caching
    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Free, in every group, the blocks its window no longer reads.

        Post: each group's positions below its skipped tokens hold nulls; the basis is recorded
        for ``GR-4``/``GR-5``. Never refuses.
        """
        _check_count("num_processed_tokens", num_processed_tokens)
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_processed_tokens, self.pool)
        if any(request_id in m.req_to_blocks for m in self.managers):
            self.processed[request_id] = num_processed_tokens

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        boundaries: Sequence[int] = (),
    ) -> None:
        """Give cache entries to the request's full blocks, in every group, up to ``num_tokens``.

        ``block_hashes`` are taken every ``hash_block_size`` tokens; ``boundaries`` are the
        positions a later request can resume at (what sparse retention keeps). With several
        groups only whole scheduler blocks count. Post: see
        :meth:`SingleTypeManager.cache_blocks`.
        """
        _check_count("num_tokens", num_tokens)
        if len(self.managers) > 1:
            num_tokens -= num_tokens % self.scheduler_block_size
        for manager in self.managers:
            hashes = coarse_hashes(block_hashes, self.hash_block_size, manager.block_size)
            manager.cache_blocks(request_id, hashes, num_tokens, self.pool, boundaries)

    def free(self, request_id: str) -> None:
        """Release every group's table of the request, group by group, each tail first.

        Post: the request holds no block. An unknown request is a no-op.
        """
        for manager in self.managers:
            manager.free(request_id, self.pool)
        self.processed.pop(request_id, None)

    # ------------------------------------------------------------ observations and copies
    def get_blocks(self, request_id: str) -> tuple[tuple[BlockId, ...], ...]:
        """The request's block table in every group.

        Pure: a request without blocks has ``()`` in every group."""
        return tuple(m.blocks(request_id) for m in self.managers)

    def clone(self) -> KVCacheCoordinator:
        """An independent copy: one pool copy, every manager copied.

        Frame: nothing changes in ``self``. Post: equal :meth:`freeze`; nothing mutable shared."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.pool = self.pool.clone()
        twin.managers = tuple(m.clone() for m in self.managers)
        twin.processed = dict(self.processed)
        return twin

    def snapshot(self) -> dict[str, Any]:
        """The plain state the ``GR-*`` invariants read (subject ``"kv_cache_groups"``).

        Keys: ``block_pool`` (the pool's snapshot) and ``groups``, one mapping per group with
        ``kv_cache_group_id``, ``kind``, ``block_size``, ``sliding_window``,
        ``extra_retained_tokens``, ``num_speculative_blocks``, ``num_prefill_checkpoint_blocks``
        (always 0: the managers model no checkpoint block), ``reserved``, ``taken`` and
        ``tables``: sorted ``(request_id, processed_tokens, (block ids...))``.

        Frame: nothing changes.
        """
        return {
            "block_pool": self.pool.snapshot(),
            "groups": tuple(
                self._group_snapshot(m, alloc)
                for m, alloc in zip(self.managers, self.last_allocation, strict=True)
            ),
        }

    def _group_snapshot(self, m: SingleTypeManager, alloc: tuple[int, int]) -> dict[str, Any]:
        return {
            "kv_cache_group_id": m.kv_cache_group_id,
            "kind": m.spec.kind.value,
            "block_size": m.block_size,
            "sliding_window": m.spec.sliding_window,
            "extra_retained_tokens": m.spec.extra_retained_tokens,
            "num_speculative_blocks": m.spec.num_speculative_blocks,
            # vLLM's prefill checkpoint block (spec.connector.checkpoints); not modelled here.
            "num_prefill_checkpoint_blocks": 0,
            "reserved": alloc[0],
            "taken": alloc[1],
            "tables": tuple(
                sorted(
                    (rid, self.processed.get(rid, 0), tuple(int(b) for b in table))
                    for rid, table in m.req_to_blocks.items()
                )
            ),
        }

    def freeze(self) -> tuple[Any, ...]:
        """A hashable state for deduplication; the last allocation's accounting is left out.

        Built directly rather than through :meth:`snapshot` (the explorer calls it for every
        state): the pool's freeze, each group's per-request state (tables, cached-block counts,
        the mamba first-allocation marks) and the processed-token basis.

        Frame: nothing changes.
        """
        return (
            self.pool.freeze(),
            tuple(m.freeze() for m in self.managers),
            tuple(sorted(self.processed.items())),
        )


def _check_count(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, value, "must be an int >= 0", "pass a non-negative int")
