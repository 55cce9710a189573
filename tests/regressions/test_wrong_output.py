"""Wrong output: KV or recurrent state that is not what the reading request's tokens produce.

Scenario: each test below replays one field bug as a short script of engine events (the
request arrivals with their prompts, the steps, the transfer jobs' outcomes, a prefix-cache
reset) on the whole formal engine: scheduler, reference connector, worker, host store and
the content model. The correct model handles it (no invariant breaks, and the claims, the
tokens, the statuses and the data read are the ones derived by hand in the comments); the
broken variant that reintroduces the bug is caught, and the test names the invariant.

The content model (``spec.system.content``) is what makes "wrong output" observable: the
engine's sampler does not depend on KV bytes, so a garbled answer shows up as DATA-1 (a forward
read a block that does not hold the true KV or state of its tokens), not as other tokens.

Common geometry, unless a test says otherwise: full attention and mamba (align mode), block 2,
hash block 2, offload chunk 2, so every claim ends on an even token and a mamba state exists
only at even positions where a step ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from regression_script import (
    MAMBA,
    STORE,
    Script,
    config,
    expected_token,
    full,
    mamba,
    request,
)

from spec.connector import ReferenceConnector
from spec.connector.geometry import Geometry, UnitRef
from spec.connector.stores import store_items
from spec.connector_api import BlockTable, Claim, RequestView, TransferItem
from spec.scheduler.scheduler import Scheduler
from spec.store import LookupResult
from spec.system.content import Content, Garbage

FULL_MAMBA = (full(), mamba())
P9 = tuple(range(1, 10))  # 9 prompt tokens: the claimable prefix is at most 8


def _host_states(s: Script) -> list[tuple[int, ...] | str]:
    """The recurrent states the host holds (prefix each was computed from), sorted."""
    found: list[tuple[int, ...] | str] = []
    for value in s.engine.host.values():
        if isinstance(value, Garbage):
            found.append(f"garbage({value.reason})")
        elif value.group_idx == 1:
            found.append(value.prefix)
    return sorted(found, key=str)


# --------------------------------------------------------------------------------------------
# LMCache #2863 / #2845: attention KV restored without the mamba state (~40% garbled outputs)


class _MambaAlwaysHits:
    """The host store as an attention-only lookup sees it: every mamba key "hits"."""

    def __init__(self, store: object, geometry: Geometry) -> None:
        self._store, self._geometry = store, geometry

    def status(self, key: bytes) -> LookupResult:
        group = int.from_bytes(key[-4:], "big")
        if self._geometry.kinds[group] is MAMBA:
            return LookupResult.HIT
        return self._store.status(key)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


class AttentionOnlyConnector(ReferenceConnector):
    """LMCache #2863/#2845: looks up and loads the attention groups; the state is ignored."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        store = self.store
        self.store = _MambaAlwaysHits(store, self.geometry)  # type: ignore[assignment]
        try:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            self.store = store

    def _load_items(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        items = super()._load_items(*args, **kwargs)
        return tuple(i for i in items if self.geometry.kinds[i.group_idx] is not MAMBA)


def _attention_without_state(connector: type[ReferenceConnector] | None) -> Script:
    s = Script(config(FULL_MAMBA, [request("r0", P9)]), connector_cls=connector)
    # The host tier holds attention KV for the first 8 tokens but the state only at 4 (stores of
    # the states at 6 and 8 never happened, e.g. their steps did not end there).
    s.seed("r0", 8, groups=(0,))
    s.seed("r0", 4, groups=(1,))
    s.arrive("r0")
    s.step()  # step 1: r0 claims from the host and waits for its load
    s.run()  # every job completes; steps until r0 finished
    return s


@pytest.mark.mutation("MB-1", "DATA-1")
def test_attention_kv_is_never_restored_without_its_mamba_state() -> None:
    """Scenario (LMCache #2863/#2845): the host holds a prompt's attention KV to token 8 and its
    mamba state at 4 only. The claim must stop at 4, where every group, the state included,
    can be restored; a connector that restores attention alone resumes at 8 from a state slot
    nothing wrote, and the answer is garbage."""
    s = _attention_without_state(None)
    assert s.broken() == set()
    # Claim: 8 needs the state at 8, 6 the state at 6 (both absent); 4 has attention 2, 4 and
    # the state at 4.
    [claim] = s.claims("r0")
    assert (claim.num_computed_tokens, claim.accepted) == (0, 4)
    # Then [4, 8) (the mamba split stops at the last block boundary before the last token,
    # 8) and [8, 9), which samples; one decode step samples the second token.
    assert s.scheduled("r0") == [(4, 4), (8, 1), (9, 1)]
    assert s.tokens("r0") == (expected_token("r0", 9), expected_token("r0", 10))
    assert s.status("r0") == "FINISHED_LENGTH"
    # The first forward (step 3: step 2 only folds the load's report) read the loaded
    # blocks: the attention of tokens 0..3 and the state after exactly 4 tokens.
    state = [r for r in s.reads("r0", 3) if r.what == "state"]
    assert [r.value for r in state] == [Content(1, P9[:4])]

    broken = _attention_without_state(AttentionOnlyConnector)
    assert broken.claims("r0")[0].accepted == 8  # attention alone reaches 8
    assert {"MB-1", "DATA-1"} <= broken.broken()
    assert broken.first("MB-1").event == "step 1"  # the load is built without the state
    data = broken.first("DATA-1")
    assert "group 1, the state after 8 tokens" in data.messages[0]
    assert "garbage(unwritten)" in data.messages[0]


# --------------------------------------------------------------------------------------------
# vLLM #51094: silently wrong output at exact chunk boundaries


class WholePromptClaim(ReferenceConnector):
    """Claims every prompt token when the prompt ends exactly on a chunk boundary (the claim
    limit is taken as ``num_tokens`` instead of ``num_tokens - 1``)."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        longer = replace(request, token_ids=(*request.token_ids, 0))
        return super().get_num_new_matched_tokens(longer, num_computed_tokens)


def _prompt_on_a_boundary(connector: type[ReferenceConnector] | None) -> Script:
    p8 = tuple(range(1, 9))
    s = Script(config(FULL_MAMBA, [request("r0", p8)]), connector_cls=connector)
    s.seed("r0", 8)  # the whole 8-token prompt, every group, is in the host
    s.arrive("r0")
    s.step()
    s.run()
    return s


@pytest.mark.mutation("MB-3", "DATA-1")
def test_full_prompt_hit_on_a_chunk_boundary_leaves_the_last_token_to_compute() -> None:
    """Scenario (#51094): an 8-token prompt ends exactly on a chunk boundary and the host holds
    all of it. A claim of all 8 tokens leaves nothing to compute; the scheduler then recomputes
    the last token (``num_computed_tokens = num_tokens - 1``) from a state taken AFTER it. The
    claim must stop one unit short, at 6, and compute [6, 8)."""
    s = _prompt_on_a_boundary(None)
    assert s.broken() == set()
    [claim] = s.claims("r0")
    assert claim.accepted == 6  # the largest even end <= 8 - 1
    assert s.scheduled("r0") == [(6, 2), (8, 1)]
    assert s.tokens("r0") == (expected_token("r0", 8), expected_token("r0", 9))

    broken = _prompt_on_a_boundary(WholePromptClaim)
    assert broken.claims("r0")[0].accepted == 8
    # The load ends at the last token (MB-3); the promoted request recomputes token 7 and its
    # forward reads the state after 8 tokens where it needs the state after 7 (DATA-1).
    assert broken.scheduled("r0")[0] == (7, 1)
    assert {"MB-3", "DATA-1"} <= broken.broken()
    assert "spans [0, 8) of 8 tokens" in broken.first("MB-3").messages[0]
    message = broken.first("DATA-1").messages[0]
    assert "the state after 7 tokens" in message
    assert "holding g1:[1, 2, 3, 4, 5, 6, 7, 8]" in message


# --------------------------------------------------------------------------------------------
# vLLM #49964: under decode context parallelism, keys mapped to the wrong mamba state block


class DcpScaledGeometry(Geometry):
    """Finds a mamba unit's table slot with the DCP-scaled block (2 x the mamba block), as an
    attention group's slot is found under decode context parallelism of 2."""

    def unit(self, group_idx: int, index: int) -> UnitRef:
        ref = super().unit(group_idx, index)
        if self.kinds[group_idx] is not MAMBA:
            return ref
        block = self.planner.groups[group_idx][1]
        return replace(ref, block_index=ref.end // (2 * block) - 1)


class DcpStateStores(ReferenceConnector):
    """#49964: stores the mamba state of a unit from the slot the DCP-scaled geometry names."""

    def _store_items(
        self, hashes: Sequence[bytes], block_ids: BlockTable, start: int, end: int
    ) -> tuple[TransferItem, ...]:
        g = self.geometry
        wrong = DcpScaledGeometry(g.planner, g.kinds, g.reaches)
        return store_items(wrong, hashes, block_ids, start, end)


def _donor_then_reader(
    connector: type[ReferenceConnector] | None, groups: tuple = FULL_MAMBA
) -> tuple[Script, list[tuple[int, ...] | str]]:
    """r0 (5 tokens) computes in steps of 2 and stores; the GPU prefix cache is reset; r1
    shares r0's first 4 tokens and finds them in the host."""
    r0 = request("r0", (1, 2, 3, 4, 5), max_tokens=1)
    r1 = request("r1", (1, 2, 3, 4, 7, 8, 9), max_tokens=1)
    s = Script(config(groups, [r0, r1], budget=2), connector_cls=connector)
    s.arrive("r0")
    s.run()  # r0: [0, 2), [2, 4), [4, 5); each step's store completes
    stored = _host_states(s)
    assert s.reset_prefix_cache()  # r0's GPU blocks lose their cache entries; the host keeps
    s.arrive("r1")
    s.run()
    return s, stored


@pytest.mark.mutation("DATA-1")
def test_mamba_state_is_stored_from_the_block_of_its_own_position() -> None:
    """Scenario (#49964): r0's steps end at 2 and 4, leaving the state after 2 in slot 0 and
    after 4 in slot 1 of its mamba table. The state stored under the key of position 4 must come
    from slot 1. With the slot computed from a DCP-scaled block (4 // 4 - 1 = slot 0) the host
    gets the state after 2 under the key of 4, and r1, which loads it, computes on a wrong
    state."""
    s, stored = _donor_then_reader(None)
    assert s.broken() == set()
    assert stored == [(1, 2), (1, 2, 3, 4)]
    [claim] = s.claims("r1")
    assert claim.accepted == 4  # attention 2, 4 and the state at 4; 6 is not stored
    assert s.scheduled("r1") == [(4, 2), (6, 1)]
    assert s.tokens("r1") == (expected_token("r1", 7),)

    broken, stored = _donor_then_reader(DcpStateStores)
    # Both stored states are the one after 2 tokens (slot -1 of a 1-slot table is slot 0 at
    # position 2, by luck right; slot 0 at position 4, wrong).
    assert stored == [(1, 2), (1, 2)]
    # No connector invariant sees a store read from the wrong slot (MB-2 checks the unit end);
    # the content model does, when r1 reads the state.
    assert broken.broken() == {"DATA-1"}
    assert (
        "the state after 4 tokens of [1, 2, 3, 4]) holding g1:[1, 2]"
        in (broken.first("DATA-1").messages[0])
    )


# --------------------------------------------------------------------------------------------
# LMCache #4984 / #5004: a speculative-decoding scratch block stored as if it were the state


class ScratchAsState(ReferenceConnector):
    """Stores a mamba unit from the table's last real block, which with speculative decoding is
    a scratch block, not the state at the unit's end."""

    def _store_items(
        self, hashes: Sequence[bytes], block_ids: BlockTable, start: int, end: int
    ) -> tuple[TransferItem, ...]:
        items = super()._store_items(hashes, block_ids, start, end)
        return tuple(self._from_last_block(item, block_ids) for item in items)

    def _from_last_block(self, item: TransferItem, block_ids: BlockTable) -> TransferItem:
        if self.geometry.kinds[item.group_idx] is not MAMBA:
            return item
        last = [b for b in block_ids[item.group_idx] if b][-1]
        return replace(item, block_id=last)


@pytest.mark.mutation("DATA-1")
def test_speculative_scratch_block_is_never_stored_as_a_state() -> None:
    """Scenario (LMCache #4984/#5004): the mamba group keeps one speculative scratch block after
    its state (``num_speculative_blocks=1``). r0's states after 2 and 4 tokens must be stored
    from their state slots; a store that takes the table's last block stores the scratch block
    (which no forward wrote), and r1 loads garbage as its state."""
    groups = (full(), mamba(speculative=1))
    s, stored = _donor_then_reader(None, groups)
    assert s.broken() == set()
    assert stored == [(1, 2), (1, 2, 3, 4)]
    assert s.claims("r1")[0].accepted == 4
    assert s.tokens("r1") == (expected_token("r1", 7),)

    broken, stored = _donor_then_reader(ScratchAsState, groups)
    assert stored == ["garbage(unwritten)", "garbage(unwritten)"]
    assert broken.broken() == {"DATA-1"}
    assert "holding garbage(unwritten)" in broken.first("DATA-1").messages[0]


# --------------------------------------------------------------------------------------------
# SGLang #39830: host-tier hits on a GDN model return wrong answers


class UnpinnedStoreSources(ReferenceConnector):
    """Does not hold the GPU blocks an in-flight store reads: the managers free a running
    request's older mamba state while the store still copies it."""

    def bind_gpu_block_pool(self, pool: object) -> None:
        return None

    def held_blocks(self) -> tuple:  # type: ignore[type-arg]
        return ()


def _slow_store(connector: type[ReferenceConnector] | None) -> Script:
    r0 = request("r0", (1, 2, 3, 4, 5, 6, 7), max_tokens=1)
    r1 = request("r1", (1, 2, 9, 9, 9), max_tokens=1)
    # 7 usable blocks: r0 needs 4 attention blocks and up to 2 live mamba states, so a freed
    # block is the next one handed out.
    s = Script(config(FULL_MAMBA, [r0, r1], budget=2, num_blocks=8), connector_cls=connector)
    s.arrive("r0")
    s.step()  # [0, 2): the store of the units ending at 2 (attention block, state block) starts
    [slow] = s.jobs("r0", STORE)
    for _ in range(4):  # [2, 4), [4, 6), [6, 7) and the step that finishes r0
        s.step()
        for job in s.jobs("r0", STORE):
            if job != slow:
                s.engine.complete(job, True)  # the later stores are fast
    s.complete("r0", STORE)  # the slow store finally copies its blocks
    s.run()
    assert s.reset_prefix_cache()
    s.arrive("r1")  # shares r0's first 2 tokens: a host hit
    s.run()
    return s


@pytest.mark.mutation("TR-1", "DATA-1")
def test_host_hit_reads_what_the_store_copied_before_its_block_was_reused() -> None:
    """Scenario (SGLang #39830): r0's store of its state after 2 tokens is slow. Align mode keeps
    only the latest states, so two steps later r0 drops that state block; with the pool tight,
    the next allocation hands the same block out again and r0 writes its state after 7 tokens
    into it. The store must still copy the state after 2 (the connector holds its source
    blocks until it reports); if it does not, the host holds the wrong state under the key of
    position 2 and r1's host hit computes on it."""
    s = _slow_store(None)
    assert s.broken() == set()
    assert (1, 2) in _host_states(s)
    [claim] = s.claims("r1")
    assert claim.accepted == 2
    assert s.tokens("r1") == (expected_token("r1", 5),)

    broken = _slow_store(UnpinnedStoreSources)
    # TR-1 at the step that frees the block under the store; the host then holds r0's state
    # after 7 tokens under the key of 2, and r1 reads it.
    tr1 = broken.first("TR-1")
    assert tr1.event == "step 3"
    assert "store job 1 of r0: block 2 (group 1) is free" in tr1.messages[0]
    assert (1, 2) not in _host_states(broken)
    assert (1, 2, 3, 4, 5, 6, 7) in _host_states(broken)
    assert "DATA-1" in broken.broken()
    assert (
        "the state after 2 tokens of [1, 2]) holding g1:[1, 2, 3, 4, 5, 6, 7]"
        in (broken.first("DATA-1").messages[0])
    )


# --------------------------------------------------------------------------------------------
# LMCache's align-mode rule (chunk a multiple of N, --max-num-batched-tokens in [N, 2N)):
# align mode snapshots the state only at a step's end, so prefill chunks must end on blocks


class NoMambaSplit(Scheduler):
    """Schedules prefill chunks of any length: no mamba block-aligned split."""

    def _split(self, r: object, n: int, start: int) -> int:
        return n


def _unaligned_prefill(
    scheduler: type[Scheduler] | None,
) -> tuple[Script, list[tuple[int, ...] | str]]:
    r0 = request("r0", P9, max_tokens=1)
    r1 = request("r1", (1, 2, 3, 4, 5, 6, 50, 51, 52), max_tokens=1)
    s = Script(config(FULL_MAMBA, [r0, r1], budget=5), scheduler_cls=scheduler)
    s.arrive("r0")
    s.run()
    stored = _host_states(s)
    assert s.reset_prefix_cache()
    s.arrive("r1")  # shares r0's first 6 tokens
    s.run()
    return s, stored


def test_prefill_chunks_end_where_a_state_can_be_stored() -> None:
    """Scenario (LMCache align-mode rule; vLLM's ``_mamba_block_aligned_split``): with a budget
    of 5, r0's 9-token prefill must run as [0, 4), [4, 8), [8, 9), so the states after 4 and 8
    exist and are stored. Unsplit chunks [0, 5), [5, 9) leave the state after 5 in the slot of
    position 6. The connector stores only the states a step writes, each under the position it
    holds (MB-8): the step [5, 9) writes the state after 9 alone, so nothing of r0's mamba
    group is stored (before MB-8 the store of unit 6 copied the state after 5 and r1 loaded it
    as the state after 6: DATA-1). The split scheduler loses hits, never content."""
    s, stored = _unaligned_prefill(None)
    assert s.broken() == set()
    assert s.scheduled("r0") == [(0, 4), (4, 4), (8, 1)]
    assert stored == [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]
    # r1 needs the state at 6 to claim 6: absent, so it claims 4 and computes the rest.
    assert s.claims("r1")[0].accepted == 4
    assert s.scheduled("r1") == [(4, 4), (8, 1)]

    unsplit, stored = _unaligned_prefill(NoMambaSplit)
    assert unsplit.scheduled("r0") == [(0, 5), (5, 4)]
    assert stored == []  # no step ends on a unit: no state is stored, none under a wrong key
    assert unsplit.claims("r1")[0].accepted == 0
    assert unsplit.broken() == set()
