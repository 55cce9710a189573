"""One engine: scheduler, reference connector, worker, host store and content, as discrete events.

The engine is the composition the explorer walks. Its events are the actions of
:mod:`spec.system.model`:

- ``Arrive(r)``: the scheduler receives request ``r``.
- ``Step()``: ``schedule()``; the worker binds the step's connector metadata; the forward
  computes every scheduled token: each block it reads is recorded with the content it holds
  (DATA-1 judges them) and each block it writes gets the TRUE content; the step's jobs are now
  in flight (a store's source is taken after the forward, since vLLM saves after it); finally
  ``update_from_output`` with the sampled tokens and the job results gathered since the last
  step, folded by the worker. Under shared truncation the worker's block-level report (the
  destination blocks of the failed load jobs) goes with them; under vLLM's recovery models the
  connector reports failed requests only, as vLLM 0.33 requires on a multi-group layout.
- ``Complete(job, ok)``: the transfer finished. A load writes the host entry's content into its
  GPU blocks (a failed load leaves garbage there); a store copies its GPU blocks' content into the
  host entries (a failed store writes nothing). The result waits for the next step.
- ``Abort(r)``: the client cancels ``r``.

Deadlines are counted in steps by the scheduler (``load_deadline_steps``).

State kept small for cloning: the scheduler (which owns the connector, which owns the host
store), the worker, two content maps (``gpu``: block id -> value; ``host``: offload key ->
value), the in-flight jobs with their store sources, the pending results, the arrived requests,
and the reads of the last forward. :meth:`Engine.freeze` is the canonical dedup key.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spec.connector_api import (
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    ScheduledRequest,
    TransferItem,
    TransferJob,
    TransferKind,
)
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec, cdiv
from spec.system import parts
from spec.system.content import Content, Garbage, Value, encode

__all__ = ["Engine", "EngineConfig", "InFlight", "Read", "RequestSpec", "sampled_token"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request of a scenario: id, prompt, output budget and isolation salt."""

    request_id: RequestId
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything fixed for one exploration (see :mod:`spec.system.scenarios`).

    Attributes:
        scheduler: the scheduler's configuration (groups, pool, budget, recovery, deadline).
        requests: the scenario's requests, in arrival order.
        chunk_size: the offload chunk in tokens.
        store_capacity: host store entries.
        max_model_len: the longest sequence (the planner's bound).
    """

    scheduler: Any
    requests: tuple[RequestSpec, ...]
    chunk_size: int
    store_capacity: int
    max_model_len: int

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        """The KV cache groups, in group id order."""
        groups: tuple[GroupSpec, ...] = self.scheduler.groups
        return groups


@dataclass(frozen=True, slots=True)
class InFlight:
    """A started job; ``sources`` are the store's block values when it started (loads: none)."""

    job: TransferJob
    sources: tuple[Value, ...] = ()


@dataclass(frozen=True, slots=True)
class Read:
    """One block a forward read: what it needed and what it held."""

    request_id: RequestId
    group_idx: int
    block_id: int
    what: str  # "attention" (positions [index*size, need_end)) or "state" (exact need_end)
    block_index: int
    block_size: int
    need_end: int
    tokens: tuple[int, ...]
    value: Value

    def plain(self) -> tuple[Any, ...]:
        """The snapshot row of :mod:`spec.invariants.system`.

        Pure: the fields in declaration order, the value encoded (:func:`encode`).
        """
        return (
            self.request_id,
            self.group_idx,
            self.block_id,
            self.what,
            self.block_index,
            self.block_size,
            self.need_end,
            self.tokens,
            encode(self.value),
        )


def sampled_token(request_id: str, position: int) -> int:
    """The token a request samples at ``position``: a fixed function, so steps are deterministic.

    Tokens 100 and up never occur in scenario prompts, so generated text is told apart. Pure:
    100 or 101.
    """
    return 100 + (position + len(request_id)) % 2


@dataclass
class Engine:
    """The whole system; mutable, copied by :meth:`clone` before every event."""

    config: EngineConfig
    scheduler: Any
    worker: Any
    gpu: dict[int, Value] = field(default_factory=dict)
    host: dict[bytes, Value] = field(default_factory=dict)
    in_flight: dict[JobId, InFlight] = field(default_factory=dict)
    pending: tuple[JobResult, ...] = ()
    arrived: tuple[RequestId, ...] = ()
    reads: tuple[Read, ...] = ()
    bad_reads: tuple[Read, ...] = ()
    last_output: Any = None
    last_kv_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    # ----------------------------------------------------------------- construction
    @classmethod
    def create(
        cls,
        config: EngineConfig,
        *,
        connector_cls: type[Any] | None = None,
        scheduler_cls: type[Any] | None = None,
    ) -> Engine:
        """A fresh engine: empty pool, empty store, nothing arrived. Pre: a valid config.

        ``connector_cls`` / ``scheduler_cls`` swap in a subclass of the reference connector or
        scheduler (a deliberately broken variant in a test); ``None`` keeps the reference.
        """
        scheduler, worker = parts.build(
            config, connector_cls=connector_cls, scheduler_cls=scheduler_cls
        )
        return cls(config, scheduler, worker)

    def clone(self) -> Engine:
        """An independent copy: mutating one never changes the other.

        Frame: nothing changes in ``self``. Post: the copy's :meth:`freeze` and :meth:`snapshot`
        equal ``self``'s; the last step's outputs are not copied (``last_output`` is None,
        ``last_kv_output`` empty), since only the step that sets them reads them.
        """
        scheduler, worker = parts.clone(self.scheduler, self.worker)
        return type(self)(
            self.config,
            scheduler,
            worker,
            dict(self.gpu),
            dict(self.host),
            dict(self.in_flight),
            self.pending,
            self.arrived,
            self.reads,
            self.bad_reads,
        )

    # ----------------------------------------------------------------- events
    def arrive(self, request_id: RequestId) -> None:
        """The scheduler receives ``request_id``. Pre: it has not arrived."""
        spec = next(r for r in self.config.requests if r.request_id == request_id)
        parts.add_request(self.scheduler, spec)
        self.arrived = (*self.arrived, request_id)

    def abort(self, request_id: RequestId) -> None:
        """The client cancels ``request_id``. Pre: it arrived and is not finished."""
        self.scheduler.abort_request(request_id)

    def complete(self, job_id: JobId, ok: bool) -> None:
        """Job ``job_id`` finished (``ok``) or failed. Pre: it is in flight.

        Post: a load wrote the host entries' content (or garbage on failure) into its blocks; a
        successful store copied its blocks' content into the host entries; the result waits in
        ``pending`` for the next step.
        """
        started = self.in_flight.pop(job_id)
        for item in started.job.items:
            if started.job.kind is TransferKind.LOAD:
                self.gpu[item.block_id] = self._loaded(item) if ok else Garbage("failed load")
            elif ok:
                self.host[item.key] = self._stored(item)
        self.pending = (*self.pending, JobResult(job_id, ok))

    def step(self) -> None:
        """One scheduler step: schedule, bind, forward, start jobs, update (module docstring).

        Pre: none. Post: the scheduled requests' forwards read and wrote ``gpu`` (``reads`` is
        this forward's, a wrong read also joined ``bad_reads``); the step's jobs are in
        flight; the pending results were folded by the worker and delivered (``pending`` is
        empty); ``last_output`` and ``last_kv_output`` are this step's. Never refuses: an error
        a part raises is a model bug and leaves the engine part-way (the explorer steps
        copies only).
        """
        output = self.scheduler.schedule()
        self.worker.bind_connector_metadata(output.meta)
        self.reads = ()
        self._launch(output)
        kv_output = self.worker.get_transfer_results(self.pending)
        failures = parts.failure_reports(
            self.scheduler, self.worker.get_block_ids_with_load_errors()
        )
        self.pending = ()
        sampled = self._sampled(output.scheduled)
        self.scheduler.update_from_output(output, sampled, kv_output, failures)
        self.last_output = output
        self.last_kv_output = kv_output

    def seed_host(
        self, request_id: RequestId, num_tokens: int, groups: tuple[int, ...] = ()
    ) -> None:
        """The host holds READY, with their true content, the units of the first ``num_tokens``
        tokens of request ``request_id``'s prompt (its salt included), as if an earlier request
        with that prompt had stored them. ``groups`` limits the groups (empty: all).

        Pre: ``request_id`` is one of the config's requests; the store has room.
        """
        spec = next(r for r in self.config.requests if r.request_id == request_id)
        for group_idx, key, end in parts.seed_host(self.scheduler, spec, num_tokens, groups):
            self.host[key] = Content(group_idx, spec.prompt[:end])

    def reset_prefix_cache(self) -> bool:
        """vLLM ``reset_prefix_cache`` on the GPU pool: every GPU cache entry dropped.

        Returns whether it happened: refused (nothing changes) while any block is in use, as
        vLLM refuses; the host tier is kept (:func:`spec.system.parts.reset_prefix_cache`).
        """
        return parts.reset_prefix_cache(self.scheduler)

    # ----------------------------------------------------------------- the forward
    def _launch(self, output: Any) -> None:
        """The forward, then the step's jobs: a store reads its blocks after the compute that
        wrote them (vLLM saves after the forward and orders the copy behind it, #39306)."""
        for request in output.scheduled:
            self._forward(request)
        self._start_jobs(output.meta)

    def _start_jobs(self, meta: Any) -> None:
        """Put the step's jobs in flight; a store takes its blocks' values as its source."""
        for job in meta.load_jobs:
            self.in_flight[job.job_id] = InFlight(job)
        for job in meta.store_jobs:
            sources = tuple(self.gpu.get(i.block_id, Garbage("unwritten")) for i in job.items)
            self.in_flight[job.job_id] = InFlight(job, sources)

    def _forward(self, request: ScheduledRequest) -> None:
        start = request.num_computed_tokens
        end = start + request.num_scheduled_tokens
        for group_idx, group in enumerate(self.config.groups):
            table = _Table(
                request.request.request_id,
                group_idx,
                group,
                request.block_ids[group_idx],
                request.request.token_ids,
            )
            for read in _reads(table, start, self.gpu):
                self.reads = (*self.reads, read)
                if not _read_ok(read):
                    self.bad_reads = (*self.bad_reads, read)
            for block_id, value in _writes(table, start, end):
                self.gpu[block_id] = value

    def _sampled(self, scheduled: tuple[ScheduledRequest, ...]) -> dict[RequestId, int]:
        sampled = {}
        for request in scheduled:
            end = request.num_computed_tokens + request.num_scheduled_tokens
            if end >= len(request.request.token_ids):
                sampled[request.request.request_id] = sampled_token(request.request.request_id, end)
        return sampled

    def _loaded(self, item: TransferItem) -> Value:
        return self.host.get(item.key, Garbage("no host content"))

    def _stored(self, item: TransferItem) -> Value:
        value = self.gpu.get(item.block_id, Garbage("unwritten"))
        kind = self.config.groups[item.group_idx].kind
        if isinstance(value, Content) and kind is not GroupKind.MAMBA:
            # The entry keeps the chunk's positions only; later decode writes are not in it.
            return Content(value.group_idx, value.prefix[: item.end_token])
        return value

    # ----------------------------------------------------------------- observation
    def snapshot(self) -> dict[str, Any]:
        """The plain snapshot the TR-* and DATA-* predicates read (``spec.invariants.system``).

        Frame: nothing changes. Post: ``ref_counts``, ``tables``, ``in_flight`` (with the
        stores' encoded sources), ``gpu`` (encoded) and ``reads`` (the last forward's, then
        every wrong read, each once).
        """
        return {
            "ref_counts": parts.ref_counts(self.scheduler),
            "tables": parts.tables(self.scheduler),
            "in_flight": tuple(_plain_job(f) for _, f in sorted(self.in_flight.items())),
            "gpu": tuple((b, encode(v)) for b, v in sorted(self.gpu.items())),
            "reads": tuple(r.plain() for r in dict.fromkeys((*self.reads, *self.bad_reads))),
        }

    def freeze(self) -> Hashable:
        """The canonical dedup key: everything that decides the future, nothing else.

        The last forward's reads are left out (they are the past); wrong reads stay (sticky), so
        a merged state cannot hide a DATA-1 violation. The recovery mode is in the key: engines
        that differ only in it act alike until a load fails, and must not be merged before.
        Frame: nothing changes.
        """
        return (
            self.config.scheduler.recovery,
            parts.freeze(self.scheduler, self.worker),
            tuple(sorted((b, v) for b, v in self.gpu.items())),
            tuple(sorted(self.host.items())),
            tuple(sorted(self.in_flight.items())),
            tuple(sorted(self.pending, key=lambda r: r.job_id)),
            self.arrived,
            self.bad_reads,
        )

    def statuses(self) -> Mapping[RequestId, str]:
        """Each arrived request's status name.

        Pure: a fresh dict, in arrival order.
        """
        return parts.statuses(self.scheduler, self.arrived)

    def jobs_of(self, request_id: RequestId) -> tuple[JobId, ...]:
        """The in-flight jobs of ``request_id``.

        Pure: in the order they started; empty for a request with none (or an unknown id).
        """
        return tuple(j for j, f in self.in_flight.items() if f.job.request_id == request_id)


def _plain_job(started: InFlight) -> tuple[Any, ...]:
    job = started.job
    sources = started.sources or (None,) * len(job.items)
    items = tuple(
        (i.group_idx, i.block_id, i.end_token, None if s is None else encode(s))
        for i, s in zip(job.items, sources, strict=True)
    )
    return (int(job.job_id), job.kind.value, job.request_id, items)


def _read_ok(read: Read) -> bool:
    from spec.system.content import attention_holds, state_holds

    if read.what == "state":
        return state_holds(read.value, read.group_idx, read.tokens, read.need_end)
    return attention_holds(
        read.value,
        read.group_idx,
        read.tokens,
        block_index=read.block_index,
        block_size=read.block_size,
        need_end=read.need_end,
    )


@dataclass(frozen=True, slots=True)
class _Table:
    """One request's blocks in one group during a forward, with the tokens they serve."""

    request_id: RequestId
    group_idx: int
    group: GroupSpec
    blocks: tuple[int, ...]
    tokens: tuple[int, ...]

    def read(self, index: int, what: str, need_end: int, gpu: Mapping[int, Value]) -> Read:
        """What the forward finds in the block at table ``index`` (garbage past the table)."""
        block = self.blocks[index] if index < len(self.blocks) else 0
        value = gpu.get(block, Garbage("unwritten")) if block else Garbage("null block")
        size = self.group.block_size
        return Read(
            self.request_id,
            self.group_idx,
            block,
            what,
            index,
            size,
            need_end,
            self.tokens[:need_end],
            value,
        )


def _reads(table: _Table, start: int, gpu: Mapping[int, Value]) -> list[Read]:
    """What the forward from ``start`` reads in one group (computed before this step)."""
    group = table.group
    size = group.block_size
    if start == 0:
        return []
    if group.kind is GroupKind.MAMBA:
        return [table.read(cdiv(start, size) - 1, "state", start, gpu)]
    low = 0
    if group.kind is GroupKind.SLIDING:
        # The first new token attends to the window ending at itself: [start - w + 1, start).
        low = max(0, start - group.sliding_window + 1 - group.extra_retained_tokens)
    return [
        table.read(i, "attention", min((i + 1) * size, start), gpu)
        for i in range(low // size, cdiv(start, size))
    ]


def _writes(table: _Table, start: int, end: int) -> list[tuple[int, Value]]:
    """The blocks the forward over ``[start, end)`` writes, with their true content."""
    size = table.group.block_size
    blocks, tokens, group_idx = table.blocks, table.tokens, table.group_idx
    if end <= start:
        return []
    if table.group.kind is GroupKind.MAMBA:
        # Align mode keeps one state: the one after the last computed token, in its block.
        index = cdiv(end, size) - 1
        return [(blocks[index], Content(group_idx, tokens[:end]))] if blocks[index] else []
    return [
        (blocks[i], Content(group_idx, tokens[: min((i + 1) * size, end)]))
        for i in range(start // size, cdiv(end, size))
        if blocks[i]
    ]
