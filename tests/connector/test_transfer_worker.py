"""The worker side with real bytes: the core's jobs run on the CPU engine over canonical caches.

Each scenario builds a whole stack (:func:`hybridkv.connector.stack.build_cpu_stack`), fills the
caches with random bytes, lets request A compute and store its prompt, then lets request B (the
same prompt) claim and load it into other blocks, and compares B's blocks with A's byte for
byte, read through plain logical indexing of the per-layer tensors (not the library's strides).
Layouts: full attention + mamba overlaid on one allocation (Qwen3-Next-like), and full
attention + a sliding window. Faults: injected by the worker's fault hook and raised inside the
engine's copies; both report failed loads (failed_recving) and the core salvages the prefix
before the failed segment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from waited_engine import CopiesWhenWaited

from hybridkv.cache_layouts import LayoutCase, hybrid_overlay_case
from hybridkv.canonical import CacheGroupSpec
from hybridkv.connector import (
    Claim,
    ClaimKind,
    KVConnectorOutput,
    LoadMode,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.stack import OffloadStack, build_cpu_stack
from hybridkv.connector.worker import TransferWorker
from hybridkv.kinds import GroupKind
from hybridkv.transfer import Direction

BLOCK = 16
NUM_BLOCKS = 24


def full_sliding_case(num_blocks: int = NUM_BLOCKS) -> LayoutCase:
    """Two attention groups, K/V planes first ``(2, B, 16, 2, 8)`` fp16, two layers each."""
    caches: dict[str, Any] = {}
    groups = []
    for kind, name in ((GroupKind.FULL, "full"), (GroupKind.SLIDING, "swa")):
        layers = [f"{name}.{i}" for i in range(2)]
        for layer in layers:
            caches[layer] = torch.zeros((2, num_blocks, BLOCK, 2, 8), dtype=torch.float16)
        page = 2 * BLOCK * 2 * 8 * 2
        groups.append(CacheGroupSpec(kind, BLOCK, page, page, tuple(layers)))
    return LayoutCase("full_sliding", tuple(groups), caches, num_blocks)


def block_bytes(case: LayoutCase, group: int, block: int) -> bytes:
    """Block ``block`` of ``group``: each layer's K and V rows (or conv and ssm state)."""
    out = b""
    for layer in case.groups[group].layer_names:
        cache = case.kv_caches[layer]
        parts = (
            [cache[0][block], cache[1][block]]
            if isinstance(cache, tuple)
            else [
                cache[0, block],
                cache[1, block],
            ]
        )
        for part in parts:
            out += bytes(part.contiguous().view(-1).view(torch.uint8).tolist())
    return out


def randomize(case: LayoutCase, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cache in case.kv_caches.values():
        for t in cache if isinstance(cache, tuple) else (cache,):
            raw = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen)
            flat = t.view(torch.uint8) if t.element_size() == 1 else None
            if flat is None:
                t.copy_(raw.to(torch.float32).to(t.dtype))
            else:
                flat.copy_(raw)


class Driver:
    """Drives a stack in vLLM's order: build meta, bind, (forward), save, results, fold."""

    def __init__(self, stack: OffloadStack) -> None:
        self.stack = stack
        self.step_no = 0
        self.meta: Any = None

    def step(
        self, rows: Sequence[ScheduledRequest] = (), *, wait: bool = True, hold: Any = ()
    ) -> KVConnectorOutput:
        self.step_no += 1
        core, worker = self.stack.core, self.stack.worker
        self.meta = core.build_connector_meta(StepView(self.step_no, tuple(rows)))
        worker.bind_connector_metadata(self.meta)
        worker.wait_for_save()
        out = worker.get_transfer_results(wait=wait, hold=hold)
        core.update_connector_output(out)
        return out

    def claim(self, view: RequestView, table: tuple[tuple[int, ...], ...]) -> Claim:
        claim = self.stack.core.get_num_new_matched_tokens(view, 0)
        if claim.num_tokens:
            self.stack.core.update_state_after_alloc(view, table, claim.num_tokens)
        return claim


def view(rid: str, tokens: Sequence[int]) -> RequestView:
    return RequestView(RequestId(rid), tuple(tokens), len(tokens))


PROMPT = tuple(range(1, 49))  # 48 tokens: three blocks
FOLLOW = (*PROMPT, 99)  # the same prompt and one more token: 48 claimable

