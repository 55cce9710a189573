"""What every per-group manager does: one block table per request over the shared pool.

The shape follows vLLM 0.33's ``SingleTypeKVCacheManager``
(``v1/core/single_type_kv_cache_manager.py:48-740``). A manager holds no pool: the pool is an
argument of each call, so the coordinator owns the one shared pool and a copy of the coordinator
copies it exactly once.

Facts carried over (file:line relative to ``vllm/``):

- the reservation count for a new request: ``max(cdiv(n, bs) - max(skipped_blocks, hit + held),
  0)`` plus the evictable hit blocks past the skipped ones; for a running request
  ``max(cdiv(n, bs) - held, 0)`` (``single_type_kv_cache_manager.py:176-266``);
- ``add_local_computed_blocks`` pads the skipped prefix with nulls and touches only the kept hit
  blocks (268-325); ``allocate_external_computed_blocks`` gives real blocks only up to
  ``cdiv(total, bs)`` and clips the external count to the window (327-368);
- ``cache_blocks`` caches ``min(num_tokens, hashed tokens) // bs`` full blocks (477-543);
- ``free`` drops the leading nulls and frees the rest tail first (571-599);
- ``remove_skipped_blocks`` nulls whole blocks below the skipped tokens, walking down from the
  highest and stopping at the first null (682-720, 655-680).

Not modelled: partial-hit copy-on-write, admission caps, lookahead slots, EAGLE, zeroing records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spec.block_pool import NULL_BLOCK, BlockHash, BlockId, BlockPool, Refused
from spec.errors import ConfigError, InvariantViolation
from spec.managers.group_spec import GroupSpec, cdiv

__all__ = ["GroupHit", "SingleTypeManager", "coarse_hashes"]


@dataclass(frozen=True, slots=True)
class GroupHit:
    """One group's prefix-cache hit: its blocks (null-padded where skipped) and its length."""

    blocks: tuple[BlockId, ...]
    num_tokens: int


