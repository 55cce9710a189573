"""The load admission rule: async loads never fill vLLM 0.33's block pool so that none can run.

Issue 29: on a sliding-window + full model, eight requests sharing a 2,000-token system prompt
on a pool that holds about three of them wedged vLLM's engine (nothing running, nothing
freeing a block). Lines below are in ``vllm/v1/core/sched/scheduler.py`` unless named
otherwise. How it got there:

- The core answers a claim from the host's READY keys (``hybridkv/connector/core.py:206-247``);
  it defers only while the request's *own* load is in flight (222). A key another request is
  loading is READY, so several requests claimed the same 1,984-token prefix as async loads at
  once, each into its own blocks (the GPU prefix cache could not serve them: vLLM frees a
  request's out-of-window sliding blocks last-first, so the blocks at the window's lower edge
  are evicted first and the sliding groups' hit fails while the full group's holds).
- vLLM admits an async load if it fits in the free blocks less what the other in-flight
  prefills still need (``_inflight_prefill_reserved_blocks``, 3432, passed at 1427-1430;
  ``kv_cache_manager.py:584``). For a sliding-window group that need is undercounted:
  ``get_num_blocks_to_allocate`` (``single_type_kv_cache_manager.py:214-252``) caps the blocks
  required by ``max_admission_blocks_per_request`` (225, a count of real blocks) and then
  subtracts ``len(req_to_blocks)`` (228), which counts the null blocks padding the skipped
  prefix. A loaded 1,984-token request on a 512 window holds 62 entries of which 16 are real,
  so it reserves 0 sliding blocks where its last 116 tokens need 4 per group.
- So three loads were admitted, 13 blocks stayed free, and each loaded request needed 24 to
  run its tail. A request whose load finished is not running, so vLLM cannot preempt it; the
  waiting loop ``break``s at the first refused allocation (1454) and nothing else runs.

vLLM's native ``OffloadingConnector`` answers "not yet" (``None``) when a chunk its claim needs
is being loaded for another request (``offloading/scheduler.py:1021-1044``, the set filled at
1498-1499, emptied at 2294-2295); the waiting request then takes vLLM's GPU prefix hit on the
loaded blocks. That avoids the duplicate copies, not the undercount: distinct prefixes can
still fill the pool.

The rule (:class:`LoadAdmission`), applied to every async claim the core makes:

1. **Shared load.** If another request's async load still in flight covers a block of the
   claimed range with the same prefix (equal block hash at the last block both ranges cover:
   hashes chain, so equal there means equal below), answer DEFER. Once that load lands, vLLM
   caches the blocks (``_update_waiting_for_remote_kv``) and drains the loading request first
   (``kv_holding_waiting``, 1065), so the deferred request's next ask sees the GPU hit.
2. **Room.** A request whose load was admitted and that has not run yet holds its blocks and
   cannot be preempted. Answer DEFER if the blocks such requests need to run their next chunk,
   this one included, exceed the pool (:meth:`LoadAdmission.need`: a full-attention group
   holds the whole prompt, a sliding group its window plus one chunk, a mamba group its few
   states). Under that bound, once the running requests finish or are preempted, the first
   waiting loaded request fits beside the blocks the others hold, so something always runs.
   With no other load waiting the rule never defers (vLLM's start-up check fits one request
   of ``max_model_len``), so a deferred request waits only for loads that will run.

What the rule reads is vLLM's own state of each request (its status, computed tokens and block
hashes), not a record of the connector's: under async scheduling vLLM admits a load before it
tells the connector (``deferred_loads``, 1469-1480).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from hybridkv.kinds import GroupKind
from hybridkv.vllm.layout import VllmLayout

__all__ = ["GroupNeed", "LoadAdmission", "read_admission"]

_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING = RequestStatus.WAITING


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupNeed:
    """What one KV cache group holds for a request about to run its next chunk.

    Attributes:
        kind: the group's kind.
        block_size: its block size in tokens.
        reach: a sliding group's retained tokens below a position (``sliding_window - 1 +
            extra_retained_tokens``); 0 otherwise.
        states: a mamba group's blocks per request (vLLM's align mode: 2 + speculative +
            prefill checkpoint blocks, ``kv_cache_interface.py:1135-1141``); 0 otherwise.
    """

    kind: GroupKind
    block_size: int
    reach: int = 0
    states: int = 0

    def blocks(self, num_tokens: int, computed: int, chunk: int) -> int:
        """Real blocks held to compute ``[computed, computed + chunk)`` of ``num_tokens``."""
        whole = _cdiv(num_tokens, self.block_size)
        if self.kind is GroupKind.FULL:
            return whole
        if self.kind is GroupKind.SLIDING:
            step = min(chunk, max(num_tokens - computed, 0))
            return min(whole, _cdiv(self.reach + step, self.block_size) + 1)
        return min(whole, self.states)


class LoadAdmission:
    """The module's rule over the requests it answered an async claim.

    ``groups``: one :class:`GroupNeed` per KV cache group; ``hash_block_size``: the tokens of
    one ``request.block_hashes`` entry; ``capacity``: the pool's usable blocks (all but the
    null block); ``chunk``: ``max_num_batched_tokens``. Counters: ``shared`` and ``room``,
    the DEFER answers each rule gave. ``enabled=False`` answers every claim as the core does:
    an in-package control for the test that pins vLLM's wedge, never a user setting.
    """

    __slots__ = (
        "_claimed",
        "capacity",
        "chunk",
        "deferred_tokens",
        "enabled",
        "groups",
        "hash_block_size",
        "room",
        "shared",
    )

    def __init__(
        self,
        groups: tuple[GroupNeed, ...],
        hash_block_size: int,
        capacity: int,
        chunk: int,
        *,
        enabled: bool = True,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: the pool holds no usable block; check it")
        self.groups = groups
        self.hash_block_size = hash_block_size
        self.capacity = capacity
        self.chunk = chunk
        self.enabled = enabled
        # Requests answered an async claim that may hold blocks without running: id ->
        # (vLLM's request, the claim's start). Forgotten once running or finished.
        self._claimed: dict[str, tuple[Any, int]] = {}
        self.shared = 0
        self.room = 0
        self.deferred_tokens = 0

    @property
    def deferred(self) -> int:
        """DEFER answers given in front of the core's async claims (both rules)."""
        return self.shared + self.room

    def need(self, request: Any, computed: int) -> int:
        """Blocks ``request`` holds to run its next chunk from ``computed`` tokens."""
        num_tokens = int(request.num_tokens)
        return sum(g.blocks(num_tokens, computed, self.chunk) for g in self.groups)

    def defers(self, request: Any, start: int, num_tokens: int) -> bool:
        """Whether the core's async claim of ``[start, start + num_tokens)`` for ``request``
        is answered DEFER instead (module docstring). Post: a DEFER is counted; otherwise the
        request is recorded as claimed (its blocks count once vLLM admits the load)."""
        if not self.enabled:
            return False
        rid = request.request_id
        end = start + num_tokens
        held = self.need(request, end)
        for other_id, (other, other_start) in list(self._claimed.items()):
            if other_id == rid:
                continue
            status = other.status
            if status is _LOADING:
                if self._shares_load(request, start, end, other, other_start):
                    self.shared += 1
                    self.deferred_tokens += num_tokens
                    return True
            elif status is not _WAITING:
                del self._claimed[other_id]  # running, preempted or finished: not holding
                continue
            computed = int(other.num_computed_tokens)
            if computed:  # admitted (loading, or loaded and waiting to run)
                held += self.need(other, computed)
        if held > self.capacity:
            self.room += 1
            self.deferred_tokens += num_tokens
            return True
        self._claimed[rid] = (request, start)
        return False

    def _shares_load(
        self, request: Any, start: int, end: int, other: Any, other_start: int
    ) -> bool:
        """Whether ``other``'s load (``[other_start, its computed tokens)``) covers a block of
        ``[start, end)`` with the same prefix."""
        other_end = int(other.num_computed_tokens)
        if max(start, other_start) >= min(end, other_end):
            return False
        last = min(end, other_end) // self.hash_block_size - 1
        mine, theirs = request.block_hashes, other.block_hashes
        return 0 <= last < min(len(mine), len(theirs)) and mine[last] == theirs[last]

    def finished(self, request_id: str) -> None:
        """The request finished or was aborted. Post: it is forgotten."""
        self._claimed.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._claimed)


def read_admission(vllm_config: Any, kv_cache_config: Any, layout: VllmLayout) -> LoadAdmission:
    """The rule for vLLM's configuration: each group's need read off its ``kv_cache_spec``,
    the pool's blocks less the null block, the step's token budget."""
    needs = []
    for group, spec_group, reach in zip(
        layout.groups, kv_cache_config.kv_cache_groups, layout.window_reaches, strict=True
    ):
        spec = spec_group.kv_cache_spec
        states = 0
        if group.kind is GroupKind.MAMBA:
            # vLLM's own per-request state count (kv_cache_interface.py:1135-1141).
            spec_blocks = int(getattr(spec, "num_speculative_blocks", 0))
            if getattr(spec, "mamba_cache_mode", "none") == "align":
                states = 2 + spec_blocks + int(getattr(spec, "num_prefill_checkpoint_blocks", 0))
            else:
                states = 1 + spec_blocks
        needs.append(GroupNeed(group.kind, group.block_size, reach, states))
    return LoadAdmission(
        tuple(needs),
        layout.hash_block_size,
        layout.num_blocks - 1,
        int(vllm_config.scheduler_config.max_num_batched_tokens),
    )