# (case builder, sliding reaches, A's table, B's table, loaded (group, A block, B block) pairs)
LAYOUTS: dict[str, tuple[Callable[[], LayoutCase], tuple[int, ...], Any, Any, Any]] = {
    "full_mamba": (
        lambda: hybrid_overlay_case(NUM_BLOCKS, torch.device("cpu")),
        (),
        ((1, 2, 3), (0, 0, 4)),  # align mode: only the state after 48 tokens is kept
        ((5, 6, 7), (0, 0, 8)),
        ((0, 1, 5), (0, 2, 6), (0, 3, 7), (1, 4, 8)),
    ),
    "full_sliding": (
        full_sliding_case,
        (0, 2 * BLOCK - 1),  # a 32-token window reads 31 tokens back
        ((1, 2, 3), (9, 10, 11)),
        ((5, 6, 7), (0, 12, 13)),  # the window at 48 needs the units ending at 32 and 48
        ((0, 1, 5), (0, 2, 6), (0, 3, 7), (1, 10, 12), (1, 11, 13)),
    ),
}


def make(
    layout: str, *, mode: LoadMode = LoadMode.ASYNC, **faults: Any
) -> tuple[LayoutCase, OffloadStack, Driver]:
    build, reaches, *_ = LAYOUTS[layout]
    case = build()
    stack = build_cpu_stack(
        case.groups,
        case.kv_caches,
        case.num_blocks,
        hash_block_size=BLOCK,
        chunk_size=BLOCK,
        max_model_len=1024,
        num_chunks=32,
        sliding_windows=reaches,
        load_mode=mode,
        **faults,
    )
    return case, stack, Driver(stack)


def store_a(case: LayoutCase, driver: Driver, layout: str) -> dict[tuple[int, int], bytes]:
    """A computes its 48 tokens in one step; its units are stored; returns A's block bytes."""
    table_a = LAYOUTS[layout][2]
    randomize(case, seed=1)
    before = {(g, b): block_bytes(case, g, b) for g, t in enumerate(table_a) for b in t if b}
    out = driver.step([ScheduledRequest(view("A", PROMPT), table_a, 0, len(PROMPT))])
    assert driver.meta.store_jobs
    assert all(r.success for r in out.completed_jobs)
    assert driver.stack.store.stats().ready == sum(len([b for b in t if b]) for t in table_a)
    return before


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_stored_prompt_loads_back_byte_for_byte(layout: str) -> None:
    case, stack, driver = make(layout)
    with stack.engine:
        before = store_a(case, driver, layout)
        randomize(case, seed=2)  # B's blocks (and A's) now hold other bytes
        claim = driver.claim(view("B", FOLLOW), LAYOUTS[layout][3])
        assert claim == Claim(ClaimKind.ASYNC, 48)
        out = driver.step()
        assert out.finished_recving == {"B"}
        assert out.failed_recving == frozenset()
        for g, a_block, b_block in LAYOUTS[layout][4]:
            assert block_bytes(case, g, b_block) == before[(g, a_block)], (g, a_block, b_block)
        assert stack.store.stats().pinned == 0
        stats = stack.worker.stats()
        assert stats.blocks_loaded == len(LAYOUTS[layout][4])
        assert stats.jobs_failed == 0


def _fails_last_segment(job: TransferJob) -> bool:
    return job.kind is TransferKind.LOAD and max(i.end_token for i in job.items) == 48


@pytest.mark.parametrize("where", ["worker_hook", "engine_copy"])
def test_a_failed_load_is_reported_failed_and_the_reask_salvages(where: str) -> None:
    if where == "worker_hook":
        faults: dict[str, Any] = {"fault_hook": _fails_last_segment}
    else:
        # The engine numbers its own jobs; fail every load copy from the third load on.
        seen: list[int] = []

        def hook(job: Any, direction: Direction, run: int) -> None:
            if direction is Direction.LOAD and run == 0:
                seen.append(job)
            if direction is Direction.LOAD and len(seen) >= 3:
                raise RuntimeError("injected copy failure")

        faults = {"engine_fault_hook": hook}
    case, stack, driver = make("full_sliding", **faults)
    with stack.engine:
        store_a(case, driver, "full_sliding")
        driver.claim(view("B", FOLLOW), LAYOUTS["full_sliding"][3])
        out = driver.step()
        assert out.finished_recving == {"B"}
        assert out.failed_recving == {"B"}
        assert [r.success for r in out.completed_jobs] == [True, True, False]
        assert len(stack.core.failed_keys()) == 2  # the segment ending at 48, both groups
        # B's blocks are valid nowhere past 0: at 32 the window also reads the unit ending at
        # 16, which B's load (its window at 48) never carried.
        assert stack.core.first_invalid_token(view("B", FOLLOW)) == 0
        # The re-ask avoids the failed keys: everything up to 32 is still there.
        again = stack.core.get_num_new_matched_tokens(view("B", FOLLOW), 0)
        assert again == Claim(ClaimKind.ASYNC, 32)
        assert stack.store.stats().pinned == 0