def coarse_hashes(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> tuple[BlockHash, ...]:
    """The hashes of ``block_size`` blocks from hashes taken every ``hash_block_size`` tokens.

    A coarse block's hash is the last fine hash inside it (vLLM's
    ``BlockHashListWithBlockSize``, ``kv_cache_utils.py:1157-1227``).

    Pure. Pre: ``hash_block_size`` divides ``block_size``; a trailing partial coarse block gets no
    hash.
    """
    scale = block_size // hash_block_size
    # Coarse hash i is fine hash (i + 1) * scale - 1: every scale-th one from scale - 1. One
    # slice, not a Python loop: the scheduler asks for every group's view at every step.
    return tuple(block_hashes[scale - 1 :: scale])


class SingleTypeManager:
    """Block tables of one KV cache group; subclasses say what a group may skip and hit.

    State: ``req_to_blocks`` (request id -> block table), ``num_cached_block`` (request id ->
    blocks already given cache entries) and ``taken`` (blocks this manager took from the pool in
    the current allocation; the coordinator resets it and checks it against the reservation).
    """

    def __init__(
        self,
        spec: GroupSpec,
        kv_cache_group_id: int,
        alignment_tokens: int,
        retention_interval: int | None = None,
    ) -> None:
        """Pre: ``alignment_tokens`` is a positive multiple of ``spec.block_size``;
        ``retention_interval`` is ``None`` (dense) or 0 (sparse), see :meth:`block_mask`."""
        if alignment_tokens <= 0 or alignment_tokens % spec.block_size:
            raise ConfigError(
                "alignment_tokens",
                alignment_tokens,
                f"not a positive multiple of block_size {spec.block_size}",
                "use the scheduler block size (lcm of the group block sizes)",
            )
        self.spec = spec
        self.kv_cache_group_id = kv_cache_group_id
        self.block_size = spec.block_size
        self.alignment_tokens = alignment_tokens
        self.retention_interval = retention_interval
        self.req_to_blocks: dict[str, list[BlockId]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.taken = 0

    # ------------------------------------------------------------ what a kind decides
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no future step of this group reads (0: full attention keeps everything).

        Pure."""
        del num_computed_tokens
        return 0

    def find_longest_cache_hit(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], max_length: int
    ) -> GroupHit:
        """The longest hit of at most ``max_length`` tokens this group accepts. Pure."""
        raise NotImplementedError

    def block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int] = ()
    ) -> list[bool] | None:
        """Which of the new full blocks deserve cache entries (``None``: all).

        ``boundaries`` are the positions a later request can resume at (used by the sparse
        kinds when ``retention_interval`` is 0). Full attention caches every block.

        Pure.
        """
        del start_block, end_block, boundaries
        return None

    # ------------------------------------------------------------ reservation
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[BlockId],
        *,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        pool: BlockPool,
        admission_cap: int | None = None,
    ) -> int:
        """Blocks an allocation of ``num_tokens`` slots takes off the free queue. Pure.

        ``total_computed_tokens`` counts local and external tokens, ``num_local_computed_tokens``
        the local ones (the request's own and its new hit); ``admission_cap`` bounds the blocks
        the request needs in all (vLLM's ``apply_admission_cap``, 214-227).

        Pre: a running request (one with cache bookkeeping) brings no hit blocks.
        Post: the count is >= 0 and covers new blocks plus hit blocks that leave the queue.
        """
        del num_local_computed_tokens  # the base count needs the total only
        required = cdiv(num_tokens, self.block_size)
        if admission_cap is not None:
            required = min(required, admission_cap)
        held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            return max(required - held, 0)
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped, len(hit_blocks) + held), 0)
        kept_hit = hit_blocks[max(0, skipped - held) :]
        return num_new + _num_evictable(pool, kept_hit)

    # ------------------------------------------------------------ allocation
    def add_local_computed_blocks(
        self,
        request_id: str,
        hit_blocks: Sequence[BlockId],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        pool: BlockPool,
    ) -> None:
        """Adopt the prefix hit: nulls for the skipped prefix, a reference on each kept block.

        Pre: the request has no table yet. Post: its table is ``[null] * skipped + kept hits``
        and all of it counts as cached.
        """
        if self.req_to_blocks.get(request_id):
            raise ConfigError("request_id", request_id, "already holds blocks", _FIX_NEW)
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total) // self.block_size
        kept = list(hit_blocks[skipped:])
        self.taken += _num_evictable(pool, kept)
        pool.touch(kept)
        table = [NULL_BLOCK] * skipped + kept
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        pool: BlockPool,
    ) -> None:
        """Real blocks for the external tokens this group still reads, and no others.

        Pre: every group's hit was adopted first (vLLM's two-phase order, issue #33775), and the
        coordinator reserved the blocks. Post: the table covers ``cdiv(total, bs)`` positions;
        positions already null stay null (nothing is allocated and then freed, vLLM #30166).
        """
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        num_external = num_external_computed_tokens
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend(self._take(pool, max(0, cdiv(total, self.block_size) - len(table))))

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, pool: BlockPool
    ) -> tuple[BlockId, ...]:
        """Grow the table to ``cdiv(num_tokens, bs)`` positions; return the new blocks.

        Pre: the coordinator reserved the blocks. Post: the table has at least that many
        positions; a table already long enough gets nothing.
        """
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return ()
        new = self._take(pool, num_new)
        table.extend(new)
        return new

    def new_step_starts(self) -> None:
        """A scheduler step starts (vLLM's ``new_step_starts``); nothing to do here.

        Post: nothing changes (subclasses clear per-step state). Never refuses."""

    # ------------------------------------------------------------ release and caching
    def remove_skipped_blocks(
        self, request_id: str, num_processed_tokens: int, pool: BlockPool
    ) -> None:
        """Free the blocks wholly below the skipped tokens, replacing them by nulls.

        Post: positions ``< skipped(num_processed_tokens) // bs`` hold nulls; the freed blocks go
        back highest position first. An unknown request is left alone.
        """
        table = self.req_to_blocks.get(request_id)
        skipped = self.get_num_skipped_tokens(num_processed_tokens)
        if table is None or skipped <= 0:
            return
        freed = self._null_out(table, min(skipped // self.block_size, len(table)))
        pool.free_blocks(freed)

    def _null_out(self, table: list[BlockId], end: int) -> list[BlockId]:
        """Null positions below ``end`` walking down; stop at the first null already there."""
        freed: list[BlockId] = []
        for index in range(end - 1, -1, -1):
            if table[index] == NULL_BLOCK:
                break
            freed.append(table[index])
            table[index] = NULL_BLOCK
        return freed

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        pool: BlockPool,
        boundaries: Sequence[int] = (),
    ) -> None:
        """Give cache entries to the request's full blocks up to ``num_tokens`` tokens.

        ``block_hashes`` are this group's block hashes (see :func:`coarse_hashes`);
        ``boundaries`` the request's resume positions (see :meth:`block_mask`).
        Post: blocks ``[cached, min(num_tokens // bs, len(hashes)))`` are cached (null and masked
        ones skipped) and counted as cached. Nothing changes when none is new.
        """
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_cached >= num_full:
            return
        table = self.req_to_blocks.get(request_id, [])
        mask = self.block_mask(num_cached, num_full, boundaries)
        pool.cache_full_blocks(
            table,
            block_hashes,
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=mask,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str, pool: BlockPool) -> None:
        """Release the request's table: leading nulls dropped, the rest freed tail first.

        Post: the request has no table and no bookkeeping. An unknown request is a no-op.
        """
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        head = 0
        while head < len(table) and table[head] == NULL_BLOCK:
            head += 1
        pool.free_blocks(list(reversed(table[head:])))

    # ------------------------------------------------------------ observations and copies
    def blocks(self, request_id: str) -> tuple[BlockId, ...]:
        """The request's block table (``()`` when it holds none).

        Pure: an unknown request holds ``()``."""
        return tuple(self.req_to_blocks.get(request_id, ()))

    def clone(self) -> SingleTypeManager:
        """An independent copy of the tables and bookkeeping.

        Frame: nothing changes in ``self``. Post: equal :meth:`freeze`; no table shared (the pool is
        not the manager's: the coordinator copies it)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.req_to_blocks = {rid: list(t) for rid, t in self.req_to_blocks.items()}
        twin.num_cached_block = dict(self.num_cached_block)
        self._clone_extra(twin)
        return twin

    def _clone_extra(self, twin: Any) -> None:
        """Copy subclass state into ``twin`` (none here)."""

    def freeze(self) -> tuple[Any, ...]:
        """A hashable value of every piece of per-request state (the dedup key of a group).

        Frame: nothing changes."""
        return (
            tuple(sorted((rid, tuple(t)) for rid, t in self.req_to_blocks.items())),
            tuple(sorted(self.num_cached_block.items())),
            self._freeze_extra(),
        )

    def _freeze_extra(self) -> tuple[Any, ...]:
        """Subclass state for :meth:`freeze` (none here)."""
        return ()

    def _take(self, pool: BlockPool, num_blocks: int) -> tuple[BlockId, ...]:
        got = pool.get_new_blocks(num_blocks)
        if isinstance(got, Refused):
            # The coordinator reserved what this group takes; a refusal here means the
            # reservation under-counted: vLLM would crash, the model names the invariant.
            raise InvariantViolation(
                "GR-7", f"group {self.kv_cache_group_id} needed {num_blocks} unreserved blocks"
            )
        self.taken += num_blocks
        return got


_FIX_NEW = "adopt a hit only for a request's first allocation"


def _num_evictable(pool: BlockPool, blocks: Sequence[BlockId]) -> int:
    """Hit blocks that leave the free queue when touched (reference count 0, not null)."""
    return sum(1 for b in blocks if b != NULL_BLOCK and pool.ref_count(b) == 0)
