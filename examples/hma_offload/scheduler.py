"""The scheduler side: which tokens a request may load, and which blocks each step stores.

Plain Python over hybridkv's pieces, no vLLM, so it can be tested on its own
(tests/example_connector):

- keys: :func:`hybridkv.hashing.make_offload_key` on vLLM's own ``request.block_hashes`` (one
  key per group block; the group index in the key keeps a sliding and a full block of the same
  tokens apart);
- claims: :func:`hybridkv.connector.decide_claim` over the host store's statuses (every claim
  ends on the claim alignment, SC-1; a sliding group needs its window's units only; a key still
  STORING defers the request instead of claiming short);
- the store: :class:`hybridkv.store.HostStore` keeps the entries, slots and LRU order; a load
  pins its keys (``prepare_load``) until it reports (``complete_load``), so eviction never takes
  a slot being read (ST-4, ST-5); a store reserves STORING entries (``prepare_store``) that no
  claim can load until the copy reports (``complete_store``, MB-6).

The worker copies synchronously inside the step that carries the job (worker.py), so a store's
source blocks are read before any later step can reuse them (TR-1, TR-2) and a request's blocks
are never held past its finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from examples.hma_offload.layout import Layout
from hybridkv.connector import ClaimDecision, decide_claim
from hybridkv.hashing import make_offload_key
from hybridkv.store import HostStore, Refusal
from hybridkv.transfer import TransferPair

NULL_BLOCK = 0  # vLLM's placeholder for a block a sliding window no longer holds


class JobKind(Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class Job:
    """One copy the worker runs: ``pairs`` of (group, GPU block, host slot)."""

    job_id: int
    kind: JobKind
    pairs: tuple[TransferPair, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's jobs: loads run before its forward, stores after it."""

    loads: tuple[Job, ...] = ()
    stores: tuple[Job, ...] = ()


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A request's step as the store sees it: its hashes, block table, and the prompt tokens
    ``[start, end)`` this step's forward computes."""

    hashes: Sequence[bytes]
    table: Sequence[Sequence[int]]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class _Unit:
    group: int
    block: int
    key: bytes


class OffloadScheduler:
    """Claims, load jobs and store jobs over one :class:`HostStore` (module docstring)."""

    def __init__(self, layout: Layout, host_slots: int) -> None:
        self.geometry = layout.geometry()
        self.store = HostStore(host_slots, "lru")
        self._claims: dict[str, tuple[int, int]] = {}  # request id -> claimed [start, end)
        self._loads: list[Job] = []  # built at allocation, emitted with the next step
        self._in_flight: dict[int, tuple[JobKind, tuple[bytes, ...]]] = {}
        self._next_job = 0
        self.hit_tokens = 0  # tokens vLLM accepted from the host (observed, not estimated)

    def _key_of(self, hashes: Sequence[bytes]) -> Callable[[int, int], bytes]:
        """Unit ``j`` of group ``g`` is keyed by the hash of its last hash block."""
        strides = self.geometry.strides
        return lambda g, j: make_offload_key(hashes[(j + 1) * strides[g] - 1], g)

    def claim(
        self, request_id: str, hashes: Sequence[bytes], num_tokens: int, start: int
    ) -> ClaimDecision:
        """The claim rule's answer: ``end`` (``start`` when the host holds nothing to load),
        or ``defer`` (ask again later: a key it needs is still being stored). Pure but for
        remembering a claim, which :meth:`allocated` turns into a load."""
        decision = decide_claim(
            self.geometry,
            self._key_of(hashes),
            num_tokens,
            start,
            status=self.store.status,
            failed=(),  # a failed load stops the engine (worker.py): nothing to remember
        )
        self._claims.pop(request_id, None)
        if decision.end > start:  # a deferred decision ends at start (decide_claim)
            self._claims[request_id] = (start, decision.end)
        return decision

    def allocated(
        self, request_id: str, hashes: Sequence[bytes], table: Sequence[Sequence[int]], n: int
    ) -> None:
        """vLLM gave the claimed tokens blocks: pin their keys and build the load job."""
        start, end = self._claims.pop(request_id, (0, 0))
        if end - start != n:
            raise RuntimeError(f"{request_id}: vLLM allocated {n} tokens, {end - start} claimed")
        self.hit_tokens += n
        units: list[_Unit] = []
        before = 0
        for g, unit in enumerate(self.geometry.units):
            first = self.geometry.first_needed(g, start, end)
            needed = range(first, end // unit)
            units += self._units(g, unit, needed, hashes, table)
            if len(units) - before != len(needed):  # vLLM allocates every needed block
                raise RuntimeError(f"{request_id}: group {g} has no block for a claimed unit")
            before = len(units)
        keys = tuple(u.key for u in units)
        if isinstance(self.store.prepare_load(keys), Refusal):
            raise RuntimeError(f"{request_id}: a claimed key left the host before its load")
        self._loads.append(self._job(JobKind.LOAD, units, keys))

    def plan_step(self, scheduled: Iterable[Scheduled]) -> StepPlan:
        """The step's loads, and one store per request of the units its forward completes."""
        stores = []
        for row in scheduled:
            units: list[_Unit] = []
            for g, unit in enumerate(self.geometry.units):
                done = range(row.start // unit, row.end // unit)
                units += self._units(g, unit, done, row.hashes, row.table)
            reserved = self.store.prepare_store(tuple(u.key for u in units))
            if isinstance(reserved, Refusal) or not reserved.keys_to_store:
                continue  # a full host of pinned entries, or everything already there
            new = set(reserved.keys_to_store)
            stores.append(
                self._job(JobKind.STORE, [u for u in units if u.key in new], reserved.keys_to_store)
            )
        loads, self._loads = tuple(self._loads), []
        return StepPlan(loads, tuple(stores))

    def reported(self, results: Iterable[tuple[int, bool]]) -> None:
        """The worker's results: loads unpin their keys, stores become READY (or leave)."""
        for job_id, success in results:
            kind, keys = self._in_flight.pop(job_id)
            if kind is JobKind.LOAD:
                self.store.complete_load(keys)
            else:
                self.store.complete_store(keys, success)

    def forget(self, request_id: str) -> None:
        self._claims.pop(request_id, None)

    def _units(
        self,
        g: int,
        unit: int,
        indices: range,
        hashes: Sequence[bytes],
        table: Sequence[Sequence[int]],
    ) -> list[_Unit]:
        key_of, blocks, found = self._key_of(hashes), table[g], []
        per_block = self.geometry.blocks[g] // unit  # 1: the unit is the block (layout.py)
        for j in indices:
            block = blocks[j // per_block] if j // per_block < len(blocks) else NULL_BLOCK
            if block != NULL_BLOCK:
                found.append(_Unit(g, block, key_of(g, j)))
        return found

    def _job(self, kind: JobKind, units: Sequence[_Unit], keys: tuple[bytes, ...]) -> Job:
        slots = self.store.slots(keys)
        slot_of = dict(zip(keys, slots, strict=True))
        pairs = tuple(TransferPair(u.group, u.block, slot_of[u.key]) for u in units)
        self._next_job += 1
        self._in_flight[self._next_job] = (kind, keys)
        return Job(self._next_job, kind, pairs)