def test_a_failed_store_drops_its_entries_and_nothing_is_claimed() -> None:
    def fails_stores(job: TransferJob) -> bool:
        return job.kind is TransferKind.STORE

    case, stack, driver = make("full_mamba", fault_hook=fails_stores)
    with stack.engine:
        randomize(case, seed=1)
        out = driver.step([ScheduledRequest(view("A", PROMPT), LAYOUTS["full_mamba"][2], 0, 48)])
        assert [r.success for r in out.completed_jobs] == [False]
        assert stack.store.stats().used == 0
        assert stack.worker.stats().faults_injected == 1
        assert stack.worker.stats().jobs_submitted == 0  # nothing moved
        assert driver.claim(view("B", FOLLOW), LAYOUTS["full_mamba"][3]).kind is ClaimKind.NONE


def make_waited(
    layout: str, *, mode: LoadMode
) -> tuple[LayoutCase, OffloadStack, Driver, CopiesWhenWaited]:
    """:func:`make`, with a worker on an engine that copies only when waited on."""
    case, stack, _ = make(layout, mode=mode)
    stack.engine.close()  # its thread would never be used
    engine = CopiesWhenWaited(stack.caches, stack.host)
    worker = TransferWorker(engine, stack.store, stack.caches, stack.host)
    stack = dataclasses.replace(stack, worker=worker)
    return case, stack, Driver(stack), engine


def test_a_sync_load_lands_before_the_forward_and_reports_by_job_only() -> None:
    # On an engine that copies only when waited on, B's bytes are in place after the bind
    # only because the worker waited for the sync load there: without that wait this fails
    # every run (with the threaded CPU engine it used to pass about one run in four).
    case, stack, driver, engine = make_waited("full_mamba", mode=LoadMode.SYNC)
    before = store_a(case, driver, "full_mamba")
    randomize(case, seed=3)
    claim = driver.claim(view("B", FOLLOW), LAYOUTS["full_mamba"][3])
    assert claim == Claim(ClaimKind.SYNC, 48)
    meta = stack.core.build_connector_meta(StepView(9, ()))
    assert meta.load_jobs
    assert all(job.sync for job in meta.load_jobs)
    copied = len(engine.copied)
    stack.worker.bind_connector_metadata(meta)
    assert len(engine.copied) == copied + len(meta.load_jobs)  # moved inside the bind
    # Bound: the bytes are there before any result is polled (the forward may read them).
    for g, a_block, b_block in LAYOUTS["full_mamba"][4]:
        assert block_bytes(case, g, b_block) == before[(g, a_block)]
    out = stack.worker.get_transfer_results(wait=True)
    assert out.finished_recving == frozenset()
    assert len(out.completed_jobs) == len(meta.load_jobs)
    stack.core.update_connector_output(out)
    assert stack.store.stats().pinned == 0


def test_the_waited_engine_moves_no_byte_of_an_async_load_before_the_wait() -> None:
    # The guard of the test above: the engine really holds copies back until a wait, so the
    # bytes it found in place came from the worker's wait, not from the engine.
    case, stack, driver, engine = make_waited("full_mamba", mode=LoadMode.ASYNC)
    before = store_a(case, driver, "full_mamba")
    randomize(case, seed=3)
    stale = {(g, b): block_bytes(case, g, b) for g, _, b in LAYOUTS["full_mamba"][4]}
    assert driver.claim(view("B", FOLLOW), LAYOUTS["full_mamba"][3]).kind is ClaimKind.ASYNC
    meta = stack.core.build_connector_meta(StepView(9, ()))
    copied = len(engine.copied)
    stack.worker.bind_connector_metadata(meta)
    assert len(engine.copied) == copied
    for g, _, b_block in LAYOUTS["full_mamba"][4]:
        assert block_bytes(case, g, b_block) == stale[(g, b_block)]
    out = stack.worker.get_transfer_results(wait=True)
    assert out.finished_recving == {"B"}
    for g, a_block, b_block in LAYOUTS["full_mamba"][4]:
        assert block_bytes(case, g, b_block) == before[(g, a_block)]


