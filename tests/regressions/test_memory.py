"""Memory: sliding-window layers given blocks they never read.

Scenario: two field bugs gave a sliding-window group the blocks of full attention. vLLM #30166
allocated an external claim's whole prefix and freed the out-of-window part a step later: the
memory is wasted meanwhile, and a connector still copying into a freed block races with the
request the pool hands it to. vLLM #41830: a connector that switched the hybrid manager off had
its sliding-window layers managed as full attention, and the model no longer fit at start-up.
The engine tests replay them as scripts; the last test computes the start-up memory from the
real gpt-oss-20b layout (``spec.layout`` on the preset's config).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import pytest
from regression_script import LOAD, Script, config, expected_token, full, request, sliding

from spec.block_pool import BlockId, BlockPool
from spec.kinds import GroupKind
from spec.layout import LayoutSettings, derive_layout, model_from_config
from spec.managers import (
    FullAttentionManager,
    KVCacheCoordinator,
    SingleTypeManager,
    SlidingWindowManager,
)
from spec.managers.group_spec import cdiv
from spec.presets import preset_config
from spec.scheduler.scheduler import Scheduler
from spec.system import parts

P9 = tuple(range(1, 10))


def _with_managers(managers: Mapping[GroupKind, type[SingleTypeManager]]) -> type[Scheduler]:
    """A scheduler whose coordinator serves the given kinds with the given managers."""

    class Coordinator(KVCacheCoordinator):
        manager_classes: ClassVar[Mapping[GroupKind, type[SingleTypeManager]]] = {
            **KVCacheCoordinator.manager_classes,
            **managers,
        }

    class Swapped(Scheduler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.kv = Coordinator(self.config.groups, self.config.num_blocks)
            self.bind_connector(self.connector)

    return Swapped


def _sliding_blocks(s: Script, rid: str) -> tuple[int, ...]:
    return next(t for g, r, t in parts.tables(s.engine.scheduler) if g == 1 and r == rid)


# --------------------------------------------------------------------------------------------
# #30166: sliding-window layers allocated for the whole prefix and freed a step later


class AllocateThenFree(SlidingWindowManager):
    """Before the fix: an external claim gets real blocks for every position; the window is
    trimmed (the out-of-window blocks freed) at the request's next allocation or its free."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        hit_blocks: Sequence[BlockId],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        pool: BlockPool,
    ) -> None:
        pool.touch(hit_blocks)
        self.req_to_blocks[request_id] = list(hit_blocks)
        self.num_cached_block[request_id] = len(hit_blocks)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        pool: BlockPool,
    ) -> None:
        total = num_local_computed_tokens + num_external_computed_tokens
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend(self._take(pool, cdiv(total, self.block_size) - len(table)))

    def get_num_blocks_to_allocate(  # type: ignore[override]
        self, request_id: str, num_tokens: int, hit_blocks: Sequence[BlockId], **kw: object
    ) -> int:
        if request_id in self.num_cached_block:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, hit_blocks, **kw)  # type: ignore[arg-type]
        return cdiv(num_tokens, self.block_size) - len(hit_blocks)


def _claim_then_abort(scheduler: type[Scheduler] | None) -> Script:
    r0 = request("r0", P9)
    r1 = request("r1", tuple(range(30, 37)))
    cfg = config((full(), sliding(window=4)), [r0, r1], num_blocks=15)
    s = Script(cfg, scheduler_cls=scheduler)
    s.seed("r0", 8)
    s.arrive("r0")
    s.step()  # r0 claims 8 and waits; its four load jobs are in flight
    s.abort("r0")  # the client gives up while the loads copy
    s.arrive("r1")
    s.step()  # r1 (no host hit) is admitted and allocated
    s.run()
    return s


@pytest.mark.mutation("TR-1", "DATA-1")
def test_gr4_external_claim_allocates_the_sliding_window_only() -> None:
    """Scenario (#30166): r0 claims 8 host tokens on full attention + a sliding window of 4
    (it reads the 3 tokens before a position). At 8 the window needs tokens 5..7: blocks 2
    and 3 of the sliding table; blocks 0 and 1 must be the null block from the start. Then r0
    is aborted while its loads copy, and r1 is admitted. Allocating the whole prefix and
    trimming it at the abort frees blocks 0 and 1 under their in-flight loads; the pool hands
    them to r1, and the late copies write r0's KV into r1's blocks."""
    s = _claim_then_abort(None)
    assert s.broken() == set()
    assert s.outputs[0].scheduled == ()  # step 1: r0 only waits
    assert s.status("r0") == "FINISHED_ABORTED"
    assert s.tokens("r1") == (expected_token("r1", 7), expected_token("r1", 8))

    broken = _claim_then_abort(_with_managers({GroupKind.SLIDING: AllocateThenFree}))
    gr4 = broken.first("GR-4")
    assert gr4.event == "step 1"
    assert "real blocks at [0, 1], window starts at 2" in gr4.messages[0]
    tr1 = broken.first("TR-1")
    assert tr1.event == "abort r0"
    assert "(group 1) is free" in tr1.messages[0]
    # The pool hands the freed blocks to r1 while r0's loads still write them; the copies land
    # in r1's blocks and r1's decode step reads r0's KV.
    taken = [b for b in broken.found if b.event == "step 2" and b.invariant_id == "TR-1"]
    assert any("is now held by ['r1']" in m for m in taken[0].messages)
    assert "DATA-1" in broken.broken()


