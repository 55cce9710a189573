"""Mamba prefill checkpoints under vLLM 0.33's real scheduler: every stored state is keyed by the
position it holds (MB-8), checked by the in-process engine's content tags on every state read and
by the spec's invariants on vLLM's and the connector's state after every step.

The model is Nemotron-H cut to ``M*M*`` (two Mamba-2 layers, two attention layers): Mamba-2
exports a prefill checkpoint on any platform (``num_prefill_checkpoint_blocks=1``), so on CPU
vLLM reserves the checkpoint block and the stand-in runner writes the state vLLM's
``compute_mamba_prefill_checkpoints`` names into it. Its block is 1,152 tokens. A
``num_nextn_predict_layers`` entry lets ``SpeculativeConfig(method="mtp")`` accept it (the
draft model is never built: only the scheduler side runs, and the runner proposes no drafts).

Request ``a`` computes its whole prompt (``3 * 1152 + tail`` tokens) in one chunk; two fillers
push its blocks out of the GPU prefix cache; request ``b`` shares ``a``'s first ``3 * 1152``
tokens and finds them in the host tier. Where the checkpoint sits:

- MTP (EAGLE's block drop), hash block = block: ``floor(N / 1152) * 1152 - 1152`` = 2,304, in
  slot 2, whose own end is 3,456. Before the fix the state after 2,304 tokens was stored under
  the key of 3,456 and ``b`` loaded it as such: wrong reads. Now it is stored under 2,304 and
  ``b`` loads exactly that.
- ``prefix_match_unit`` 128 (``cache_hit_alignment_tokens`` 128, partial hash hits), with or
  without MTP: the checkpoint is mid-block (3,712 or 3,584), not a unit end, so it is not
  stored; before the fix it went under 3,456.
- Control: no MTP, hash block = block: the checkpoint is 3,456 in slot 2, its own slot; the same
  3,456-token hit before and after the fix.

vLLM's lookahead hashes (the other input of the position) are off whenever a KV connector is
configured (``VllmConfig.num_hash_lookahead_tokens``); ``test_no_lookahead_with_a_connector``
pins that, and tests/vllm/test_checkpoint_rule_vs_vllm.py covers the rule with lookahead.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import InvariantChecker  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from spec.presets import tiny_config  # noqa: E402

BLOCK = 1152
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _config() -> dict[str, Any]:
    cfg = tiny_config("nemotron-h-8b", 4)
    cfg["hybrid_override_pattern"] = "M*M*"
    cfg["num_nextn_predict_layers"] = 1
    return cfg


def _engine(speculative: dict[str, Any] | None, prefix_match_unit: int | None) -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 256 << 20, "chunk_size": BLOCK},
    )
    settings = EngineSettings(
        num_gpu_blocks=12,
        max_model_len=4608,
        max_num_seqs=1,
        max_num_batched_tokens=4608,
        speculative=speculative,
        prefix_match_unit=prefix_match_unit,
    )
    return InProcessEngine(_config(), settings, transfer, HybridKVOnCPU())


def _run(engine: InProcessEngine, checker: InvariantChecker, rid: str, prompt: list[int]) -> None:
    """Run ``rid`` to its end, the spec's invariants (MB-8 among them) checked every step."""
    engine.add(rid, prompt, 3)
    for _ in range(200):
        if not engine.busy():
            return
        engine.step()
        checker.after_step()
    raise AssertionError(f"{rid} did not finish")


def _share_through_the_host(engine: InProcessEngine, tail: int) -> tuple[int, int, int]:
    """``a`` then two fillers then ``b`` (module docstring); returns ``(external hits of b,
    wrong reads, states checked)``."""
    rng = random.Random(5)
    checker = InvariantChecker(engine)
    shared = [rng.randint(3, 999) for _ in range(3 * BLOCK)]
    _run(engine, checker, "a", shared + [rng.randint(3, 999) for _ in range(tail)])
    for i in range(2):
        filler = [rng.randint(3, 999) for _ in range(3 * BLOCK + 100)]
        _run(engine, checker, f"filler{i}", filler)
    hits_before = engine.tally.external_hits
    assert engine.tally.gpu_hits == 0
    _run(engine, checker, "b", shared + [rng.randint(3, 999) for _ in range(200)])
    assert checker.evaluated["MB-8"] == checker.steps > 0
    assert engine.tally.gpu_hits == 0  # the fillers evicted a's blocks: b can only hit the host
    return engine.tally.external_hits - hits_before, engine.tally.wrong, engine.tally.checked


