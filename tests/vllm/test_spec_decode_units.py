"""Decode units under speculative decoding (issue 28, item 3): stored once vLLM accepted them.

With MTP or EAGLE every decode step carries draft tokens (``scheduled_spec_decode_tokens``), so a
unit that ends inside the output ends on a draft, or on a placeholder under async scheduling.
On main (4fee86c) such a step stored nothing of its request, so a decode unit was never stored
under speculative decoding and a second turn recomputed the first turn's answer. Now the step is
held until its output is applied and stored up to vLLM's safe frontier,
``num_computed_tokens - num_output_placeholders`` (:mod:`hybridkv.vllm.deferred`).

Both engine loops (``HYBRIDKV_ENGINE_LOOP``) and both drafters the harness can configure: EAGLE
on the sliding window + full layout, MTP on the mamba (gated delta net, align) + full layout.
What the stand-in runner models: under async scheduling the ``AsyncScheduler`` schedules draft
placeholders every decode step and the stand-in drafter fills them with the tokens the sampler
picks, so every draft is accepted; under the synchronous loop the stand-in runner proposes no
drafts (``take_draft_token_ids``), so these tests hand vLLM's loop a proposal per step, as
``EngineCore.post_step`` does, and the runner answers as the GPU runner's rejection sampler
would (:class:`_Rejecting`), rejecting every draft of each step whose drafts reach a unit
end, on the attention layout. What it does not model: the KV a rejected draft leaves at its
slot is the true token's (the forward writes what the request's tokens imply), so a store that
read a rejected slot is caught by where it ends (past what vLLM had accepted), not by a content
check; and the mamba state after a rejection (the stand-in forward keeps one running state,
the GPU runner one per draft), so on the mamba layout every draft is accepted.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _explorer import eagle_speculative  # noqa: E402
from _invariants_on_vllm import InvariantChecker  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import (  # noqa: E402
    EngineSettings,
    default_async_scheduling,
)
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

EXTRA = {"host_memory_bytes": 256 << 20, "eviction_policy": "lru"}


def _eagle(config: dict[str, Any], k: int) -> dict[str, Any]:
    """EAGLE with ``k`` drafts (the explorer's draft config; never built)."""
    return eagle_speculative(config, "eagle", k)


def _model(layout: Layout) -> tuple[dict[str, Any], dict[str, Any]]:
    config = RECIPES[layout].config_json()
    if layout is Layout.MAMBA_FULL:
        config["num_nextn_predict_layers"] = 1  # SpeculativeConfig(method="mtp") reads it
        return config, {"method": "mtp", "num_speculative_tokens": 1}
    return config, _eagle(config, 2)


# Pools large enough that nothing is preempted, small enough that fillers push the first turn
# out of vLLM's prefix cache (so the second turn's hit is the host tier's).
SETTINGS = {
    Layout.SLIDING_FULL: {
        "num_gpu_blocks": 48,
        "max_model_len": 512,
        "block_size": 32,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
    },
    Layout.MAMBA_FULL: {
        "num_gpu_blocks": 24,
        "max_model_len": 4096,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 4096,
    },
}


class _Rejecting(InProcessEngine):
    """The synchronous loop's drafter and rejection sampler: after each step that sampled a
    token, ``k`` drafts are proposed (``take_draft_token_ids``). With ``reject``, a step
    whose drafts reach a unit end accepts none of them and returns only the corrected token,
    as the GPU runner's rejection sampler does when the first draft is wrong: the unit's last
    slot then holds a rejected draft's KV until vLLM recomputes it."""

    def __init__(self, *args: Any, k: int, reject: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.k, self.reject = k, reject
        self.units = self.scheduler.connector.core.geometry.distinct_units
        self.rejected = 0
        self._last: list[str] = []
        executor = self.loop.core.model_executor
        executor.take_draft_token_ids = self._take_drafts

    def _take_drafts(self) -> Any:
        from vllm.v1.outputs import DraftTokenIds

        ids = [rid for rid in self._last if rid in self.scheduler.requests]
        self._last = []
        if not ids:
            return None
        return DraftTokenIds(ids, [[7] * self.k for _ in ids])

    def _forward(self, output: Any) -> list[list[int]]:
        sampled = super()._forward(output)
        drafts = output.scheduled_spec_decode_tokens or {}
        self._last = [
            rid for rid, tokens in zip(output.num_scheduled_tokens, sampled, strict=True) if tokens
        ]
        for i, rid in enumerate(output.num_scheduled_tokens):
            if not self.reject or not drafts.get(rid) or not sampled[i]:
                continue
            c1 = self.requests[rid].num_computed_tokens
            c0 = c1 - output.num_scheduled_tokens[rid]
            if all((c0 + 1) // u == c1 // u for u in self.units):
                continue  # no unit ends on a draft of this step
            # No draft accepted: the one token sampled is the true token after the step's
            # first position (the stand-in forward wrote the true tokens at the draft
            # positions). The runner keeps only the tokens vLLM will hold.
            sampled[i] = sampled[i][:1]
            del self._runner_tokens[rid][c0 + 2 :]
            self.rejected += 1
        return sampled


def _engine(layout: Layout, async_scheduling: bool) -> InProcessEngine:
    config, speculative = _model(layout)
    settings = EngineSettings(
        **SETTINGS[layout], async_scheduling=async_scheduling, speculative=speculative
    )
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(EXTRA),
    )
    if async_scheduling:
        return InProcessEngine(config, settings, transfer, HybridKVOnCPU())
    k = int(speculative["num_speculative_tokens"])
    # Rejections on the attention layout only: the stand-in forward's mamba state does not roll
    # back to the accepted position (the GPU runner keeps a state per draft and copies the
    # accepted one, postprocess_mamba), so on the mamba layout every draft is accepted.
    reject = layout is Layout.SLIDING_FULL
    return _Rejecting(config, settings, transfer, HybridKVOnCPU(), k=k, reject=reject)


class _StoredEnds:
    """The store items ending past their request's prompt (decode units), and those ending
    past what was final when their metadata was built (wrapped on the connector only)."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.decode_items = 0
        self.past_final: list[tuple[str, int, int]] = []
        connector = engine.scheduler.connector
        build = connector.build_connector_meta
        requests = engine.scheduler.requests

        def recorded(scheduler_output: Any) -> Any:
            metadata = build(scheduler_output)
            drafts = scheduler_output.scheduled_spec_decode_tokens or {}
            for job in metadata.meta.store_jobs:
                rid = str(job.request_id)
                request = requests[rid]
                # What is final when this metadata is built (before num_computed_tokens moves
                # past this step): the safe frontier, then this step's own tokens that are
                # not drafts. No stored unit may end past it.
                own = scheduler_output.num_scheduled_tokens.get(rid, 0) - len(drafts.get(rid, ()))
                final = request.num_computed_tokens - request.num_output_placeholders + own
                for item in job.items:
                    if item.end_token > request.num_prompt_tokens:
                        self.decode_items += 1
                        if item.end_token > final:
                            self.past_final.append((rid, item.end_token, final))
            return metadata

        connector.build_connector_meta = recorded


def _finish(engine: InProcessEngine, checker: InvariantChecker) -> None:
    for _ in range(3000):
        if not engine.busy():
            return
        engine.step()
        checker.after_step()
    raise AssertionError("the run did not finish")


@pytest.mark.parametrize("layout", list(SETTINGS), ids=lambda lay: lay.value)
def test_a_second_turn_loads_the_first_turns_answer_stored_under_speculative_decoding(
    layout: Layout,
) -> None:
    """Turn 1 decodes past three unit ends with drafts in every decode step; fillers push it out
    of vLLM's prefix cache; turn 2 (turn 1's tokens and a question) loads from the host past
    turn 1's prompt, into its answer, every slot read content-checked."""
    async_scheduling = default_async_scheduling()
    engine = _engine(layout, async_scheduling)
    try:
        unit = max(engine.scheduler.connector.core.geometry.units)
        stored = _StoredEnds(engine)
        checker = InvariantChecker(engine)
        rng = random.Random(5)
        prompt = [rng.randint(3, 999) for _ in range(unit + unit // 2)]
        answer = 3 * unit + 3
        engine.add("a", prompt, answer)
        _finish(engine, checker)
        a_tokens = list(engine.requests["a"].all_token_ids)
        for i in range(3):
            filler = [rng.randint(3, 999) for _ in range(unit * 2 + 7)]
            engine.add(f"filler{i}", filler, 2)
            _finish(engine, checker)
        external_before = engine.tally.external_hits
        # The question is longer than a unit, so the unit after a's third ends inside b: the
        # proof EAGLE's block drop asks for (tests/vllm/test_eagle_claims.py).
        engine.add("b", a_tokens + [rng.randint(3, 999) for _ in range(unit + 9)], 2)
        _finish(engine, checker)
        b_hit = engine.tally.external_hits - external_before
        deferred = engine.scheduler.connector._deferred
        rejected = getattr(engine, "rejected", 0)
    finally:
        engine.close()
    print(
        f"\n{layout.value} {'async' if async_scheduling else 'sync'}: unit {unit}, a's prompt "
        f"{len(prompt)}, b's host hit {b_hit}, decode items stored {stored.decode_items}, "
        f"held steps stored {deferred.replayed}, dropped {deferred.dropped}, "
        f"rejected steps {rejected}, {engine.tally.checked} slots checked"
    )
    assert engine.tally.checked > 0
    assert engine.tally.wrong == 0, engine.tally.wrong_by
    assert engine.leaked_blocks() == 0
    assert not async_scheduling or rejected == 0
    if not async_scheduling and layout is Layout.SLIDING_FULL:
        assert rejected > 0  # the synchronous loop saw rejected drafts
    # Decode units were stored, each at or below the frontier vLLM had accepted.
    assert stored.decode_items > 0
    assert stored.past_final == []
    assert deferred.dropped == 0  # every held step stored, a rejected one up to the frontier
    # b loaded past a's prompt (1.5 units): every full unit of a but the last, whose proof
    # (the unit after it) b does not share: three units, two of them a's answer, stored under
    # speculative decoding.
    assert len(a_tokens) // unit == 4
    assert b_hit == 3 * unit
