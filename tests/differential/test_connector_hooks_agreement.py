"""The core and the reference connector agree when their hooks are called directly.

The engine-level agreement test (test_connector_agreement.py) sees only what the spec
scheduler asks: with pinned store sources the GPU prefix cache covers every STORING key, so a
claim almost never meets one. Here a hand-rolled driver calls the hooks itself, the way
``tests/spec/connector_harness.py`` does: claims from any aligned computed prefix (DEFER on
STORING keys, claims that start past 0), allocations that accept a claim whole or cut short,
prefill and decode stores into tables with null slots (sliding windows, dropped mamba states),
tokens that grow between calls, job completions and failures in any order, finishes with
stores in flight, seeded hosts, EAGLE groups (a claim then needs the unit past its end stored),
and calls that break a pre-condition (alloc with no ask, a misaligned ask, an unknown job). Both
sides pin through their own counting pool.

After every call: the same answer (or an error with the same ``field``), equal connector
snapshots (host store included), worker snapshots, pinned blocks and pool counts, and the
MB-*/SEC-1 verdicts. Run count: 200 traces per eviction policy in the ci profile.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from test_connector_agreement import LAYOUTS, plain

from hybridkv.connector import LoadMode as CoreLoadMode
from hybridkv.simulator import engine_adapter
from spec.connector import LoadMode as SpecLoadMode
from spec.connector import ReferenceConnector, ReferenceWorker
from spec.connector_api import (
    ClaimKind,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore as SpecStore

MAX_MODEL_LEN = 64


class CountingPool:
    """A GPU block pool reduced to reference counts (what the pins touch)."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def touch(self, blocks: Any) -> None:
        for b in blocks:
            self.refs[int(b)] += 1

    def free_blocks(self, blocks: Any) -> None:
        for b in blocks:
            assert self.refs[int(b)] > 0, f"block {b} freed more often than touched"
            self.refs[int(b)] -= 1

    def counts(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((b, n) for b, n in self.refs.items() if n))


class Side:
    """One connector, its worker and its pool, called through one ``call`` (errors as data)."""

    def __init__(self, connector: Any, worker: Any) -> None:
        self.connector = connector
        self.worker = worker
        self.pool = CountingPool()
        connector.bind_gpu_block_pool(self.pool)

    def call(self, name: str, *args: Any) -> Any:
        try:
            return plain(getattr(self.connector, name)(*args))
        except ValueError as error:
            return ("error", getattr(error, "field", None))

    def observe(self) -> Any:
        snap = self.connector.snapshot()
        return (
            snap,
            self.worker.snapshot(),
            tuple(self.connector.held_blocks()),
            self.pool.counts(),
            check_all("connector", snap),
        )


def _sides(layout: str, hash_block: int, chunk: int, policy: str, **opts: Any) -> list[Side]:
    groups = LAYOUTS[layout][0]
    planner = HybridOffloadPlanner(
        tuple((g.kind, g.block_size) for g in groups), hash_block, chunk, MAX_MODEL_LEN
    )
    windows = engine_adapter.window_reaches(groups) if opts["windows"] else ()
    reference = ReferenceConnector(
        planner,
        SpecStore(opts["capacity"], policy),
        tuple(g.kind for g in groups),
        hash_block,
        chunk,
        sliding_windows=windows,
        load_mode=SpecLoadMode.SYNC if opts["sync"] else SpecLoadMode.ASYNC,
        eagle_groups=opts["eagle"],
    )
    core = engine_adapter.build_core(
        groups,
        hash_block_size=hash_block,
        chunk_size=chunk,
        max_model_len=MAX_MODEL_LEN,
        store_capacity=opts["capacity"],
        policy=policy,
        load_mode=CoreLoadMode.SYNC if opts["sync"] else CoreLoadMode.ASYNC,
        windows=opts["windows"],
        eagle_groups=opts["eagle"],
    )
    return [Side(reference, ReferenceWorker()), Side(core, engine_adapter.TrackerWorker())]


