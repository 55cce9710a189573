"""Bad input to the connector core, the tracker, the worker and the stack builder.

Each refusal is a :class:`HybridKVConfigError` naming the field, and changes nothing: the core's
snapshot (host store included), the worker's jobs in flight and the engine's submissions, the
GPU and host bytes are what they were before the call.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_transfer_worker import (
    BLOCK,
    FOLLOW,
    LAYOUTS,
    PROMPT,
    full_sliding_case,
    make,
    randomize,
    store_a,
    view,
)

from hybridkv.cache_layouts import hybrid_overlay_case
from hybridkv.canonical import CacheGroupSpec
from hybridkv.connector import (
    Claim,
    ClaimKind,
    ConnectorCore,
    ConnectorMeta,
    JobId,
    JobResult,
    JobTracker,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
    TransferItem,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.stack import build_cpu_stack
from hybridkv.connector.worker import TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA


def _planner() -> HybridOffloadPlanner:
    return HybridOffloadPlanner(((FULL, 2), (MAMBA, 2)), 2, 2, 64)


def _refused(field: str, call: Any, *args: Any, **kwargs: Any) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        call(*args, **kwargs)
    assert caught.value.field == field, str(caught.value)
    return caught.value


# --------------------------------------------------------------------- the core


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("group_kinds", {"group_kinds": (MAMBA, FULL)}),
        ("group_kinds", {"group_kinds": (FULL,)}),
        ("hash_block_size", {"hash_block_size": 1}),
        ("chunk_size", {"chunk_size": 4}),
        ("sliding_windows", {"sliding_windows": (3,)}),
        ("sliding_windows", {"sliding_windows": (-1, 0)}),
        ("load_mode", {"load_mode": "async"}),
        ("store", {"store": object()}),
        ("planner", {"planner": object()}),
    ],
)
def test_the_core_refuses_a_bad_configuration(field: str, kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "planner": _planner(),
        "store": HostStore(4),
        "group_kinds": (FULL, MAMBA),
        "hash_block_size": 2,
        "chunk_size": 2,
    }
    # Split a copy: the parametrized dict is shared by every run of this case in one process
    # (mutmut's runs, pytest-repeat), and popping from it left the second run without its
    # bad value.
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("sliding_windows", "load_mode") if k in kwargs}
    args.update(kwargs)
    _refused(field, ConnectorCore, *args.values(), **options)


def _core() -> ConnectorCore:
    return ConnectorCore(_planner(), HostStore(8), (FULL, MAMBA), 2, 2)


def test_the_core_refuses_bad_calls_and_changes_nothing() -> None:
    core = _core()
    a = view("A", range(1, 9))
    core.build_connector_meta(StepView(1, (ScheduledRequest(a, ((1, 2, 3), (0, 0, 4)), 0, 6),)))
    before = core.snapshot()
    _refused("num_computed_tokens", core.get_num_new_matched_tokens, a, 1)
    _refused("num_computed_tokens", core.get_num_new_matched_tokens, a, -2)
    _refused("num_computed_tokens", core.get_num_new_matched_tokens, a, True)
    core.build_connector_meta(StepView(2, ()))  # clears the asked positions
    after_meta = core.snapshot()
    _refused("num_external_tokens", core.update_state_after_alloc, a, ((5,), (6,)), 2)
    _refused("completed_jobs", core.update_connector_output, _output(JobId(77)))
    _refused("tokens", core.get_num_new_matched_tokens, view("T", (1, -5, 3)), 0)
    salted = RequestView(RequestId("S"), (1, 2, 3), 3, "")
    _refused("cache_salt", core.get_num_new_matched_tokens, salted, 0)
    _refused("request_id", core.invalid_blocks, RequestId("nobody"))
    assert core.snapshot() == after_meta
    assert before["jobs"] == after_meta["jobs"]


def test_a_load_in_flight_refuses_a_second_allocation() -> None:
    core = _core()
    tokens = tuple(range(1, 9))
    core.seed(view("A", tokens), 6)
    b = view("B", tokens)
    claim = core.get_num_new_matched_tokens(b, 0)
    assert claim == Claim(ClaimKind.ASYNC, 6)
    core.update_state_after_alloc(b, ((1, 2, 3), (0, 0, 4)), 6)
    assert core.get_num_new_matched_tokens(b, 0).kind is ClaimKind.DEFER
    before = core.snapshot()
    _refused("request", core.update_state_after_alloc, b, ((1, 2, 3), (0, 0, 4)), 6)
    assert core.snapshot() == before


def test_binding_a_pool_while_stores_are_in_flight_is_refused() -> None:
    core = _core()
    a = view("A", range(1, 9))
    core.build_connector_meta(StepView(1, (ScheduledRequest(a, ((1, 2, 3), (0, 0, 4)), 0, 6),)))

    class Pool:
        def touch(self, blocks: Any) -> None: ...

        def free_blocks(self, blocks: Any) -> None: ...

    _refused("pool", core.bind_gpu_block_pool, Pool())
    assert core.held_blocks() == ()


def test_the_values_refuse_contradictions() -> None:
    _refused("num_tokens", Claim, ClaimKind.ASYNC, 0)
    _refused("num_tokens", Claim, ClaimKind.NONE, 3)
    _refused("failed_recving", KVConnectorOutput, frozenset(), frozenset({RequestId("x")}))


def test_a_claim_of_an_unknown_kind_is_refused_by_name() -> None:
    """A kind that is no :class:`ClaimKind` (its value string, or another module's enum) is a
    config error naming ``kind``. Before the claim table, a positive count crashed with
    ``AttributeError`` (the message read ``kind.value``) and a zero count built a claim whose
    ``as_vllm()`` answered ``(0, False)`` for a kind vLLM never defined."""
    _refused("kind", Claim, "sync", 3)
    _refused("kind", Claim, "defer", 0)


def test_each_claim_kind_in_vllm_s_words() -> None:
    # (num_tokens | None, is_async): None asks again next step, True parks the request in
    # WAITING_FOR_REMOTE_KVS.
    assert Claim(ClaimKind.DEFER).as_vllm() == (None, False)
    assert Claim(ClaimKind.NONE).as_vllm() == (0, False)
    assert Claim(ClaimKind.SYNC, 16).as_vllm() == (16, False)
    assert Claim(ClaimKind.ASYNC, 32).as_vllm() == (32, True)


def test_the_seed_refuses_a_store_too_small() -> None:
    core = ConnectorCore(_planner(), HostStore(2), (FULL, MAMBA), 2, 2)
    before = core.snapshot()
    _refused("store_capacity", core.seed, view("A", range(1, 9)), 8)
    assert core.snapshot() == before


# --------------------------------------------------------------------- the tracker


def _job(job_id: int, kind: TransferKind = TransferKind.LOAD, *items: TransferItem) -> TransferJob:
    return TransferJob(JobId(job_id), kind, RequestId("r"), tuple(items))


def _output(*job_ids: JobId) -> KVConnectorOutput:
    return KVConnectorOutput(completed_jobs=tuple(JobResult(j, True) for j in job_ids))


def test_the_tracker_refuses_reused_ids_and_unknown_results() -> None:
    tracker = JobTracker()
    tracker.bind_connector_metadata(ConnectorMeta((_job(1),)))
    before = tracker.snapshot()
    _refused("job_id", tracker.bind_connector_metadata, ConnectorMeta((_job(1),)))
    _refused("job_id", tracker.bind_connector_metadata, ConnectorMeta((_job(2), _job(2))))
    _refused("results", tracker.get_transfer_results, (JobResult(JobId(5), True),))
    results = (JobResult(JobId(1), True), JobResult(JobId(1), True))
    _refused("results", tracker.get_transfer_results, results)
    _refused("job_id", tracker.job, JobId(9))
    assert tracker.snapshot() == before


# --------------------------------------------------------------------- the worker


def _bad_jobs(stack: Any, item: TransferItem) -> dict[str, ConnectorMeta]:
    """One bad item per case, behind a good job, so a partial acceptance would show."""
    good = stack.core.build_connector_meta(StepView(50, ()))
    assert good == ConnectorMeta()
    return {
        "null block": ConnectorMeta((_job(90, TransferKind.LOAD, item._replace(block_id=0)),)),
        "block past the cache": ConnectorMeta(
            (_job(91, TransferKind.LOAD, item._replace(block_id=10_000)),)
        ),
        "unknown group": ConnectorMeta((_job(92, TransferKind.LOAD, item._replace(group_idx=7)),)),
        "evicted key": ConnectorMeta((_job(93, TransferKind.LOAD, item._replace(key=b"gone")),)),
        "store of a READY key": ConnectorMeta((), (_job(94, TransferKind.STORE, item),)),
        "a block twice": ConnectorMeta((_job(95, TransferKind.LOAD, item, item),)),
    }


FIELDS = {
    "null block": "block_id",
    "block past the cache": "block_id",
    "unknown group": "group_idx",
    "evicted key": "key",
    "store of a READY key": "key",
    "a block twice": "block_id",
}


@pytest.mark.parametrize("case_name", sorted(FIELDS))
def test_the_worker_refuses_bad_jobs_before_moving_a_byte(case_name: str) -> None:
    case, stack, driver = make("full_sliding")
    with stack.engine:
        store_a(case, driver, "full_sliding")
        key = stack.core.snapshot()["store"]["entries"][0][0]
        item = TransferItem(0, 5, bytes.fromhex(key), BLOCK)
        meta = _bad_jobs(stack, item)[case_name]
        gpu = [t.clone() for t in case.kv_caches.values() if isinstance(t, torch.Tensor)]
        host = stack.host.tensor.clone()
        submitted = stack.worker.stats().jobs_submitted
        _refused(FIELDS[case_name], stack.worker.bind_connector_metadata, meta)
        stack.worker.drain()
        assert stack.worker.in_flight() == ()
        assert stack.worker.stats().jobs_submitted == submitted
        tensors = [t for t in case.kv_caches.values() if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(gpu, tensors, strict=True))
        assert torch.equal(host, stack.host.tensor)


def test_the_worker_refuses_a_store_larger_than_host_memory() -> None:
    _, stack, _ = make("full_sliding")
    with stack.engine:
        host = HostMemory(4 * 2048, 2048, PinMode.OFF)
        _refused("num_chunks", TransferWorker, stack.engine, HostStore(5), stack.caches, host)


# --------------------------------------------------------------------- the stack


def _build(**overrides: Any) -> Any:
    case = overrides.pop("case", None) or hybrid_overlay_case(8, torch.device("cpu"))
    args: dict[str, Any] = {
        "hash_block_size": 16,
        "chunk_size": 16,
        "max_model_len": 256,
        "num_chunks": 8,
    }
    args.update(overrides)
    return build_cpu_stack(case.groups, case.kv_caches, case.num_blocks, **args)


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("chunk_size", {"chunk_size": 8, "hash_block_size": 8}),  # half a block per unit
        ("num_chunks", {"num_chunks": 0}),
        ("num_chunks", {"num_chunks": None}),  # neither size given
        ("num_chunks", {"host_bytes": 1 << 20}),  # both sizes given
        ("host_bytes", {"num_chunks": None, "host_bytes": 100}),  # not one slot
        ("hash_block_size", {"hash_block_size": 5}),
        ("sliding_windows", {"sliding_windows": (1, 2, 3)}),
        ("cache_policy", {"policy": "fifo"}),
    ],
)
def test_the_stack_refuses_impossible_sizes_and_geometries(
    field: str, overrides: dict[str, Any]
) -> None:
    threads = threading.active_count()
    _refused(field, _build, **overrides)
    assert threading.active_count() == threads  # no engine thread was started


def test_the_stack_refuses_specs_that_do_not_match_the_tensors() -> None:
    case = full_sliding_case(6)
    wrong_layer = CacheGroupSpec(FULL, BLOCK, 1024, 1024, ("missing.0",))
    _refused(
        "kv_caches",
        build_cpu_stack,
        (wrong_layer, case.groups[1]),
        case.kv_caches,
        6,
        hash_block_size=BLOCK,
        chunk_size=BLOCK,
        max_model_len=256,
        num_chunks=4,
    )
    with pytest.raises(HybridKVConfigError):
        build_cpu_stack(
            case.groups,
            case.kv_caches,
            7,  # the tensors hold 6 blocks
            hash_block_size=BLOCK,
            chunk_size=BLOCK,
            max_model_len=256,
            num_chunks=4,
        )


def test_a_stack_still_works_after_refusals() -> None:
    case, stack, driver = make("full_mamba")
    with stack.engine:
        before = store_a(case, driver, "full_mamba")
        randomize(case, seed=5)
        bad = _job(7, TransferKind.LOAD, TransferItem(0, 0, b"k", BLOCK))
        _refused("block_id", stack.worker.bind_connector_metadata, ConnectorMeta((bad,)))
        assert driver.claim(view("B", FOLLOW), LAYOUTS["full_mamba"][3]).num_tokens == len(PROMPT)
        out = driver.step()
        assert out.finished_recving == {"B"}
        assert stack.worker.stats().jobs_failed == 0
        assert before