def test_sliding_window_claim_loads_and_holds_the_window() -> None:
    """Scenario (#30166, the correct table in detail): the same claim; r0's sliding table is
    (null, null, b, b) and the loads write only its last two blocks."""
    cfg = config((full(), sliding(window=4)), [request("r0", P9)])
    s = Script(cfg)
    s.seed("r0", 8)
    s.arrive("r0")
    s.step()
    table = _sliding_blocks(s, "r0")
    assert table[:2] == (0, 0)
    assert all(table[2:])
    loaded = {
        (i.group_idx, i.block_id, i.end_token)
        for j in s.jobs("r0", LOAD)
        for i in s.engine.in_flight[j].job.items
        if i.group_idx == 1
    }
    assert loaded == {(1, table[2], 6), (1, table[3], 8)}
    s.run()
    assert s.broken() == set()


# --------------------------------------------------------------------------------------------
# #41830: sliding-window groups treated as full attention (hybrid manager off) -> start-up OOM


def _long_prefill(scheduler: type[Scheduler] | None) -> tuple[Script, int]:
    cfg = config((full(), sliding(window=4)), [request("r0", tuple(range(1, 13)))], budget=4)
    s = Script(cfg, scheduler_cls=scheduler)
    s.arrive("r0")
    peak = 0
    while not s.done():
        s.complete_all()
        s.step()
        peak = max(peak, sum(1 for b in _sliding_blocks(s, "r0") if b) if not s.done() else peak)
    return s, peak


def test_gr4_sliding_window_layers_are_not_managed_as_full_attention() -> None:
    """Scenario (#41830): a 12-token prompt in chunks of 4 on full attention + a sliding window
    of 4. The sliding group keeps at most the blocks of its window and the chunk being
    computed: while [8, 12) runs, tokens 5..11 (blocks 2..5), 4 real blocks. Managed as full
    attention it keeps every block, 7 at the decode step (cdiv(13, 2)), and its table holds
    real blocks before the window."""
    s, peak = _long_prefill(None)
    assert s.broken() == set()
    assert s.scheduled("r0") == [(0, 4), (4, 4), (8, 4), (12, 1)]
    assert peak == 4

    broken, peak = _long_prefill(_with_managers({GroupKind.SLIDING: FullAttentionManager}))
    assert peak == 7
    gr4 = broken.first("GR-4")
    assert gr4.event == "step 3"  # processed 8: the window starts at block 2
    assert "real blocks at [0, 1], window starts at 2" in gr4.messages[0]


def test_gpt_oss_sliding_layers_as_full_attention_double_the_kv_a_request_needs() -> None:
    """Scenario (#41830, at start-up): vLLM sizes the KV cache so one max_model_len request fits.
    gpt-oss-20b at 131072 tokens: 12 full-attention and 12 sliding-window (128) layers, block
    16, 32768-byte pages per layer. With the hybrid manager the sliding group needs its window
    plus one step's tokens; without it, the whole sequence like full attention."""
    lay = derive_layout(
        model_from_config(preset_config("gpt-oss-20b")),
        LayoutSettings(max_model_len=131072, platform="cuda-sm90"),
    )
    by_kind = {g.kind: g for g in lay.groups}
    sw, fa = by_kind[GroupKind.SLIDING], by_kind[GroupKind.FULL]
    assert (sw.block_size, sw.page_size_bytes, sw.num_layers, sw.sliding_window) == (
        16,
        32768,
        12,
        128,
    )
    assert (fa.block_size, fa.page_size_bytes, fa.num_layers) == (16, 32768, 12)

    def group_bytes(blocks: int, g: object) -> int:
        return blocks * g.page_size_bytes * g.num_layers  # type: ignore[attr-defined]

    max_len, batched = 131072, 8192
    # FullAttentionSpec.max_memory_usage_bytes: cdiv(131072, 16) = 8192 blocks
    # -> 8192 * 32768 * 12 = 3221225472 bytes (3 GiB).
    full_bytes = group_bytes(cdiv(max_len, fa.block_size), fa)
    assert full_bytes == 3221225472
    # SlidingWindowSpec: cdiv(min(128 - 1 + 8192, 131072), 16) + 1 = cdiv(8319, 16) + 1
    # = 520 + 1 = 521 blocks -> 521 * 32768 * 12 = 204865536 bytes.
    window_blocks = cdiv(min(sw.sliding_window - 1 + batched, max_len), sw.block_size) + 1
    hybrid = full_bytes + group_bytes(window_blocks, sw)
    assert hybrid == 3221225472 + 204865536 == 3426091008
    # Hybrid manager off: the sliding layers need the whole sequence too: 2 x 3 GiB.
    as_full = full_bytes + group_bytes(cdiv(max_len, sw.block_size), sw)
    assert as_full == 6442450944
    # A 4 GiB KV budget holds one max-length request with the hybrid manager, not without.
    budget = 4 * 1024**3
    assert hybrid <= budget < as_full