CASES = {
    # (speculative, prefix_match_unit, a's tail, b's host hit, the mamba group's CheckpointRule:
    # alignment, hash block, cache-hit alignment, EAGLE drop, lookahead)
    "mtp": (MTP, None, 100, 2 * BLOCK, (1, BLOCK, BLOCK, True, 0)),
    "mtp-hash128": (MTP, 128, 300, 0, (1, 128, 128, True, 0)),
    "hash128": (None, 128, 300, 0, (1, 128, 128, False, 0)),
    "control": (None, None, 100, 3 * BLOCK, (1, BLOCK, BLOCK, False, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_state_is_stored_under_its_own_position(case: str) -> None:
    speculative, unit, tail, expected_hit, _rule = CASES[case]
    engine = _engine(speculative, unit)
    try:
        assert engine.block_size == BLOCK
        hit, wrong, checked = _share_through_the_host(engine, tail)
    finally:
        engine.close()
    print(f"\n{case}: b's host hit {hit}, {checked} slots checked, {wrong} wrong")
    assert checked > 0
    assert wrong == 0
    assert hit == expected_hit


@pytest.mark.parametrize("case", list(CASES))
def test_the_connector_reads_vllms_checkpoint_rule(case: str) -> None:
    """Per group: the mamba group's rule as vLLM resolves it (Mamba-2's alignment is 1), the
    attention group's none."""
    from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule

    speculative, unit, _tail, _hit, fields = CASES[case]
    engine = _engine(speculative, unit)
    try:
        core = engine.scheduler.connector.core
        assert core.geometry.checkpoints == (CheckpointRule(*fields), NO_CHECKPOINTS)
    finally:
        engine.close()


def test_no_lookahead_with_a_connector() -> None:
    """vLLM turns lookahead hashes off when a KV connector is configured, MTP or not: the
    checkpoint position the connector sees never moves with them."""
    engine = _engine(MTP, None)
    try:
        assert engine.vllm_config.num_hash_lookahead_tokens == 0
        assert engine.scheduler.use_eagle_block_drop
    finally:
        engine.close()


def test_a_step_with_draft_tokens_stores_nothing_of_its_request() -> None:
    """Draft tokens (MTP/EAGLE) in a decode step that crosses a unit end.

    ``a``'s prompt ends two tokens short of a block (2 * 1152 - 2), so after its prefill the
    decode step with two drafts that vLLM's loop schedules computes ``[2302, 2305)``: the unit
    end 2,304 lies inside, on a draft token. vLLM has not hashed that block (its tokens are not
    known: ``block_hashes`` covers real tokens only), may reject the draft, and the mamba
    state of a draft step is not the running state at a unit end. Before the fix the
    connector asked for that block's key and ``schedule()`` raised IndexError; now the request
    stores nothing in that step's metadata (its prompt's units were stored by the prefill): the
    step waits for vLLM's verdict on its drafts (hybridkv.vllm.deferred,
    tests/vllm/test_spec_decode_units.py).

    The drafts come as vLLM's loop brings them: under sync scheduling ``EngineCore.post_step``
    hands the drafter's proposal (``take_draft_token_ids``; the stand-in runner proposes none,
    so this test's drafter proposes two, once) to ``update_draft_token_ids`` before the next
    ``schedule()``; under async scheduling the ``AsyncScheduler`` schedules two draft
    placeholders right after the prefill, before its sampled token is applied.
    """
    from vllm.v1.outputs import DraftTokenIds

    from hybridkv.vllm.connector import HybridKVMetadata

    engine = _engine({"method": "mtp", "num_speculative_tokens": 2}, None)
    try:
        scheduler = engine.scheduler
        seen: list[tuple[int, Any]] = []  # ("a"'s computed tokens before it, output)
        schedule = scheduler.schedule

        def recorded(*args: Any, **kwargs: Any) -> Any:
            request = scheduler.requests.get("a")
            before = -1 if request is None else request.num_computed_tokens
            output = schedule(*args, **kwargs)
            seen.append((before, output))
            return output

        scheduler.schedule = recorded
        proposals = [DraftTokenIds(["a"], [[5, 6]])]
        executor = engine.loop.core.model_executor
        executor.take_draft_token_ids = lambda: proposals.pop() if proposals else None
        rng = random.Random(11)
        engine.add("a", [rng.randint(3, 999) for _ in range(2 * BLOCK - 2)], 8)
        drafted = []
        for _ in range(20):  # the prefill, its store, then the step with drafts
            engine.step()
            drafted = [(c, o) for c, o in seen if o.scheduled_spec_decode_tokens.get("a")]
            if drafted:
                break
        assert drafted
        assert any(o.kv_connector_metadata.meta.store_jobs for _, o in seen)  # the prefill's
        computed, output = drafted[0]
        assert computed == 2 * BLOCK - 2
        assert len(output.scheduled_spec_decode_tokens["a"]) == 2
        assert output.num_scheduled_tokens["a"] == 3  # crosses 2,304 on a draft token
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, HybridKVMetadata)
        assert metadata.meta.store_jobs == ()
    finally:
        engine.close()
