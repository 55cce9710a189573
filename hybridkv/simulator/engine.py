"""The engine loop of ``hybridkv simulate``: the spec scheduler driving a connector on real bytes.

One step, in vLLM's order (``v1/worker/gpu/kv_connector.py:76-160``):

1. requests whose time has come arrive (a conversation's next turn only after its previous
   turn finished; its prompt is that turn's prompt and answer plus the new message);
2. ``schedule()`` (the spec scheduler, with the connector's claims);
3. the data plane binds the step's connector metadata and starts its loads;
4. the forward: for each scheduled request, the blocks it reads are checked against what
   recomputation would have written (when they did not come from its own earlier forwards, or
   always with ``check``), and the blocks it computes get their true content
   (:class:`hybridkv.testbed.content.ContentCodec`);
5. the data plane starts the step's stores (after the forward: a store reads what the forward
   wrote, vLLM #39306), then the transfers done by the step's end are polled and folded into
   the ``KVConnectorOutput`` and the block-level reports of failed loads (which shared
   truncation reads); each block a successful load wrote, and each source a successful store
   read, is checked against recomputation;
6. ``update_from_output`` with one sampled token per request whose prefill is complete.

The report's figures come from the step's events, kept apart from the loop's policy: the
:class:`~hybridkv.simulator.ledger.TokenLedger` counts each prompt token the first time its KV is
in place (a GPU hit at admission, a load job when it lands, a forward) and again when a failure
or a preemption took it back; the :class:`~hybridkv.simulator.recovery.RecoveryWatch` follows
each failed job until its recovery is seen. Neither assumes a load lands in the step that
issued it: a job issued before its request lost its blocks (preemption, abandonment at the
deadline) serves nothing when it lands, and an abandoned load's tokens count when they are
recomputed or reloaded.

A transfer is reported in the step the data plane's copy-time model says it completes
(:mod:`hybridkv.testbed.copy_time`), so a load may span steps; the model's time is exact, so a run
is deterministic (the same trace and seed give the same report). What that timing made happen
(loads across steps, deadlines, preemptions and aborts during loads) is counted by
:class:`hybridkv.simulator.transfers.TransferEvents`; client aborts come from
:class:`hybridkv.testbed.aborts.AbortPlan` at the end of a step; an aborted request's prompt
tokens not yet served are the identity's "unserved" term, and a load it had in flight serves
nothing when it lands.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator.ledger import Cause, Source, TokenLedger
from hybridkv.simulator.plane import DataPlane
from hybridkv.simulator.recovery import RecoveryWatch
from hybridkv.simulator.result import SimResult, StepSample
from hybridkv.simulator.transfers import TransferEvents, tr1_messages
from hybridkv.testbed.aborts import AbortPlan
from hybridkv.testbed.content import ContentCodec, PrefixHashes
from hybridkv.testbed.trace import TraceRequest
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
from spec.scheduler import (
    ClaimOutcome,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from spec.system.parts import failure_reports

__all__ = ["Simulation"]

_VOCAB = 100_000
# Requests that end without their prompt served, by design of how they end.
_ENDED = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


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
    admitted: bool = False  # its GPU hit since it last lost every position is counted
    wrong: int = 0  # blocks it read or loaded that failed the content check


@dataclass(frozen=True, slots=True)
class _LoadJob:
    """A load job in flight: the positions it brings, the ledger epoch it was issued in."""

    job: TransferJob
    lo: int
    hi: int
    epoch: int
    wrong_before: int  # its request's wrong-content count when it was issued


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
        self.ledger = TokenLedger()
        self.watch = RecoveryWatch()
        self._pending = list(range(len(self.trace)))  # trace indices not yet arrived
        self._live: dict[RequestId, _Live] = {}
        self._conversations: dict[str, tuple[tuple[int, ...], int]] = {}  # tokens, prompt_len
        self._busy: set[str] = set()  # conversations with a turn in flight
        self._load_jobs: dict[int, _LoadJob] = {}
        self._store_jobs: set[int] = set()
        # Per request with a load being issued: the next position its jobs start from, the
        # load's end, and the ledger epoch of its admission (jobs tile the load in id order).
        self._load_cursor: dict[RequestId, tuple[int, int, int]] = {}
        self._step_failed = (0, 0)  # failed (loads, stores) reported in this step
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
        self._finish_result()
        return self.result

    def _finish_result(self) -> None:
        r = self.result
        stats = self.plane.stats()
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
        ledger = self.ledger
        r.prefill_tokens_computed = ledger.first[Source.COMPUTED]
        r.prefill_tokens_loaded = ledger.first[Source.LOADED]
        r.local_hit_tokens = ledger.first[Source.HIT]
        r.prompt_tokens_unserved = ledger.unserved_ended
        r.unaccounted_reads = ledger.unaccounted_reads
        r.served_again = {
            cause.value: {source.value: ledger.again[(cause, source)] for source in Source}
            for cause in Cause
        }
        self._continuations()
        outcome = self.watch.outcome(
            lambda rid: self._live[rid].wrong,
            lambda rid: self.scheduler.requests[rid].status in _ENDED,
        )
        r.failed_loads, r.failed_stores = outcome.failed_loads, outcome.failed_stores
        r.recovered_loads, r.recovered_stores = outcome.recovered_loads, outcome.recovered_stores
        r.failures_recovered, r.failures_ended = outcome.recovered, outcome.ended

    def _continuations(self) -> None:
        """Answer tokens of a conversation's previous turn first served from a cache."""
        r = self.result
        for rid, live in self._live.items():
            if live.previous_prompt_len is None or live.previous_total is None:
                continue
            r.continuation_turns += 1
            past = self.ledger.first_served_by_cache(
                rid, live.previous_prompt_len, live.previous_total
            )
            if past > 0:
                r.continuation_hits += 1
                r.continuation_hit_tokens += past

    def _has_work(self) -> bool:
        if self._pending:
            return True
        s = self.scheduler
        unfinished = any(not r.status.is_finished for r in s.requests.values())
        return unfinished or bool(s.loads or s.parked or s.holds) or self.transfers.in_flight()

    def _step(self, step: int) -> None:
        first_before = dict(self.ledger.first)
        self._step_failed = (0, 0)
        self._arrive(step)
        output = self.scheduler.schedule()
        self.transfers.scheduled(step, output.preempted_ids, output.abandoned_ids, output.meta)
        self._schedule_losses(output)
        self._admissions(output)
        self._take_jobs(output.meta)
        self.plane.bind_connector_metadata(output.meta)
        self.plane.start_load_kv()
        for scheduled in output.scheduled:
            self._forward(scheduled)
        self.plane.wait_for_save()
        kv_output = self.plane.get_transfer_results()
        self.transfers.reported(step, kv_output, self._wrong_store_sources)
        failures = failure_reports(self.scheduler, self.plane.get_block_ids_with_load_errors())
        self._job_results(kv_output)
        self._account_forwards(output.scheduled)
        sampled = self._sample(output.scheduled)
        before = {rid for rid, r in self.scheduler.requests.items() if r.status.is_finished}
        self.scheduler.update_from_output(output, sampled, kv_output, failures)
        self._recovery_losses()
        self.watch.check_gone(self.plane.store_holds)
        self._after_update(before)
        if self.aborts is not None:
            self._abort_due(step, self.aborts)
        if self.check:
            self._check_invariants(step)
        self._sample_timeline(step, first_before)
        if self.progress is not None:
            done = sum(1 for r in self.scheduler.requests.values() if r.status.is_finished)
            self.progress(done, len(self.trace))

    def _sample_timeline(self, step: int, first_before: Mapping[Source, int]) -> None:
        first = self.ledger.first
        new = {s: first[s] - first_before.get(s, 0) for s in Source}
        stats = self.plane.stats()
        used, capacity = self.plane.store_occupancy()
        self.result.timeline.append(
            StepSample(
                step,
                new[Source.HIT],
                new[Source.LOADED],
                new[Source.COMPUTED],
                *self._step_failed,
                stats.bytes_loaded,
                used,
                capacity,
            )
        )

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
        self.ledger.add(rid, len(tokens))
        self.result.prompt_tokens += len(tokens)

    # ----------------------------------------------------------------- the ledger's events
    def _schedule_losses(self, output: SchedulerOutput) -> None:
        """A preempted request lost every block; an abandoned load's request restarts from 0."""
        for rid in sorted(output.preempted_ids):
            self._lose(rid, 0, Cause.PREEMPTION)
        for rid in sorted(output.abandoned_ids):
            self._lose(rid, 0, Cause.FAILURE)

    def _recovery_losses(self) -> None:
        """A recovery truncated its request (a failed load, or a block it read was invalid)."""
        for record in self.scheduler.recoveries:
            self._lose(record.request_id, record.truncated_to, Cause.FAILURE)

    def _lose(self, rid: RequestId, keep: int, cause: Cause) -> None:
        self.ledger.lose(rid, keep, cause)
        self._load_cursor.pop(rid, None)
        if keep == 0:
            self._live[rid].admitted = False  # its next admission finds a new GPU hit

    def _admissions(self, output: SchedulerOutput) -> None:
        """The GPU prefix hit of each admission, and the positions its load will bring.

        An async admission's hit is the scheduler's load record (its local tokens); a
        scheduled one's is where its first chunk starts, less what a sync load brings. An
        admission the connector was not asked about (a load still parked, D7) hits up to where
        it starts (:meth:`_account_forwards`).
        """
        starts = {s.request.request_id: s.num_computed_tokens for s in output.scheduled}
        for claim in output.claims:
            rid = claim.request_id
            if claim.outcome is ClaimOutcome.WAITING_FOR_REMOTE_KVS:
                load = self.scheduler.loads[rid]
                hit, end = load.num_local_tokens, load.claim_end
            elif claim.outcome is ClaimOutcome.SCHEDULED:
                end = starts[rid]
                hit = end - claim.accepted
            else:
                continue
            self._serve(rid, Source.HIT, 0, hit)
            self._live[rid].admitted = True
            if end > hit:
                self._load_cursor[rid] = (hit, end, self.ledger.epoch(rid))

    def _take_jobs(self, meta: ConnectorMeta) -> None:
        """Follow the step's jobs: each load job brings the positions from where the previous
        job of its load ended to its last item's end (the jobs of a load tile it in id order)."""
        for job in sorted(meta.load_jobs, key=lambda j: j.job_id):
            rid = job.request_id
            lo, end, epoch = self._load_cursor.get(rid, (0, 0, -1))
            hi = min(end, max(item.end_token for item in job.items))
            self._load_jobs[job.job_id] = _LoadJob(job, lo, hi, epoch, self._live[rid].wrong)
            self._load_cursor[rid] = (hi, end, epoch)
            self.watch.load_issued(item.key for item in job.items)
        for job in meta.store_jobs:
            self._store_jobs.add(job.job_id)
            self.watch.store_issued(job.job_id, (item.key for item in job.items))
        self.result.load_jobs += len(meta.load_jobs)
        self.result.store_jobs += len(meta.store_jobs)

    def _account_forwards(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """Each forward reads ``[0, start)`` (every position must be in place) and computes
        ``[start, end)``."""
        for s in scheduled:
            rid = s.request.request_id
            start = s.num_computed_tokens
            live = self._live[rid]
            if not live.admitted:
                self._serve(rid, Source.HIT, 0, start)  # admitted without a claim
                live.admitted = True
            self.ledger.read(rid, start)
            self._serve(rid, Source.COMPUTED, start, start + s.num_scheduled_tokens)

    def _serve(self, rid: RequestId, source: Source, lo: int, hi: int) -> None:
        if lo < hi:
            self.ledger.serve(rid, source, lo, hi)
            self.watch.served(rid, lo, hi)

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
        wrong = 0
        for g, group in enumerate(self.config.groups):
            table = scheduled.block_ids[g]
            size = group.block_size
            if group.kind is GroupKind.MAMBA:
                slot = cdiv(start, size) - 1
                block = table[slot] if slot < len(table) else 0
                self.result.blocks_verified += 1
                if not block or not self.codec.check_state(g, block, live.hashes, start):
                    wrong += 1
                continue
            low = _window_low(group, start)
            self.result.blocks_verified += cdiv(start, size) - low // size
            wrong += self.codec.check_rows(g, table, live.hashes, low, start)
        self.result.wrong_content_reads += wrong
        live.wrong += wrong

    def _job_results(self, kv_output: KVConnectorOutput) -> None:
        """Fold the reported jobs: a store's outcome, a load's content check, and what each
        load brought to its request (served when it lands, unless the request lost the load
        since it was issued or has finished)."""
        failed_loads = failed_stores = 0
        for result in kv_output.completed_jobs:
            if result.job_id in self._store_jobs:
                self._store_jobs.discard(result.job_id)
                self.watch.store_reported(result.job_id, success=result.success)
                failed_stores += not result.success
                continue
            entry = self._load_jobs.pop(result.job_id, None)
            if entry is None:
                continue
            rid = entry.job.request_id
            live = self._live[rid]
            if not result.success:
                failed_loads += 1
                missing = self.ledger.missing(rid, entry.lo, entry.hi)
                self.watch.load_failed(rid, entry.lo, missing, entry.wrong_before)
                continue
            self._verify_load(entry.job, live)
            current = entry.epoch == self.ledger.epoch(rid)
            if current and not self.scheduler.requests[rid].status.is_finished:
                self._serve(rid, Source.LOADED, entry.lo, entry.hi)
        self._step_failed = (failed_loads, failed_stores)

    def _verify_load(self, job: TransferJob, live: _Live) -> None:
        """Each block a successful load wrote must hold what recomputation would write."""
        for item in job.items:
            self.result.blocks_verified += 1
            if not self._unit_holds(live, item.group_idx, item.block_id, item.end_token):
                self.result.wrong_content_loads += 1
                live.wrong += 1

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

    def _after_update(self, before: set[RequestId]) -> None:
        for rid, request in self.scheduler.requests.items():
            if rid in before or not request.status.is_finished:
                continue
            live = self._live[rid]
            self._load_cursor.pop(rid, None)
            if request.status in _ENDED:
                self.ledger.ended(rid)
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