def eagle_groups(num_groups: int) -> st.SearchStrategy[tuple[int, ...]]:
    """The groups vLLM drops EAGLE's block from: none (no EAGLE/MTP, or lookahead hashes) half
    the time, else every group (vLLM's fallback when none is flagged) or the flagged one."""
    every = tuple(range(num_groups))
    return st.sampled_from(((), (), every, *((g,) for g in every)))


class Driver:
    """The requests' tokens and tables, the step counter, and both sides."""

    def __init__(self, data: st.DataObject, policy: str) -> None:
        self.data = data
        layout = data.draw(st.sampled_from(sorted(LAYOUTS)), label="layout")
        groups, hashes, chunks = LAYOUTS[layout]
        hash_block = data.draw(st.sampled_from(hashes))
        chunk = data.draw(st.sampled_from([c for c in chunks if c % hash_block == 0]))
        opts = {
            "capacity": data.draw(st.sampled_from((2, 4, 8, 16, 32)), label="capacity"),
            "sync": data.draw(st.booleans(), label="sync"),
            "windows": data.draw(st.booleans(), label="windows"),
            "eagle": data.draw(eagle_groups(len(groups)), label="eagle groups"),
        }
        self.groups = groups
        self.eagle = bool(opts["eagle"])
        self.block = math.lcm(*(g.block_size for g in groups))
        self.sides = _sides(layout, hash_block, chunk, policy, **opts)
        base = data.draw(st.lists(st.integers(1, 3), min_size=4, max_size=16), label="prefix")
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, str | None] = {}
        for i in range(data.draw(st.integers(1, 4), label="requests")):
            keep = data.draw(st.sampled_from((len(base), len(base), len(base) // 2)))
            tail = data.draw(st.lists(st.integers(1, 4), max_size=4))
            self.tokens[f"r{i}"] = base[:keep] + tail
            self.salts[f"r{i}"] = data.draw(st.sampled_from((None, None, "a")))
        self.tables: dict[str, list[list[int]]] = {rid: [[] for _ in groups] for rid in self.tokens}
        self.computed: dict[str, int] = dict.fromkeys(self.tokens, 0)
        self.finished: set[str] = set()
        self.next_block = 1
        self.step_no = 0

    # ----------------------------------------------------------------- helpers

    def view(self, rid: str) -> RequestView:
        tokens = tuple(self.tokens[rid])
        return RequestView(RequestId(rid), tokens, len(tokens), self.salts[rid])

    def table(self, rid: str, upto: int) -> tuple[tuple[int, ...], ...]:
        """The request's table covering ``upto`` tokens; fresh slots are real or (sometimes,
        for sliding and mamba groups) null, as the managers leave them."""
        for g, spec in enumerate(self.groups):
            table = self.tables[rid][g]
            while len(table) * spec.block_size < upto:
                null = spec.kind is not GroupKind.FULL and self.data.draw(
                    st.sampled_from((False, False, True))
                )
                table.append(0 if null else self.next_block)
                self.next_block += 0 if null else 1
        return tuple(tuple(t) for t in self.tables[rid])

    def same(self, name: str, *args: Any) -> Any:
        answers = [side.call(name, *args) for side in self.sides]
        assert answers[1] == answers[0], (name, args)
        return answers[0]

    def agree(self) -> None:
        observed = [side.observe() for side in self.sides]
        assert observed[1] == observed[0]
        assert observed[1][4] == {} or observed[0][4] == observed[1][4]

    def build(self, rows: tuple[ScheduledRequest, ...] = ()) -> None:
        self.step_no += 1
        step = StepView(self.step_no, rows)
        metas = []
        for side in self.sides:
            meta = side.connector.build_connector_meta(step)
            side.worker.bind_connector_metadata(meta)
            metas.append(meta)
        assert metas[1] == metas[0]
        if metas[0].load_jobs:
            event("load jobs emitted")

    # ----------------------------------------------------------------- operations

    def compute(self) -> None:
        live = [r for r in self.tokens if r not in self.finished]
        if not live:
            self.build()
            return
        rows = []
        for rid in self.data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)):
            start = self.computed[rid]
            left = len(self.tokens[rid]) - start
            if left <= 0:
                self.tokens[rid].append(self.data.draw(st.integers(1, 4)))  # a decode token
                left = 1
            n = self.data.draw(st.integers(1, left))
            rows.append(ScheduledRequest(self.view(rid), self.table(rid, start + n), start, n))
            self.computed[rid] = start + n
        self.build(tuple(rows))

    def ask(self) -> None:
        rid = self.data.draw(st.sampled_from(sorted(self.tokens)))
        top = len(self.tokens[rid]) // self.block
        start = self.block * self.data.draw(st.sampled_from((0, 0, 0, *range(top + 1))))
        if self.data.draw(st.sampled_from((False, False, False, True))):
            start += 1  # a misaligned ask: both refuse it
        claim = self.same("get_num_new_matched_tokens", self.view(rid), start)
        event(f"claim {claim[0] if claim[0] == 'error' else claim[0][1]}")
        if self.eagle:
            event(f"eagle claim {claim[0] if claim[0] == 'error' else claim[0][1]}")
        if claim[0] != "error" and claim[0][1] in (ClaimKind.SYNC.value, ClaimKind.ASYNC.value):
            n = claim[1][1]
            if self.data.draw(st.booleans()):
                n -= n % self.block  # the scheduler may cut a claim to its block
                n = self.data.draw(st.sampled_from(range(self.block, n + 1, self.block)))
            table = self.table(rid, start + n)
            self.same("update_state_after_alloc", self.view(rid), table, n)
        elif start + self.block < len(self.tokens[rid]) and self.data.draw(
            st.sampled_from((False, False, False, True))
        ):
            # An allocation beyond what was claimed: both load what the host holds for it.
            table = self.table(rid, start + self.block)
            self.same("update_state_after_alloc", self.view(rid), table, self.block)
        self.build()

    def stray_alloc(self) -> None:
        """An allocation with no ask in this schedule: both refuse it by the same field."""
        rid = self.data.draw(st.sampled_from(sorted(self.tokens)))
        self.same("update_state_after_alloc", self.view(rid), self.table(rid, self.block), 1)

    def complete(self) -> None:
        jobs = sorted(set(self.sides[0].worker.snapshot()["jobs"]))
        if not jobs:
            return
        picked = self.data.draw(st.lists(st.sampled_from(jobs), unique=True, min_size=1))
        results = tuple(
            JobResult(JobId(job[0]), self.data.draw(st.sampled_from((True, True, True, False))))
            for job in picked
        )
        event("a job failed" if not all(r.success for r in results) else "jobs succeeded")
        outputs = []
        for side in self.sides:
            out = side.worker.get_transfer_results(results)
            side.connector.update_connector_output(out)
            outputs.append(out)
        assert outputs[1] == outputs[0]

    def finish(self) -> None:
        live = [r for r in self.tokens if r not in self.finished]
        if not live:
            return
        rid = self.data.draw(st.sampled_from(live))
        self.finished.add(rid)
        table = self.table(rid, self.computed[rid])
        delayed = self.same("request_finished_all_groups", self.view(rid), table)
        event(f"finish delayed={delayed}")

    def seed(self) -> None:
        rid = self.data.draw(st.sampled_from(sorted(self.tokens)))
        n = self.data.draw(st.integers(1, len(self.tokens[rid])))
        groups = self.data.draw(st.sampled_from(((), (), (0,), (len(self.groups) - 1,))))
        self.same("seed", self.view(rid), n, groups)

    def bad_report(self) -> None:
        """A job id nobody issued: both connectors refuse it by the same field."""
        out = KVConnectorOutput(completed_jobs=(JobResult(JobId(999), True),))
        self.same("update_connector_output", out)


OPERATIONS = (
    *("compute",) * 4,
    *("ask",) * 4,
    *("complete",) * 4,
    "finish",
    "seed",
    "seed",
    "bad_report",
    "stray_alloc",
)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(data=st.data())
def test_hooks_agree_call_by_call(policy: str, data: st.DataObject) -> None:
    driver = Driver(data, policy)
    driver.agree()
    for _ in range(data.draw(st.integers(3, 50), label="operations")):
        getattr(driver, data.draw(st.sampled_from(OPERATIONS)))()
        driver.agree()
