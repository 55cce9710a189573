"""The engine loop of ``hybridkv simulate``: the spec scheduler driving a connector on real bytes.

One step, in vLLM's order (``v1/worker/gpu/kv_connector.py:76-160``):

1. requests whose time has come arrive (a conversation's next turn only after its previous
   turn finished; its prompt is that turn's prompt and answer plus the new message);
2. ``schedule()`` (the spec scheduler, with the connector's claims);
3. the data plane binds the step's connector metadata and starts its loads;
4. the forward: for each scheduled request, the blocks it reads are checked against what
   recomputation would have written (when they did not come from its own earlier forwards, or
   always with ``check``), and the blocks it computes get their true content
   (:class:`hybridkv.sim.content.ContentCodec`);
5. the data plane starts the step's stores (after the forward: a store reads what the forward
   wrote, vLLM #39306), then the transfers done by the step's end are polled and folded into
   the ``KVConnectorOutput`` and the block-level reports of failed loads (which shared
   truncation reads); each block a successful load wrote, and each source a successful store
   read, is checked against recomputation;
6. ``update_from_output`` with one sampled token per request whose prefill is complete.

A transfer is reported in the step the data plane's copy-time model says it completes
(:mod:`hybridkv.sim.copy_time`), so a load may span steps; the model's time is exact, so a run
is deterministic (the same trace and seed give the same report). What that timing made happen
(loads across steps, deadlines, preemptions and aborts during loads) is counted by
:class:`hybridkv.cli.sim_transfers.TransferEvents`; client aborts come from
:class:`hybridkv.sim.aborts.AbortPlan` at the end of a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridkv.cli.sim_transfers import TransferCounts, TransferEvents, tr1_messages
from hybridkv.errors import HybridKVConfigError
from hybridkv.sim.aborts import AbortPlan
from hybridkv.sim.content import ContentCodec, PrefixHashes
from hybridkv.sim.trace import TraceRequest
from spec.connector_api import (
    ConnectorMeta,
    KVConnectorOutput,
    RequestId,
    ScheduledRequest,
    SchedulerConnector,
    TransferJob,
)
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec, cdiv
from spec.scheduler import ClaimOutcome, Request, RequestStatus, Scheduler, SchedulerConfig
from spec.system.parts import failure_reports

__all__ = ["DataPlane", "PlaneStats", "SimResult", "Simulation", "StepSample"]

_VOCAB = 100_000


class PlaneStats(Protocol):
    """What a data plane has moved so far."""

    bytes_loaded: int
    bytes_stored: int
    load_seconds: float
    store_seconds: float
    failures_injected: int


class DataPlane(Protocol):
    """The worker side as the simulation drives it (vLLM's worker hooks, in step order)."""

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs."""
        ...

    def start_load_kv(self) -> None:
        """Start this step's loads (vLLM ``start_load_kv``)."""
        ...

    def wait_for_save(self) -> None:
        """Start this step's stores, after the forward wrote their blocks."""
        ...

    def get_transfer_results(self) -> KVConnectorOutput:
        """Wait for every started job, fold the results (vLLM ``get_transfer_results``)."""
        ...

    def get_block_ids_with_load_errors(self) -> Mapping[RequestId, frozenset[int]]:
        """Per failed load, the blocks its failed jobs left invalid (handed out once)."""
        ...

    def stats(self) -> PlaneStats:
        """Bytes and seconds moved per direction, failures injected."""
        ...

    def store_occupancy(self) -> tuple[int, int]:
        """The host store's ``(used entries, capacity)``."""
        ...

    def store_snapshot(self) -> Mapping[str, Any] | None:
        """The host store's snapshot in the spec's schema (``None``: not available)."""
        ...

    def close(self) -> None:
        """Release threads and memory."""
        ...


@dataclass(frozen=True, slots=True)
class StepSample:
    """One step of the timeline (``--plot``)."""

    step: int
    hit_tokens: int
    loaded_tokens: int
    bytes_loaded: int
    host_used: int
    host_capacity: int


@dataclass
class SimResult:
    """The counts a run ends with (``hybridkv simulate``'s report)."""

    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_loaded: int = 0
    local_hit_tokens: int = 0
    continuation_turns: int = 0
    continuation_hits: int = 0
    continuation_hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    load_jobs: int = 0
    store_jobs: int = 0
    failures_injected: int = 0
    failures_recovered: int = 0
    tokens_discarded_by_recovery: int = 0
    blocks_verified: int = 0
    wrong_content_loads: int = 0
    wrong_content_reads: int = 0
    invariant_checks: int = 0
    invariant_violations: int = 0
    violations: list[str] = field(default_factory=list)
    timeline: list[StepSample] = field(default_factory=list)
    transfers: TransferCounts = field(default_factory=TransferCounts)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from a cache (GPU prefix hit or host load) per prompt token."""
        hits = self.local_hit_tokens + self.prefill_tokens_loaded
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Live:
    """A request the simulation has handed to the scheduler."""

    index: int
    conversation: str | None
    prompt_len: int
    hashes: PrefixHashes
    previous_prompt_len: int | None  # the previous turn's prompt (a conversation turn)
    previous_total: int | None  # ... and its prompt plus answer
    trusted_end: int = 0  # positions [.., trusted_end) were written by its own forwards
    claimed: bool = False
    first_load: int = 0  # tokens its first admission's async load brings, until it resolves
    failed_load: bool = False


class Simulation:
    """One run of a trace through a scheduler, a connector and a data plane (module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        connector: SchedulerConnector,
        plane: DataPlane,
        codec: ContentCodec,
        trace: Sequence[TraceRequest],
        *,
        units: Sequence[int],
        check: bool = False,
        connector_snapshot: Callable[[], Mapping[str, Any]] | None = None,
        max_steps: int = 1_000_000,
        progress: Callable[[int, int], None] | None = None,
        aborts: AbortPlan | None = None,
    ) -> None:
        """Pre: ``connector`` and ``plane`` share one host store; ``codec`` wraps the caches
        the plane moves; ``units`` are the connector's offload units per group (tokens).
        Post: nothing has run."""
        self.config = config
        self.units = tuple(units)
        self.scheduler = Scheduler(config, connector)
        self.plane = plane
        self.codec = codec
        self.trace = tuple(trace)
        self.check = check
        self.connector_snapshot = connector_snapshot
        self.max_steps = max_steps
        self.progress = progress
        self.result = SimResult(requests=len(self.trace))
        self._pending = list(range(len(self.trace)))  # trace indices not yet arrived
        self._live: dict[RequestId, _Live] = {}
        self._conversations: dict[str, tuple[tuple[int, ...], int]] = {}  # tokens, prompt_len
        self._busy: set[str] = set()  # conversations with a turn in flight
        self._load_jobs: dict[int, TransferJob] = {}
        self._store_jobs: set[int] = set()
        self._failed_loads: list[RequestId] = []  # the request of each failed load job
        self._failed_stores = 0
        self.transfers = TransferEvents()
        self.result.transfers = self.transfers.counts
        self.aborts = aborts
        self._abort_seen = 0  # requests of _live given their abort step
        self._abort_at: dict[int, list[RequestId]] = {}  # step -> requests the client cancels

    # ----------------------------------------------------------------- the run
    def run(self) -> SimResult:
        """Run to the end: every request finished and every transfer reported.

        Refusal: a run that passes ``max_steps`` (a wedge) raises :class:`HybridKVConfigError`
        (field ``--requests``) with the step reached.
        """
        start = time.perf_counter()
        step = 0
        while self._has_work():
            step += 1
            if step > self.max_steps:
                raise HybridKVConfigError(
                    "--requests",
                    len(self.trace),
                    f"the run did not finish within {self.max_steps} steps (a wedge)",
                    "report the trace: this is a liveness bug",
                )
            self._step(step)
        self.result.steps = step
        self.result.seconds = time.perf_counter() - start
        stats = self.plane.stats()
        r = self.result
        r.bytes_loaded, r.bytes_stored = stats.bytes_loaded, stats.bytes_stored
        r.load_seconds, r.store_seconds = stats.load_seconds, stats.store_seconds
        r.failures_injected = stats.failures_injected
        counters = self.scheduler.counters
        r.tokens_discarded_by_recovery = (
            counters["tokens_discarded_by_recovery"] + counters["tokens_discarded_by_deadline"]
        )
        for req in self.scheduler.requests.values():
            name = req.status.value
            r.finished[name] = r.finished.get(name, 0) + 1
        # A failed store is recovered when its entry was dropped, never served (content checks
        # would show it); a failed load when its request still finished normally.
        done = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        r.failures_recovered = self._failed_stores + sum(
            1 for rid in self._failed_loads if self.scheduler.requests[rid].status in done
        )
        return r

    def _has_work(self) -> bool:
        if self._pending:
            return True
        s = self.scheduler
        unfinished = any(not r.status.is_finished for r in s.requests.values())
        return unfinished or bool(s.loads or s.parked or s.holds) or self.transfers.in_flight()

    def _step(self, step: int) -> None:
        self._arrive(step)
        output = self.scheduler.schedule()
        meta = output.meta
        for job in meta.load_jobs:
            self._load_jobs[job.job_id] = job
        self._store_jobs.update(job.job_id for job in meta.store_jobs)
        self.result.load_jobs += len(meta.load_jobs)
        self.result.store_jobs += len(meta.store_jobs)
        self.transfers.scheduled(step, output.preempted_ids, output.abandoned_ids, meta)
        self.plane.bind_connector_metadata(meta)
        self.plane.start_load_kv()
        for scheduled in output.scheduled:
            self._forward(scheduled)
        self.plane.wait_for_save()
        kv_output = self.plane.get_transfer_results()
        self.transfers.reported(step, kv_output, self._wrong_store_sources)
        failures = failure_reports(self.scheduler, self.plane.get_block_ids_with_load_errors())
        self._verify_loads(kv_output)
        hit_tokens, loaded_tokens = self._admissions(output)
        sampled = self._sample(output.scheduled)
        before = {rid for rid, r in self.scheduler.requests.items() if r.status.is_finished}
        self.scheduler.update_from_output(output, sampled, kv_output, failures)
        self._settle_first_loads(output.abandoned_ids, kv_output)
        self._after_update(before)
        if self.aborts is not None:
            self._abort_due(step, self.aborts)
        if self.check:
            self._check_invariants(step)
        stats = self.plane.stats()
        used, capacity = self.plane.store_occupancy()
        self.result.timeline.append(
            StepSample(step, hit_tokens, loaded_tokens, stats.bytes_loaded, used, capacity)
        )
        if self.progress is not None:
            done = sum(1 for r in self.scheduler.requests.values() if r.status.is_finished)
            self.progress(done, len(self.trace))

    # ----------------------------------------------------------------- arrivals
    def _arrive(self, step: int) -> None:
        """Hand the scheduler every request whose time has come, in trace order.

        A request is due once ``step`` reaches its ``arrival_step``; a conversation's turn is
        due only when it is the conversation's next turn and the previous one has finished.
        Requests that are not due do not hold back later ones.
        """
        still: list[int] = []
        seen: set[str] = set()  # conversations with an earlier turn still pending
        for index in self._pending:
            item = self.trace[index]
            conv = item.conversation
            due = item.arrival_step <= step and conv not in seen and conv not in self._busy
            if conv is not None:
                seen.add(conv)
            if due:
                self._admit(index, item)
            else:
                still.append(index)
        self._pending = still

    def _admit(self, index: int, item: TraceRequest) -> None:
        previous = self._conversations.get(item.conversation) if item.conversation else None
        tokens = (previous[0] if previous else ()) + item.prompt
        rid = RequestId(f"r{index}")
        self._live[rid] = _Live(
            index,
            item.conversation,
            len(tokens),
            PrefixHashes(tokens),
            previous[1] if previous else None,
            len(previous[0]) if previous else None,
        )
        if item.conversation is not None:
            self._busy.add(item.conversation)
        self.scheduler.add_request(
            Request(rid, tokens, item.max_tokens, cache_salt=item.cache_salt, arrival_step=0)
        )
        self.result.prompt_tokens += len(tokens)

    # ----------------------------------------------------------------- the forward
    def _forward(self, scheduled: ScheduledRequest) -> None:
        rid = scheduled.request.request_id
        live = self._live[rid]
        start = scheduled.num_computed_tokens
        end = start + scheduled.num_scheduled_tokens
        tokens = scheduled.request.token_ids
        if len(live.hashes) < len(tokens):
            live.hashes.extend(tokens[len(live.hashes) :])
        if start > 0 and (self.check or start != live.trusted_end):
            self._verify_reads(scheduled, live, start)
        prompt = live.prompt_len
        self.result.prefill_tokens_computed += max(0, min(end, prompt) - min(start, prompt))
        for g, group in enumerate(self.config.groups):
            table = scheduled.block_ids[g]
            if group.kind is GroupKind.MAMBA:
                slot = cdiv(end, group.block_size) - 1
                if slot < len(table) and table[slot]:
                    self.codec.write_state(g, table[slot], live.hashes, end)
            else:
                self.codec.write_rows(g, table, live.hashes, start, end)
        live.trusted_end = end

    def _verify_reads(self, scheduled: ScheduledRequest, live: _Live, start: int) -> None:
        """Check every block the forward from ``start`` reads (DATA-1 on real bytes)."""
        for g, group in enumerate(self.config.groups):
            table = scheduled.block_ids[g]
            size = group.block_size
            if group.kind is GroupKind.MAMBA:
                slot = cdiv(start, size) - 1
                block = table[slot] if slot < len(table) else 0
                self.result.blocks_verified += 1
                if not block or not self.codec.check_state(g, block, live.hashes, start):
                    self.result.wrong_content_reads += 1
                continue
            low = _window_low(group, start)
            self.result.blocks_verified += cdiv(start, size) - low // size
            self.result.wrong_content_reads += self.codec.check_rows(
                g, table, live.hashes, low, start
            )

    def _verify_loads(self, kv_output: KVConnectorOutput) -> None:
        """Each block a successful load wrote must hold what recomputation would write."""
        for result in kv_output.completed_jobs:
            if result.job_id in self._store_jobs:
                self._store_jobs.discard(result.job_id)
                self._failed_stores += not result.success
                continue
            job = self._load_jobs.pop(result.job_id, None)
            if job is None:
                continue
            if not result.success:
                self._failed_loads.append(job.request_id)
                continue
            live = self._live[job.request_id]
            for item in job.items:
                self.result.blocks_verified += 1
                if not self._unit_holds(live, item.group_idx, item.block_id, item.end_token):
                    self.result.wrong_content_loads += 1

    def _wrong_store_sources(self, job: TransferJob) -> int:
        """Blocks of a finished store whose source no longer holds its key's content (TR-2)."""
        live = self._live[job.request_id]
        return sum(
            not self._unit_holds(live, i.group_idx, i.block_id, i.end_token) for i in job.items
        )

    def _unit_holds(self, live: _Live, g: int, block: int, end: int) -> bool:
        group = self.config.groups[g]
        if group.kind is GroupKind.MAMBA:
            return self.codec.check_state(g, block, live.hashes, end)
        size = group.block_size
        index = (end - 1) // size
        unit_start = max(index * size, end - self.units[g])
        table = [0] * index + [block]
        return self.codec.check_rows(g, table, live.hashes, unit_start, end) == 0

    # ----------------------------------------------------------------- samples and stats
    def _sample(self, scheduled: Iterable[ScheduledRequest]) -> dict[RequestId, int]:
        sampled: dict[RequestId, int] = {}
        for s in scheduled:
            end = s.num_computed_tokens + s.num_scheduled_tokens
            if end >= len(s.request.token_ids):
                rid = s.request.request_id
                index = self._live[rid].index
                sampled[rid] = (end * 2_654_435_761 + index * 40_503) % _VOCAB
        return sampled

    def _admissions(self, output: Any) -> tuple[int, int]:
        """Hit tokens of this step's admissions: the local prefix hit and the claimed load."""
        hits = loaded = 0
        for claim in output.claims:
            if claim.outcome not in (ClaimOutcome.SCHEDULED, ClaimOutcome.WAITING_FOR_REMOTE_KVS):
                continue
            live = self._live[claim.request_id]
            if live.claimed:
                continue  # a re-ask after recovery: the first admission is what a user saw
            live.claimed = True
            hits += claim.num_computed_tokens
            loaded += claim.accepted
            self.result.local_hit_tokens += claim.num_computed_tokens
            self.result.prefill_tokens_loaded += claim.accepted
            if claim.outcome is ClaimOutcome.WAITING_FOR_REMOTE_KVS:
                live.first_load = claim.accepted  # counted; taken back if the load is lost
            if live.previous_prompt_len is not None and live.previous_total is not None:
                self.result.continuation_turns += 1
                reach = claim.num_computed_tokens + claim.accepted
                past = min(reach, live.previous_total) - live.previous_prompt_len
                if past > 0:
                    self.result.continuation_hits += 1
                    self.result.continuation_hit_tokens += past
        return hits + loaded, loaded

    def _settle_first_loads(
        self, abandoned: frozenset[RequestId], kv_output: KVConnectorOutput
    ) -> None:
        """Take back what a request's first load lost: all of it past its deadline, the
        recovered part when it failed; a first load that landed whole keeps its tokens."""
        lost: dict[RequestId, int] = {rid: self._live[rid].first_load for rid in abandoned}
        for record in self.scheduler.recoveries:
            live = self._live[record.request_id]
            if live.first_load:
                lost[record.request_id] = min(live.first_load, max(0, record.discarded))
        for rid in kv_output.finished_recving:
            lost.setdefault(rid, 0)
        for rid, tokens in lost.items():
            if self._live[rid].first_load:
                self.result.prefill_tokens_loaded -= tokens
                self._live[rid].first_load = 0

    def _after_update(self, before: set[RequestId]) -> None:
        for rid, request in self.scheduler.requests.items():
            if rid in before or not request.status.is_finished:
                continue
            live = self._live[rid]
            if live.conversation is not None:
                self._busy.discard(live.conversation)
                self._conversations[live.conversation] = (request.token_ids, live.prompt_len)

    def _abort_due(self, step: int, plan: AbortPlan) -> None:
        """Impatient clients whose patience ran out with no first token cancel their requests
        (:class:`AbortPlan`; vLLM handles an abort between two steps)."""
        if len(self._live) > self._abort_seen:
            for rid in list(self._live)[self._abort_seen :]:  # arrived this step
                patience = plan.patience(self._live[rid].index)
                if patience is not None:
                    self._abort_at.setdefault(step + patience, []).append(rid)
            self._abort_seen = len(self._live)
        due = [
            rid
            for rid in self._abort_at.pop(step, ())
            if not (r := self.scheduler.requests[rid]).status.is_finished and not r.output_token_ids
        ]
        if not due:
            return
        before = {rid for rid, r in self.scheduler.requests.items() if r.status.is_finished}
        for rid in due:
            self.transfers.aborted(rid)
            self.scheduler.abort_request(rid)
        self._after_update(before)

    def _check_invariants(self, step: int) -> None:
        snapshot = self.scheduler.snapshot()
        kv = snapshot["kv_cache_groups"]
        subjects: list[tuple[str, Mapping[str, Any]]] = [
            ("scheduler", snapshot),
            ("kv_cache_groups", kv),
            ("block_pool", kv["block_pool"]),
        ]
        store = self.plane.store_snapshot()
        if store is not None:
            subjects.append(("store", store))
        if self.connector_snapshot is not None:
            subjects.append(("connector", self.connector_snapshot()))
        from spec.invariants import invariants_for

        for subject, snap in subjects:
            self.result.invariant_checks += len(invariants_for(subject))
            for inv_id, messages in check_all(subject, snap).items():
                self.result.invariant_violations += 1
                self.result.violations.append(f"step {step}: {inv_id}: {messages[0]}")
        self.result.invariant_checks += 1  # TR-1 on the jobs in flight, the real schedule's
        tr1 = tr1_messages(self.scheduler, self.transfers)
        if tr1:
            self.result.invariant_violations += 1
            self.result.violations.append(f"step {step}: TR-1: {tr1[0]}")


def _window_low(group: GroupSpec, start: int) -> int:
    if group.kind is GroupKind.SLIDING:
        return max(0, start - group.sliding_window + 1 - group.extra_retained_tokens)
    return 0
