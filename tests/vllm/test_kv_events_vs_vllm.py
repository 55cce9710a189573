"""``HybridKVConnector``'s KV cache events against the block hashes vLLM 0.33 itself computes
and publishes (issue 17, item 2k).

Routers and indexers read ``BlockStored``/``BlockRemoved`` (``vllm/distributed/kv_events.py``)
and index blocks by hash, per group, block by block, chained by ``parent_block_hash``: the shape
vLLM's block pool publishes for the GPU tier (``BlockPool._build_block_stored_event``, hashes
resolved to the group's block size by ``resolve_block_hashes``), and vLLM's OffloadingConnector
for the CPU tier in its self-describing mode (``offloading/events.py:287-350``: the chunk's
constituent block hashes, its parent, its tokens, the group's block size). So every
``BlockStored`` hybridkv publishes (medium ``CPU``) must carry, for its group, exactly the hashes
vLLM published for the same blocks on the GPU (medium ``GPU``), with the same parent, tokens and
block size; and those hashes must be the request's own ``request.block_hashes`` at each block's
end. Run with vLLM's KV events on (``EngineSettings.kv_events``), the events taken from the
scheduler's publisher (``scheduler.py:2621-2637``), on a chunk of two attention blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from test_hybridkv_inprocess import CHAT, _transfer  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from hybridkv.vllm.harness.chat import run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

# test_hybridkv_inprocess.py's chat with vLLM's KV events on: sliding + full on a chunk of two
# 32-token blocks (an event per block, several per chunk); mamba + full on one block.
CASES = {
    layout: (
        dataclasses.replace(settings, kv_events=True),
        trace,
        2 * chunk if layout is Layout.SLIDING_FULL else chunk,
    )
    for layout, (settings, trace, chunk) in CHAT.items()
}


def _published(engine: InProcessEngine) -> list[Any]:
    """Every event vLLM's scheduler publishes, in order (its publisher wrapped)."""
    found: list[Any] = []
    publisher = engine.scheduler.kv_event_publisher
    real = publisher.publish

    def publish(batch: Any) -> None:
        found.extend(batch.events)
        real(batch)

    publisher.publish = publish
    return found


def _request_hashes(engine: InProcessEngine) -> dict[tuple[int, Any], tuple[int, ...]]:
    """(group, hash at a block's end) -> the tokens of that block, from ``request.block_hashes``
    of every request (vLLM's hashes at ``hash_block_size``, read at each group block's end)."""
    found: dict[tuple[int, Any], tuple[int, ...]] = {}
    hbs = engine.hash_block_size
    for request in engine.requests.values():
        tokens = request.all_token_ids
        for g, group in enumerate(engine.kv_cache_config.kv_cache_groups):
            size = group.kv_cache_spec.block_size
            for end in range(size, len(request.block_hashes) * hbs + 1, size):
                block_hash = maybe_convert_block_hash(request.block_hashes[end // hbs - 1])
                found[(g, block_hash)] = tuple(tokens[end - size : end])
    return found


@pytest.mark.parametrize("layout", list(CASES), ids=lambda lay: lay.value)
def test_host_tier_events_name_vllms_own_block_hashes(layout: Layout) -> None:
    settings, trace, chunk = CASES[layout]
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings, _transfer(chunk), HybridKVOnCPU()
    )
    events = _published(engine)
    report = run_trace(engine, trace)
    assert report.wrong_reads == 0
    gpu: dict[tuple[int, Any], tuple[Any, int, tuple[int, ...]]] = {}
    for e in events:
        # vLLM's pool skips null and masked blocks (sliding windows) in block_hashes but not in
        # token_ids or the parent (block_pool.py:276-345): only gap-free events pair each hash
        # with its own tokens and parent.
        if isinstance(e, BlockStored) and e.medium == "GPU":
            if len(e.token_ids) != e.block_size * len(e.block_hashes):
                continue
            parent = e.parent_block_hash
            for i, block_hash in enumerate(e.block_hashes):
                tokens = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                gpu.setdefault((e.group_idx, block_hash), (parent, e.block_size, tokens))
                parent = block_hash
    ours = [e for e in events if e.medium == "CPU"]
    stored = [e for e in ours if isinstance(e, BlockStored)]
    assert stored
    requested = _request_hashes(engine)
    groups = engine.kv_cache_config.kv_cache_groups
    sizes = {g: group.kv_cache_spec.block_size for g, group in enumerate(groups)}
    matched = 0
    for e in stored:
        assert e.group_idx is not None
        assert e.block_size == sizes[e.group_idx], e
        assert len(e.token_ids) == e.block_size * len(e.block_hashes), e
        parent = e.parent_block_hash
        for i, block_hash in enumerate(e.block_hashes):
            tokens = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            assert requested[(e.group_idx, block_hash)] == tokens  # vLLM's hash of these tokens
            if (e.group_idx, block_hash) in gpu:  # vLLM cached this block on the GPU too
                assert gpu[(e.group_idx, block_hash)] == (parent, e.block_size, tokens), e
                matched += 1
            parent = block_hash
    assert matched > 0  # the comparison with vLLM's own GPU events ran
    # A removal names hashes a store named before, in the same group.
    named = {(e.group_idx, h) for e in stored for h in e.block_hashes}
    for e in ours:
        if isinstance(e, BlockRemoved):
            assert all((e.group_idx, h) in named for h in e.block_hashes), e
    engine.close()