def test_held_results_are_reported_later_and_delay_the_free() -> None:
    case, stack, driver = make("full_mamba")
    with stack.engine:
        randomize(case, seed=1)
        table = LAYOUTS["full_mamba"][2]
        driver.step([ScheduledRequest(view("A", PROMPT), table, 0, 48)], hold={1})
        assert stack.worker.in_flight() == (1,)
        assert stack.core.request_finished_all_groups(view("A", PROMPT), table) is True
        out = driver.step(hold={1})
        assert out.finished_sending == frozenset()
        out = driver.step()
        assert [r.job_id for r in out.completed_jobs] == [1]
        assert out.finished_sending == {"A"}
        assert stack.core.stats().store_jobs == 1


# ------------------------------------------------------------------ speculative decoding order
# With speculative decoding vLLM collects the transfer results right after the target forward
# and calls wait_for_save only after the drafter wrote its layers (worker.py's docstring cites
# the runner's lines), so a store must not start in get_transfer_results.


def test_a_store_starts_in_wait_for_save_not_in_get_transfer_results() -> None:
    """Target forward, results, drafter, save: the host copy holds the drafter's bytes.
    Fails when get_transfer_results submits the stores bound this step (issue 17, 2d)."""
    case, stack, driver = make("full_sliding")
    table_a = LAYOUTS["full_sliding"][2]
    with stack.engine:
        randomize(case, seed=1)  # the target forward's writes
        meta = stack.core.build_connector_meta(
            StepView(1, (ScheduledRequest(view("A", PROMPT), table_a, 0, len(PROMPT)),))
        )
        assert meta.store_jobs
        stack.worker.bind_connector_metadata(meta)
        early = stack.worker.get_transfer_results(wait=True)
        stack.core.update_connector_output(early)
        assert early.completed_jobs == ()
        assert stack.worker.stats().jobs_submitted == 0  # nothing read A's blocks yet
        randomize(case, seed=5)  # the drafter writes its layers' KV of this step
        drafted = {(g, b): block_bytes(case, g, b) for g, t in enumerate(table_a) for b in t if b}
        stack.worker.wait_for_save()
        out = stack.worker.get_transfer_results(wait=True)
        stack.core.update_connector_output(out)
        assert [r.success for r in out.completed_jobs] == [True] * len(meta.store_jobs)
        randomize(case, seed=2)
        assert driver.claim(view("B", FOLLOW), LAYOUTS["full_sliding"][3]).num_tokens == 48
        assert driver.step().finished_recving == {"B"}
        for g, a_block, b_block in LAYOUTS["full_sliding"][4]:
            assert block_bytes(case, g, b_block) == drafted[(g, a_block)], (g, a_block)


def test_a_store_whose_wait_for_save_never_came_starts_at_the_next_bind() -> None:
    """Liveness: a step without wait_for_save strands no store (the next bind submits it, and
    the fold after reports it). A regression guard: this also passes on main, where
    get_transfer_results submitted it."""
    case, stack, _ = make("full_sliding")
    table_a = LAYOUTS["full_sliding"][2]
    with stack.engine:
        randomize(case, seed=1)
        meta = stack.core.build_connector_meta(
            StepView(1, (ScheduledRequest(view("A", PROMPT), table_a, 0, len(PROMPT)),))
        )
        stack.worker.bind_connector_metadata(meta)
        stack.core.update_connector_output(stack.worker.get_transfer_results(wait=True))
        # No wait_for_save; the next step binds its (empty) metadata.
        stack.worker.bind_connector_metadata(stack.core.build_connector_meta(StepView(2, ())))
        assert stack.worker.stats().jobs_submitted == len(meta.store_jobs)
        out = stack.worker.get_transfer_results(wait=True)
        stack.core.update_connector_output(out)
        assert sorted(r.job_id for r in out.completed_jobs) == sorted(
            j.job_id for j in meta.store_jobs
        )
        assert stack.worker.in_flight() == ()
        assert stack.store.stats().ready == sum(len([b for b in t if b]) for t in table_a)
