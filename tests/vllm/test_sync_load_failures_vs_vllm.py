"""Why ``sync_load_max_bytes`` is refused: what vLLM 0.33 does with a failed SYNC load.

A sync claim (``get_num_new_matched_tokens`` answering ``(n, False)``) puts the request straight
into ``running`` with its claimed tokens counted as computed; the worker must move them in
``start_load_kv`` before the step's forward, and that forward reads them. If the copy fails, the
step's output is wrong unless the scheduler is told in time to throw it away and recompute.
vLLM 0.33 offers a worker three ways to say a load failed; these tests drive vLLM's own
``Scheduler`` (the differential harness's :class:`~diffharness.vllm_side.VllmSide`) through a
sync claim on the multi-group layouts and report the failure each way:

1. block ids (``invalid_block_ids``): ``_handle_invalid_blocks`` raises ``RuntimeError`` when
   there is more than one KV cache group (``v1/core/sched/scheduler.py:3712-3721``), inside
   ``update_from_output``: the engine dies;
2. the request id in ``failed_recving`` alone: ``_handle_failed_recving`` only acts on requests
   in ``WAITING_FOR_REMOTE_KVS`` (3688-3701), and a sync-loaded request is ``RUNNING``, so the
   report is ignored and the token sampled from the unloaded blocks is kept, under both failure
   policies (and behind ``MultiprocExecutor``, world size > 1, its ``KVOutputAggregator`` drops
   a ``failed_recving`` not paired with ``finished_recving`` before the scheduler sees it,
   ``distributed/kv_transfer/kv_connector/utils.py:180-183``);
3. ``failed_recving`` with ``finished_recving``: ``_update_from_kv_xfer_finished`` asserts that
   a finished-receiving request is waiting for its KV or already finished (3567-3578): an
   ``AssertionError`` for a running one.

With one KV cache group the block-level path exists (the contrast test): vLLM truncates the
request at the first invalid block and discards the step's sampled token.

End to end (``test_failed_sync_loads_are_read_as_if_loaded``): ``HybridKVConnector`` in the
in-process engine (:mod:`hybridkv.vllm.harness.inprocess`, vLLM's Scheduler and the runner's hook
order, every read content-checked) with its core switched to ``LoadMode.SYNC`` by the test (the
facade never selects it). Sync loads that succeed give 0 wrong reads on mamba + full and sliding +
full: the success path is sound. With every load failing, every request still finishes and the
forwards read the never-loaded blocks (wrong reads > 0): the failures reach the connector's own
core, and no channel above can pass them to vLLM. So hybridkv keeps every load async
(docs/howto/serve.md, docs/explanation/vllm-differential.md "Sync loads").
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

from diffharness.layouts import RECIPES, Layout
from diffharness.trace import (
    ClaimMode,
    ClaimScript,
    EngineSettings,
    FailurePolicy,
    KVReport,
    RequestScript,
    Trace,
)
from diffharness.vllm_side import VllmSide
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from hybridkv.connector import LoadMode
from hybridkv.errors import HybridKVConfigError
from hybridkv.vllm.config import parse_extra_config
from hybridkv.vllm.harness.chat import ChatTrace, run_trace
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU
from hybridkv.vllm.harness.engine_config import EngineSettings as InProcessSettings
from hybridkv.vllm.harness.inprocess import InProcessEngine

pytestmark = [pytest.mark.vllm, pytest.mark.known_vllm_behaviour]

MULTI_GROUP = pytest.mark.parametrize(
    "layout",
    [Layout.MAMBA_FULL, Layout.SLIDING_FULL, Layout.THREE_GROUPS],
    ids=lambda lay: lay.value,
)
# The in-process chat traces exist for these two (test_hybridkv_inprocess.py's CHAT).
CHAT_LAYOUTS = pytest.mark.parametrize(
    "layout", [Layout.MAMBA_FULL, Layout.SLIDING_FULL], ids=lambda lay: lay.value
)
PROMPT_UNITS = 3  # the sync claim takes 2 units, the forward computes the last one
CLAIM_UNITS = 2


def _sync_claim(layout: Layout, policy: FailurePolicy = FailurePolicy.RECOMPUTE) -> VllmSide:
    """A vLLM scheduler after step 1's ``schedule()``: r0 (3 units, 2 output tokens) was
    admitted with a sync claim of 2 units and runs its last prompt unit in this step."""
    recipe = RECIPES[layout]
    unit = recipe.unit
    budget = 4 * unit
    settings = EngineSettings(recipe.min_blocks(budget) + 8, budget, 2, failure_policy=policy)
    script = RequestScript(
        "r0",
        1,
        tuple(range(1000, 1000 + PROMPT_UNITS * unit)),
        2,
        claims=(ClaimScript(ClaimMode.SYNC, CLAIM_UNITS),),
    )
    side = VllmSide(Trace(layout, settings, (script,)))
    side.add(script)
    obs = side.schedule()
    r0 = side.requests["r0"]
    # The contract every test below starts from: a sync load, the request already running,
    # its claimed tokens counted as computed, the forward computing (and sampling) the rest.
    assert side._output.has_sync_kv_loads
    assert r0.status is RequestStatus.RUNNING
    claimed = CLAIM_UNITS * unit
    assert [(c.claimed, c.accepted) for c in obs.claims] == [(claimed, claimed)]
    assert obs.scheduled == (("r0", (PROMPT_UNITS - CLAIM_UNITS) * unit),)
    assert r0.num_computed_tokens == PROMPT_UNITS * unit
    return side


def _loaded_blocks(side: VllmSide, layout: Layout) -> frozenset[int]:
    """Every real block the sync load wrote (the claimed units, in every group)."""
    manager = side.scheduler.kv_cache_manager
    claimed = CLAIM_UNITS * RECIPES[layout].unit
    blocks = set()
    for table, group in zip(
        manager.get_block_ids("r0"), side.engine.kv_cache_config.kv_cache_groups, strict=True
    ):
        size = group.kv_cache_spec.block_size
        blocks.update(b for b in table[: -(-claimed // size)] if b != 0)
    return frozenset(blocks)


@MULTI_GROUP
def test_block_level_sync_failure_kills_the_engine_with_several_groups(layout: Layout) -> None:
    """Way 1: the failed sync load's blocks as ``invalid_block_ids`` -> ``RuntimeError`` out of
    ``update_from_output`` (``scheduler.py:3712``), not a per-request recovery."""
    side = _sync_claim(layout)
    blocks = _loaded_blocks(side, layout)
    assert len(side.engine.kv_cache_config.kv_cache_groups) > 1
    assert blocks
    with pytest.raises(RuntimeError, match="block-level load failures"):
        side.update(KVReport(invalid_blocks=(("r0", blocks),)))


@MULTI_GROUP
@pytest.mark.parametrize("policy", list(FailurePolicy), ids=lambda p: p.value)
def test_request_level_sync_failure_is_ignored_and_the_wrong_token_kept(
    layout: Layout, policy: FailurePolicy
) -> None:
    """Way 2: ``failed_recving={r0}`` alone. vLLM acts only on WAITING_FOR_REMOTE_KVS requests
    (``scheduler.py:3688-3701``): r0 keeps running with the claimed tokens counted as computed,
    and the token sampled by the forward that read the unloaded blocks is appended, under
    ``recompute`` and under ``fail`` alike; nothing asks the connector again."""
    side = _sync_claim(layout, policy)
    r0 = side.requests["r0"]
    computed = r0.num_computed_tokens
    side.update(KVReport(failed_recving=frozenset({"r0"})))
    assert r0.status is RequestStatus.RUNNING
    assert r0.num_computed_tokens == computed
    assert r0.num_output_tokens == 1  # the wrong forward's token, delivered
    assert "r0" not in side.scheduler.failed_recving_kv_req_ids
    side.schedule()  # the decode step reads the same unloaded blocks
    assert r0.num_computed_tokens == computed + 1


def test_the_multi_worker_aggregator_drops_an_unpaired_failed_recving() -> None:
    """Way 2 behind ``MultiprocExecutor``: its ``KVOutputAggregator`` forwards ``failed_recving``
    only for ids also in the aggregated ``finished_recving`` (``utils.py:180-183``), and a sync
    load never reports ``finished_recving``, so the scheduler does not even see the failure."""
    aggregator = KVOutputAggregator(expected_finished_count=1)
    worker_output = ModelRunnerOutput(
        req_ids=["r0"],
        req_id_to_index={"r0": 0},
        sampled_token_ids=[[7]],
        kv_connector_output=KVConnectorOutput(failed_recving={"r0"}),
    )
    merged = aggregator.aggregate([worker_output])
    assert merged is not None
    assert merged.kv_connector_output is not None
    assert not merged.kv_connector_output.failed_recving
    assert merged.sampled_token_ids == [[7]]
    # paired with finished_recving (an async load's report), the same id goes through
    paired = ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        kv_connector_output=KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"}),
    )
    through = aggregator.aggregate([paired])
    assert through is not None
    assert through.kv_connector_output is not None
    assert through.kv_connector_output.failed_recving == {"r1"}


@MULTI_GROUP
def test_sync_failure_reported_as_finished_recving_trips_an_assert(layout: Layout) -> None:
    """Way 3: ``finished_recving`` and ``failed_recving`` both name r0 (an async load's failure
    report). The failure is ignored as in way 2 (r0 is RUNNING), then
    ``_update_from_kv_xfer_finished`` asserts the request is finished (``scheduler.py:3577``)."""
    side = _sync_claim(layout)
    with pytest.raises(AssertionError):
        side.update(KVReport(finished_recving=frozenset({"r0"}), failed_recving=frozenset({"r0"})))


def test_one_group_has_the_block_level_path() -> None:
    """The contrast: on one full-attention group the same block-level report is a recovery.
    vLLM truncates r0 at its first invalid block (``scheduler.py:3662``), drops the token the
    wrong forward sampled (the affected ids skip the output loop, 2323-2325), and computes the
    truncated tokens again in the next step."""
    layout = Layout.FULL_ONLY
    side = _sync_claim(layout)
    r0 = side.requests["r0"]
    unit = RECIPES[layout].unit
    (table,) = side.scheduler.kv_cache_manager.get_block_ids("r0")
    second = frozenset({table[1]})  # the first claimed unit arrived, the second did not
    side.update(KVReport(invalid_blocks=(("r0", second),)))
    assert r0.status is RequestStatus.RUNNING
    assert r0.num_computed_tokens == 1 * unit
    assert r0.num_output_tokens == 0
    obs = side.schedule()
    assert obs.scheduled == (("r0", (PROMPT_UNITS - 1) * unit),)


# The chat traces of test_hybridkv_inprocess.py (GPU pool, trace, chunk = one block). mamba +
# full on 15 blocks, not that file's 16: vLLM 0.33 counts 5 blocks for this chat's sync hit of
# one unit (1,369 tokens, 640 claimed) and allocates 8 (kv_cache_manager.allocate_slots), so it
# raises "Cannot get 1 free blocks" when fewer are free; on 16 under async scheduling the other
# request's step in flight leaves 6. On 15 the hit comes when enough are free, under both loops.
CHAT = {
    Layout.MAMBA_FULL: (
        InProcessSettings(
            num_gpu_blocks=15, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
    ),
    Layout.SLIDING_FULL: (
        InProcessSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        32,
    ),
}


@CHAT_LAYOUTS
@pytest.mark.parametrize("failing", [False, True], ids=["loads-succeed", "every-load-fails"])
def test_failed_sync_loads_are_read_as_if_loaded(layout: Layout, failing: bool) -> None:
    """HybridKVConnector with its core in ``LoadMode.SYNC`` (set here; ``sync_load_max_bytes``
    refuses any non-zero value), the chat trace, loads failing before submission or never.

    Succeeding: sync steps ran, host tokens loaded, 0 wrong reads, nothing leaked. Failing: the
    core counts the failed load jobs, yet vLLM finishes every request and the forwards read
    blocks no byte was loaded into (the worker reports a sync job's failure only to its own
    core, ``completed_jobs``; the channels vLLM reads are the three refuted above)."""
    settings, trace, chunk = CHAT[layout]
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": chunk},
    )
    faults = FaultPlan(seed=7, load_rate=1.0, mid_copy=0.0) if failing else None
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings, transfer, HybridKVOnCPU(faults=faults)
    )
    core = engine.scheduler.connector.core
    core.load_mode = LoadMode.SYNC
    schedule, sync_steps = engine.scheduler.schedule, []

    def counted(*args: object, **kwargs: object) -> object:
        output = schedule(*args, **kwargs)
        sync_steps.append(output.has_sync_kv_loads)
        return output

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    report = run_trace(engine, trace)
    print(f"\n{layout.value} sync loads, failing={failing}: {report}")
    assert any(sync_steps)
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.external_hits == report.external_loaded > 0
    assert report.leaked_blocks == 0
    assert engine.adapter.pending() == 0
    stats = core.stats()
    if not failing:
        assert report.wrong_reads == 0
        assert stats.load_jobs_failed == 0
        assert report.transfers["bytes_loaded"] > 0
        return
    assert report.transfers["load_faults"] > 0
    assert stats.load_jobs_failed == report.transfers["load_faults"]
    assert report.transfers["bytes_loaded"] == 0
    assert report.wrong_reads > 0
    assert not engine.scheduler.failed_recving_kv_req_ids


@pytest.mark.parametrize("value", [1, 4096, 1 << 40])
def test_a_sync_load_budget_is_refused_with_vllms_reason(value: int) -> None:
    """Any non-zero budget stops start-up, one line naming the key, vLLM's file:line for the
    raise and the ignore shown above, and where the docs explain it; 0 is the default."""
    assert parse_extra_config({}).sync_load_max_bytes == 0
    assert parse_extra_config({"sync_load_max_bytes": 0}).sync_load_max_bytes == 0
    with pytest.raises(HybridKVConfigError) as caught:
        parse_extra_config({"sync_load_max_bytes": value})
    message = str(caught.value)
    assert caught.value.field == "kv_connector_extra_config.sync_load_max_bytes"
    assert "\n" not in message
    assert str(value) in message
    assert "scheduler.py:3712" in message
    assert "3688-3701" in message
    assert "vllm-differential.md" in message
