"""A state machine over the optimized host store and the CPU transfer engine, with real bytes.

The machine plays the connector's part around ``hybridkv.store.HostStore`` and
``hybridkv.transfer.CpuTransferEngine`` over canonical caches of a hybrid layout (full
attention and mamba overlaid on one allocation, so one block id's bytes serve either group):
requests compute tokens into blocks of a shared GPU pool (``spec.block_pool.BlockPool``),
completed units are stored (``prepare_store``, the slots of the reserved entries, a STORE job;
the source blocks pinned in the pool), stored prefixes are loaded into fresh blocks of other
requests (``prepare_load``, a LOAD job), jobs finish in submission order (some failing inside
the engine's copy) and are folded (``complete_store``/``complete_load``, pins dropped),
requests free their blocks while their stores still run, and the store evicts under pressure.

Content is real: computing a block writes bytes derived from its content tag
``(group, token prefix)`` (``spec.system.content``), and every content the invariants see is
read back from the bytes (unknown bytes are garbage). After every step:

- every ST-* invariant on the store's snapshot (``check_all("store", ...)``);
- TR-1, TR-2 and DATA-1 on the system snapshot (``check_all("system", ...)``): reference
  counts, tables, jobs in flight with their sources' content at the start, GPU content, and
  the reads a request makes of the blocks a successful load filled.

Runs: the profile's max_examples machines (ci: 200) of 40 steps each.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.cache_layouts import hybrid_overlay_case
from hybridkv.canonical import build_canonical_caches
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.store import HostStore, LookupResult, PrepareLoadOutput, PrepareStoreOutput
from hybridkv.testbed.content import BlockTags
from hybridkv.transfer import CpuTransferEngine, Direction, FinishedJob, TransferPair
from spec.block_pool import BlockId, BlockPool
from spec.invariants import check_all
from spec.system.content import Content, Garbage, encode

UNKNOWN = Garbage("unknown bytes")  # what a block holds that no tag wrote

NUM_BLOCKS = 24
BS = 16  # tokens per block, both groups
FULL, MAMBA = 0, 1
PROMPTS = (
    tuple(range(1, 65)),
    (*range(1, 33), *range(100, 132)),
    (*range(1, 17), *range(200, 248)),
)


@dataclass
class Req:
    """One request: its tokens, computed count and tables (one per group, 0 = null)."""

    tokens: tuple[int, ...]
    computed: int = 0
    tables: list[list[int]] = field(default_factory=lambda: [[], []])
    loading: bool = False


@dataclass
class Job:
    """A job started and not folded: what the invariants see of it, and what folding needs."""

    engine_id: int
    kind: str
    rid: str
    items: tuple[tuple[int, int, int, Any], ...]  # (group, block, end_token, source or None)
    keys: tuple[bytes, ...]
    fails: bool


def key_of(group: int, prefix: tuple[int, ...]) -> bytes:
    """An offload key: one per (group, token prefix), as block hashes make them."""
    return hashlib.sha256(repr((group, prefix)).encode()).digest() + group.to_bytes(4, "big")


class StoreEngineMachine(RuleBasedStateMachine):
    """The optimized store and the CPU engine, driven as a connector drives them."""

    def __init__(self) -> None:
        super().__init__()
        case = hybrid_overlay_case(NUM_BLOCKS, torch.device("cpu"))
        self.caches = build_canonical_caches(case.kv_caches, case.groups, NUM_BLOCKS)
        self.bytes = BlockTags(self.caches)
        slot = max(self.caches.group_bytes(g) for g in (FULL, MAMBA))
        self.host = HostMemory(8 * slot, slot, PinMode.OFF)
        self.failing: set[int] = set()  # engine job ids whose copies raise
        self.engine = CpuTransferEngine(self.caches, self.host, self._fault)
        self.pool = BlockPool(NUM_BLOCKS)
        self.store = HostStore(1)
        self.requests: dict[str, Req] = {}
        self.jobs: deque[Job] = deque()  # started, not folded, in submission order
        self.done: dict[int, bool] = {}  # engine results polled, not folded yet
        self.stored: dict[bytes, Content] = {}  # what a successful store put in each entry
        self.reads: list[tuple[Any, ...]] = []
        self.next_id = 0
        self.submitted = 0

    def _fault(self, job: Any, direction: Direction, run: int) -> None:
        if job in self.failing:
            raise RuntimeError("injected copy failure")

    @initialize(
        capacity=st.integers(2, 8),
        policy=st.sampled_from(["lru", "arc"]),
        prompt=st.sampled_from(PROMPTS),
    )
    def build(self, capacity: int, policy: str, prompt: tuple[int, ...]) -> None:
        self.store = HostStore(capacity, policy)
        self.arrive(prompt)

    def teardown(self) -> None:
        self.engine.close()

    # ----------------------------------------------------------------- requests

    @rule(prompt=st.sampled_from(PROMPTS))
    def arrive(self, prompt: tuple[int, ...]) -> None:
        self.next_id += 1
        self.requests[f"r{self.next_id}"] = Req(prompt)

    def _live(self) -> list[str]:
        return sorted(r for r, req in self.requests.items() if not req.loading)

    @precondition(lambda self: bool(self._live()))
    @rule(
        data=st.data(),
        n=st.sampled_from((5, 16, 16, 32)),
        then_store=st.sampled_from((True, True, False)),
        fails=st.sampled_from((False, False, False, True)),
    )
    def compute(self, data: st.DataObject, n: int, then_store: bool, fails: bool) -> None:
        """The forward: write true content into the request's blocks (allocating as needed);
        align mode keeps one mamba state, the one after the last computed token. Then, as a
        connector does after each step, maybe store the units it completed."""
        rid = data.draw(st.sampled_from(self._live()))
        self._compute(rid, n)
        if then_store:
            self._store(rid, fails)

    def _compute(self, rid: str, n: int) -> None:
        req = self.requests[rid]
        end = min(req.computed + n, len(req.tokens))
        if end == req.computed:
            return
        need = -(-end // BS) - len(req.tables[FULL])
        state_index = -(-end // BS) - 1
        states = req.tables[MAMBA]
        reuse = len(states) == state_index + 1 and bool(states[-1])  # same block: rewritten
        got = self.pool.get_new_blocks(need + (0 if reuse else 1))
        if not isinstance(got, tuple):
            return
        req.tables[FULL].extend(got[:need])
        if reuse:
            state_block = states[-1]
        else:
            state_block = got[need]
            old = [b for b in states if b]
            req.tables[MAMBA] = [0] * state_index + [state_block]
            self.pool.free_blocks(BlockId(b) for b in old)
        for i in range(req.computed // BS, -(-end // BS)):
            upto = min((i + 1) * BS, end)
            self.bytes.write(FULL, req.tables[FULL][i], Content(FULL, req.tokens[:upto]))
        self.bytes.write(MAMBA, state_block, Content(MAMBA, req.tokens[:end]))
        req.computed = end

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """The request finishes or is preempted: its blocks go back (pins keep theirs)."""
        rid = data.draw(st.sampled_from(self._live()))
        req = self.requests.pop(rid)
        if any(
            b == blk
            for job in self.jobs
            for _, b, _, _ in job.items
            for t in req.tables
            for blk in t
        ):
            event("a store source freed while in flight")
        self.pool.free_blocks(BlockId(b) for t in req.tables for b in t if b)

    # ----------------------------------------------------------------- jobs

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data(), fails=st.sampled_from((False, False, False, True)))
    def store_units(self, data: st.DataObject, fails: bool) -> None:
        """Reserve the request's completed units still held in its table, and store them."""
        self._store(data.draw(st.sampled_from(self._live())), fails)

    def _store(self, rid: str, fails: bool) -> None:
        req = self.requests[rid]
        units = [
            (FULL, b, (i + 1) * BS)
            for i, b in enumerate(req.tables[FULL])
            if b and (i + 1) * BS <= req.computed
        ]
        if req.computed % BS == 0 and req.computed and req.tables[MAMBA][-1]:
            units.append((MAMBA, req.tables[MAMBA][-1], req.computed))
        if not units:
            return
        keys = [key_of(g, req.tokens[:end]) for g, _, end in units]
        prepared = self.store.prepare_store(keys)
        if not isinstance(prepared, PrepareStoreOutput) or not prepared.keys_to_store:
            return
        for key in prepared.evicted_keys:
            self.stored.pop(key, None)
        if prepared.evicted_keys:
            event("entries evicted")
        fresh = set(prepared.keys_to_store)
        chosen = [(u, k) for u, k in zip(units, keys, strict=True) if k in fresh]
        slots = self.store.slots([k for _, k in chosen])
        pairs = [TransferPair(g, b, s) for ((g, b, _), _), s in zip(chosen, slots, strict=True)]
        self.pool.touch(BlockId(b) for (_, b, _), _ in chosen)  # pin the sources (TR-1)
        items = tuple(
            (g, b, end, encode(self.bytes.read(g, b, UNKNOWN))) for (g, b, end), _ in chosen
        )
        keys = tuple(k for _, k in chosen)
        self._submit(Direction.STORE, pairs, Job(0, "store", rid, items, keys, fails))

    @rule(
        prompt=st.sampled_from(PROMPTS),
        upto=st.sampled_from((1, 2, 4)),
        fails=st.sampled_from((False, False, True)),
    )
    def load_prefix(self, prompt: tuple[int, ...], upto: int, fails: bool) -> None:
        """A new request loads a READY prefix (attention units and the state at its end)."""
        end = upto * BS
        keys = [key_of(FULL, prompt[: (i + 1) * BS]) for i in range(upto)]
        keys.append(key_of(MAMBA, prompt[:end]))
        if any(self.store.status(k) is not LookupResult.HIT for k in keys):
            return
        got = self.pool.get_new_blocks(upto + 1)
        if not isinstance(got, tuple):
            return
        if not isinstance(self.store.prepare_load(keys), PrepareLoadOutput):
            self.pool.free_blocks(got)
            return
        self.next_id += 1
        rid = f"r{self.next_id}"
        blocks = list(got)
        req = Req(prompt, computed=end, loading=True)
        req.tables = [blocks[:upto], [0] * (upto - 1) + [blocks[upto]]]
        self.requests[rid] = req
        slots = self.store.slots(keys)
        groups = [FULL] * upto + [MAMBA]
        ends = [(i + 1) * BS for i in range(upto)] + [end]
        pairs = [TransferPair(g, b, s) for g, b, s in zip(groups, blocks, slots, strict=True)]
        items = tuple((g, b, e, None) for g, b, e in zip(groups, blocks, ends, strict=True))
        self._submit(Direction.LOAD, pairs, Job(0, "load", rid, items, tuple(keys), fails))

    def _submit(self, direction: Direction, pairs: list[TransferPair], job: Job) -> None:
        # The engine numbers jobs from 1 in submission order: mark the next id before it runs.
        self.submitted += 1
        job.engine_id = self.submitted
        if job.fails:
            self.failing.add(job.engine_id)
        got = self.engine.submit(direction, pairs)
        assert got == job.engine_id
        self.jobs.append(job)

    @precondition(lambda self: bool(self.jobs))
    @rule(n=st.integers(1, 4))
    def finish(self, n: int) -> None:
        """The oldest ``n`` jobs finish (in submission order) and are folded."""
        ready = [self.jobs.popleft() for _ in range(min(n, len(self.jobs)))]
        self.engine.wait([job.engine_id for job in ready])
        for done in self.engine.poll():
            assert isinstance(done, FinishedJob)
            self.done[done.job_id] = done.success
        for job in ready:
            success = self.done.pop(job.engine_id)
            assert success is not job.fails  # a failure is never reported as a success
            event(f"{job.kind} folded, success={success}")
            if job.kind == "store":
                self._fold_store(job, success)
            else:
                self._fold_load(job, success)

    def _fold_store(self, job: Job, success: bool) -> None:
        self.store.complete_store(list(job.keys), success=success)
        if success:
            for (_, _, _, source), key in zip(job.items, job.keys, strict=True):
                self.stored[key] = Content(source[1], tuple(source[2]))
        self.pool.free_blocks(BlockId(b) for _, b, _, _ in job.items)

    def _fold_load(self, job: Job, success: bool) -> None:
        self.store.complete_load(list(job.keys))
        req = self.requests[job.rid]
        if not success:
            self.requests.pop(job.rid)
            self.pool.free_blocks(BlockId(b) for t in req.tables for b in t if b)
            return
        req.loading = False
        for (g, b, end, _), key in zip(job.items, job.keys, strict=True):
            value = self.bytes.read(g, b, UNKNOWN)
            assert value == self.stored[key], "a load brought back other bytes than were stored"
            what = "state" if g == MAMBA else "attention"
            index = end // BS - 1
            self.reads.append(
                (job.rid, g, b, what, index, BS, end, req.tokens[:end], encode(value))
            )

    # ----------------------------------------------------------------- invariants

    def _snapshot(self) -> dict[str, Any]:
        owner: dict[int, int] = {}
        tables = []
        for rid, req in sorted(self.requests.items()):
            for g, table in enumerate(req.tables):
                tables.append((g, rid, tuple(table)))
                owner.update((b, g) for b in table if b)
        for job in self.jobs:
            for g, b, _, _ in job.items:
                owner.setdefault(b, g)
        return {
            "ref_counts": tuple(self.pool.ref_count(BlockId(b)) for b in range(NUM_BLOCKS)),
            "tables": tuple(tables),
            "in_flight": tuple((job.engine_id, job.kind, job.rid, job.items) for job in self.jobs),
            "gpu": tuple(
                (b, encode(self.bytes.read(g, b, UNKNOWN)))
                for b, g in sorted(owner.items())
                if not self._being_loaded(b)
            ),
            "reads": tuple(self.reads[-8:]),
        }

    def _being_loaded(self, block: int) -> bool:
        # A load may be writing the block right now on the engine thread: its bytes are
        # unspecified until the load is folded, and nothing reads them before.
        return any(
            job.kind == "load" and any(b == block for _, b, _, _ in job.items) for job in self.jobs
        )

    @invariant()
    def store_invariants_hold(self) -> None:
        assert check_all("store", self.store.snapshot()) == {}

    @invariant()
    def transfer_invariants_hold(self) -> None:
        assert check_all("system", self._snapshot()) == {}


StoreEngineMachine.TestCase.settings = settings(settings(), stateful_step_count=40)
test_store_engine_machine = StoreEngineMachine.TestCase
