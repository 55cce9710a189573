"""A ``hybridkv simulate`` workload (:mod:`hybridkv.testbed.trace`) played through vLLM 0.33's real
``Scheduler`` with ``HybridKVConnector`` (both roles) in the in-process engine
(:mod:`hybridkv.vllm.harness.inprocess`): the report's token figures counted from what vLLM did.

Arrivals follow the trace's rules (``hybridkv.testbed.trace``): a request arrives once the clock
reaches its ``arrival_step``; a conversation's turn only after its previous turn finished, its
prompt being that turn's prompt and answer (vLLM's own ``all_token_ids``) then its message. The
clock ticks once per loop; an engine step runs only while vLLM has work (``has_requests``), so
``steps`` counts engine steps and ``ticks`` the clock.

The ledger (:class:`_Ledger`) counts each prompt position the first time its KV is in place,
from two observations of vLLM's own calls:

- at admission, ``KVCacheManager.allocate_slots`` receives the local prefix hit
  (``num_new_computed_tokens``) and the connector's tokens (``num_external_computed_tokens``)
  of a request starting from 0 computed tokens;
- each step, ``Scheduler.schedule`` hands the runner ``[c0, c1)`` per request: positions below
  ``c0`` are read (and content-checked by the stand-in forward), ``[c0, c1)`` are computed.

So the first forward after an admission finds ``[served, c0)`` in place without computing it:
below the local hit a GPU hit, above it a host load. A ``c0`` below the admission's
``local + external`` is a load vLLM dropped after a failure (``kv_load_failure_policy=
"recompute"``: it truncates the request's computed tokens, or sends it back to a fresh lookup,
a second admission before any forward); the difference from the largest claim is the tokens
recovery discarded. Positions served before (after
a preemption or a failure) count again, apart, by the cause that took them back. Positions a
forward reads that no admission or forward served are counted as unaccounted reads.

Failed jobs are followed to their recovery by a :class:`JobWatch` (the command line passes the
spec engine's ``RecoveryWatch``, so both engines count recovery alike): each step's jobs are read
from the connector metadata vLLM hands the worker, their results from the worker metadata vLLM
hands back to the scheduler (``kv_connector_worker_meta``), the host store's keys from the
scheduler-side core after ``update_from_output``. The jobs of one admission's load tile
``[local, local + external)`` in job-id order, as the spec engine reads them; a failed load owes
its positions until a forward of its request serves them again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from hybridkv.store.values import LookupResult
from hybridkv.testbed.trace import TraceRequest
from hybridkv.vllm.harness.engine_config import WedgedError
from hybridkv.vllm.harness.inprocess import InProcessEngine

__all__ = [
    "Cause",
    "JobWatch",
    "Source",
    "WorkloadEngine",
    "WorkloadRun",
    "end_state",
    "play_workload",
]


_MISS = LookupResult.MISS


class Source(Enum):
    """Where a prompt position's KV came from."""

    COMPUTED = "computed"
    LOADED = "loaded"
    HIT = "hit"


class Cause(Enum):
    """Why a position was served again."""

    FAILURE = "failure"
    PREEMPTION = "preemption"
    REPLAY = "replay"  # served again with neither cause observed


class JobWatch(Protocol):
    """Follows failed jobs until their recovery is observed (the calls, in a step's order:
    jobs issued, positions served, jobs reported, then the host store's keys)."""

    def load_issued(self, keys: Iterable[bytes]) -> None: ...

    def store_issued(self, job_id: int, keys: Iterable[bytes]) -> None: ...

    def served(self, rid: Any, lo: int, hi: int) -> None: ...

    def store_reported(self, job_id: int, *, success: bool) -> None: ...

    def load_failed(self, rid: Any, lo: int, missing: bytes, wrong_before: int) -> None: ...

    def check_gone(self, holds: Callable[[bytes], bool]) -> None: ...


class _NoWatch:
    """A :class:`JobWatch` that follows nothing (a run without a watch)."""

    def load_issued(self, keys: Iterable[bytes]) -> None:
        """Nothing followed."""

    def store_issued(self, job_id: int, keys: Iterable[bytes]) -> None:
        """Nothing followed."""

    def served(self, rid: Any, lo: int, hi: int) -> None:
        """Nothing followed."""

    def store_reported(self, job_id: int, *, success: bool) -> None:
        """Nothing followed."""

    def load_failed(self, rid: Any, lo: int, missing: bytes, wrong_before: int) -> None:
        """Nothing followed."""

    def check_gone(self, holds: Callable[[bytes], bool]) -> None:
        """Nothing followed."""


@dataclass(frozen=True, slots=True)
class _LoadJob:
    """A load job in flight: its request, the positions ``[lo, hi)`` it brings, and the
    request's wrong reads when it was issued."""

    rid: str
    lo: int
    hi: int
    wrong_before: int


@dataclass(slots=True)
class _Request:
    prompt_len: int
    previous_prompt_len: int | None  # a conversation turn: the previous turn's prompt ...
    previous_total: int | None  # ... and its prompt plus answer
    served: int = 0  # positions [0, served) were in place at least once
    # (local, external, promised) until its first forward; promised: the most an admission
    # since the last forward claimed (a dropped load re-admits the request without a forward)
    admission: tuple[int, int, int] | None = None
    cause: Cause = Cause.REPLAY
    cache_first: list[tuple[int, int]] = field(default_factory=list)  # first served by a cache
    load: tuple[int, int] = (0, 0)  # the last admission's load: next job's start, its end


@dataclass(slots=True)
class WorkloadRun:
    """What a workload run observed (module docstring for how each count is taken).

    ``first`` and ``again`` count prompt positions; ``again`` by (cause, source).
    """

    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    ticks: int = 0
    prompt_tokens: int = 0
    first: dict[Source, int] = field(default_factory=lambda: dict.fromkeys(Source, 0))
    again: dict[tuple[Cause, Source], int] = field(default_factory=dict)
    unaccounted_reads: int = 0
    tokens_discarded_by_recovery: int = 0
    continuation_turns: int = 0
    continuation_hits: int = 0
    continuation_hit_tokens: int = 0
    preemptions: int = 0
    failed_load_requests: int = 0
    failed_load_requests_finished: int = 0
    vllm_local_hits: int = 0  # vLLM's PrefillStats, first admissions only
    vllm_external_hits: int = 0
    external_tokens_handed: int = 0  # num_external_tokens vLLM handed update_state_after_alloc


class _Ledger:
    """First-time and served-again counts per prompt position (module docstring)."""

    def __init__(self, run: WorkloadRun, watch: JobWatch) -> None:
        self.run = run
        self.watch = watch
        self.requests: dict[str, _Request] = {}

    def admitted(self, rid: str, local: int, external: int) -> None:
        r = self.requests[rid]
        r.load = (local, local + external)
        promised = local + external
        if r.admission is not None:  # the earlier admission's load was dropped before a forward
            promised = max(promised, r.admission[2])
        r.admission = (local, external, promised)

    def preempted(self, rid: str) -> None:
        self.requests[rid].cause = Cause.PREEMPTION

    def forward(self, rid: str, c0: int, c1: int) -> None:
        r = self.requests[rid]
        p = r.prompt_len
        admission, r.admission = r.admission, None
        if admission is not None:
            local, _external, promised = admission
            if c0 < promised:  # vLLM dropped (part of) a load: recompute
                self.run.tokens_discarded_by_recovery += promised - c0
                r.cause = Cause.FAILURE
            self._cache(rid, r, min(c0, p), local)
        elif c0 > r.served:
            self.run.unaccounted_reads += min(c0, p) - r.served
        lo, hi = c0, min(c1, p)
        if hi > lo:
            self._count(rid, r, lo, hi, Source.COMPUTED)
            r.served = max(r.served, hi)

    def load_job(self, rid: str, end_tokens: Iterable[int]) -> tuple[int, int]:
        """``[lo, hi)`` of the next job of ``rid``'s load: from where the previous one ended
        to its furthest item, within the admission's load."""
        r = self.requests[rid]
        lo, end = r.load
        hi = max(lo, min(end, max(end_tokens, default=lo)))
        r.load = (hi, end)
        return lo, hi

    def _cache(self, rid: str, r: _Request, end: int, local: int) -> None:
        """``[0, end)`` was in place at the forward: ``[0, local)`` a GPU hit, the rest loaded."""
        for lo, hi, source in ((0, min(local, end), Source.HIT), (local, end, Source.LOADED)):
            if hi > lo:
                first_lo = max(lo, r.served)
                if hi > first_lo:
                    r.cache_first.append((first_lo, hi))
                self._count(rid, r, lo, hi, source)
        r.served = max(r.served, end)

    def _count(self, rid: str, r: _Request, lo: int, hi: int, source: Source) -> None:
        self.watch.served(rid, lo, hi)
        first = max(0, hi - max(lo, r.served))
        again = (hi - lo) - first
        self.run.first[source] += first
        if again:
            key = (r.cause, source)
            self.run.again[key] = self.run.again.get(key, 0) + again

    def continuations(self) -> None:
        """Answer tokens of each turn's previous turn first served from a cache."""
        run = self.run
        for r in self.requests.values():
            if r.previous_prompt_len is None or r.previous_total is None:
                continue
            run.continuation_turns += 1
            past = sum(
                max(0, min(hi, r.previous_total) - max(lo, r.previous_prompt_len))
                for lo, hi in r.cache_first
            )
            if past:
                run.continuation_hits += 1
                run.continuation_hit_tokens += past


def _observe(engine: InProcessEngine, ledger: _Ledger, failed: set[str]) -> None:
    """Watch vLLM's admissions, each step's spans and jobs, the worker's failed loads and the
    job results vLLM hands the scheduler."""
    manager = engine.scheduler.kv_cache_manager
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        fresh = request.num_computed_tokens == 0
        blocks = allocate(request, *args, **kwargs)
        if fresh and blocks is not None and request.request_id in ledger.requests:
            local = kwargs.get("num_new_computed_tokens", 0)
            ledger.admitted(
                request.request_id, local, kwargs.get("num_external_computed_tokens", 0)
            )
        return blocks

    manager.allocate_slots = allocate_slots
    scheduler = engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output
    jobs = _Jobs(engine, ledger)

    def scheduled(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        for rid in output.preempted_req_ids or ():
            ledger.preempted(rid)
        for rid, n in output.num_scheduled_tokens.items():
            c1 = engine.requests[rid].num_computed_tokens
            ledger.forward(rid, c1 - n, c1)
        jobs.issued(getattr(output.kv_connector_metadata, "meta", None))
        return output

    def updated(output: Any, runner_output: Any) -> Any:
        found = update(output, runner_output)
        kv_output = runner_output.kv_connector_output
        jobs.reported(getattr(kv_output, "kv_connector_worker_meta", None))
        return found

    scheduler.schedule, scheduler.update_from_output = scheduled, updated
    worker = engine.worker
    results = worker.get_transfer_results

    def transfer_results(finished: Any) -> Any:
        out = results(finished)
        failed.update(out.failed_recving or ())
        return out

    worker.get_transfer_results = transfer_results


class _Jobs:
    """The connector's jobs between their metadata and their reports (module docstring)."""

    def __init__(self, engine: InProcessEngine, ledger: _Ledger) -> None:
        self.engine, self.ledger, self.watch = engine, ledger, ledger.watch
        self.loads: dict[int, _LoadJob] = {}
        self.stores: set[int] = set()

    def issued(self, meta: Any) -> None:
        """A step's ``ConnectorMeta`` (None: no jobs)."""
        if meta is None:
            return
        wrong = self.engine.tally.wrong_by
        for job in sorted(meta.load_jobs, key=lambda j: j.job_id):
            rid = job.request_id
            lo, hi = self.ledger.load_job(rid, (item.end_token for item in job.items))
            self.loads[job.job_id] = _LoadJob(rid, lo, hi, wrong.get(rid, 0))
            self.watch.load_issued(item.key for item in job.items)
        for job in meta.store_jobs:
            self.stores.add(job.job_id)
            self.watch.store_issued(job.job_id, (item.key for item in job.items))

    def reported(self, worker_meta: Any) -> None:
        """The job results the scheduler side just folded; then which keys the host holds."""
        for report in getattr(worker_meta, "reports", ()):
            if report.job_id in self.stores:
                self.stores.discard(report.job_id)
                self.watch.store_reported(report.job_id, success=report.success)
                continue
            load = self.loads.pop(report.job_id, None)
            if load is not None and not report.success:
                # vLLM drops a failed load whole (recompute): none of its positions is in place.
                owed = b"\x01" * (load.hi - load.lo)
                self.watch.load_failed(load.rid, load.lo, owed, load.wrong_before)
        store = self.engine.scheduler.connector.core.store
        self.watch.check_gone(lambda key: store.status(key) is not _MISS)


def play_workload(
    engine: InProcessEngine,
    trace: Sequence[TraceRequest],
    *,
    max_ticks: int,
    watch: JobWatch | None = None,
) -> WorkloadRun:
    """Play ``trace`` on ``engine`` until every request finished and nothing is in flight;
    ``watch`` follows failed jobs (module docstring).

    Refusal: :class:`~hybridkv.vllm.harness.engine_config.WedgedError` past ``max_ticks`` clock
    ticks or ``engine.settings.max_steps`` engine steps, or with transfer jobs in flight at the end.
    """
    run = WorkloadRun(requests=len(trace))
    ledger = _Ledger(run, _NoWatch() if watch is None else watch)
    failed: set[str] = set()
    _observe(engine, ledger, failed)
    pending = list(range(len(trace)))
    busy: set[str] = set()  # conversations with a turn in flight
    history: dict[str, tuple[list[int], int]] = {}  # conversation -> (tokens, prompt length)
    owner: dict[str, str] = {}  # request id -> conversation
    tick = 0
    while pending or engine.busy():
        tick += 1
        if tick > max_ticks or engine.tally.steps >= engine.settings.max_steps:
            raise WedgedError(f"tick {tick}, step {engine.tally.steps}: the run did not finish")
        still = []
        seen: set[str] = set()
        for index in pending:
            item = trace[index]
            conv = item.conversation
            due = item.arrival_step <= tick and conv not in seen and conv not in busy
            if conv is not None:
                seen.add(conv)
            if not due:
                still.append(index)
                continue
            previous = history.get(conv) if conv is not None else None
            tokens = (previous[0] if previous else []) + list(item.prompt)
            rid = f"r{index}"
            ledger.requests[rid] = _Request(
                len(tokens),
                previous[1] if previous else None,
                len(previous[0]) if previous else None,
            )
            if conv is not None:
                busy.add(conv)
                owner[rid] = conv
            engine.add(rid, tokens, item.max_tokens, cache_salt=item.cache_salt)
            run.prompt_tokens += len(tokens)
        pending = still
        if not engine.busy():
            continue
        for out in engine.step():
            if out.finish_reason is not None and out.request_id in owner:
                conv = owner[out.request_id]
                request = engine.requests[out.request_id]
                history[conv] = (list(request.all_token_ids), request.num_prompt_tokens)
                busy.discard(conv)
    if engine.adapter.pending():
        raise WedgedError(f"{engine.adapter.pending()} transfer jobs still in flight at the end")
    run.ticks, run.steps = tick, engine.tally.steps
    _finish(run, engine, ledger, failed)
    return run


def _finish(run: WorkloadRun, engine: InProcessEngine, ledger: _Ledger, failed: set[str]) -> None:
    for request in engine.requests.values():
        name = request.status.name.lower()
        run.finished[name] = run.finished.get(name, 0) + 1
    ledger.continuations()
    t = engine.tally
    run.preemptions = t.preemptions
    run.vllm_local_hits, run.vllm_external_hits = t.gpu_hits, t.external_hits
    run.external_tokens_handed = engine.clock.external if engine.clock else 0
    run.failed_load_requests = len(failed)
    run.failed_load_requests_finished = sum(
        ledger.requests[rid].served == ledger.requests[rid].prompt_len
        and engine.requests[rid].is_finished()
        for rid in failed
    )


@dataclass(frozen=True, slots=True)
class WorkloadEngine:
    """How ``hybridkv simulate --engine vllm`` builds its engine.

    Attributes:
        num_gpu_blocks / max_model_len / max_num_seqs / max_num_batched_tokens: vLLM's
            ``num_gpu_blocks_override``, ``--max-model-len``, ``--max-num-seqs`` and
            ``--max-num-batched-tokens``.
        host_bytes: the host tier (``host_memory_bytes``; at least one slot).
        policy: ``eviction_policy``.
        fault_rate: probability a load or a store job fails (half before submission, half
            inside the copy, :class:`hybridkv.vllm.harness.cpu_worker.FaultPlan`); ``seed`` seeds
            it.
        delay: polls before a transfer reports
            (:class:`hybridkv.vllm.harness.delayed.DelayedCompletion`).
    """

    num_gpu_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    host_bytes: int
    policy: str = "lru"
    fault_rate: float = 0.0
    seed: int = 0
    delay: int = 1
    max_steps: int = 1_000_000

    def build(self, config_json: dict[str, Any]) -> InProcessEngine:
        """vLLM's Scheduler with ``HybridKVConnector`` over ``config_json`` (recompute on a
        failed load), the worker on CPU tensors."""
        from vllm.config import KVTransferConfig

        from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU
        from hybridkv.vllm.harness.engine_config import EngineSettings

        transfer = KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"eviction_policy": self.policy},
        )
        faults = None
        if self.fault_rate:
            faults = FaultPlan(self.seed, load_rate=self.fault_rate, store_rate=self.fault_rate)
        adapter = HybridKVOnCPU(host_bytes=self.host_bytes, faults=faults, delay=self.delay)
        settings = EngineSettings(
            num_gpu_blocks=self.num_gpu_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_steps=self.max_steps,
        )
        return InProcessEngine(config_json, settings, transfer, adapter)


def end_state(engine: InProcessEngine) -> dict[str, Any]:
    """What the engine, the connector's core and its worker observed by the end of a run, as
    plain values (the report of ``hybridkv simulate --engine vllm`` reads these)."""
    connector = engine.scheduler.connector
    core = connector.core.stats()
    store = connector.core.store.stats()
    report = engine.report(0)
    transfers = report.transfers
    return {
        "block_size": engine.block_size,
        "chunk_size": connector.chunk_size,
        "host_entries": store.capacity,
        "slot_bytes": connector.hybridkv_config.host_memory_bytes // max(1, store.capacity),
        "host_memory_bytes": connector.hybridkv_config.host_memory_bytes,
        "load_jobs": core.load_jobs,
        "store_jobs": core.store_jobs,
        "load_jobs_failed": core.load_jobs_failed,
        "store_jobs_failed": core.store_jobs_failed,
        "jobs_in_flight": core.jobs_in_flight + engine.adapter.pending(),
        "held_blocks": core.held_blocks,
        "pinned_entries": store.pinned,
        "bytes_loaded": transfers.get("bytes_loaded", 0),
        "bytes_stored": transfers.get("bytes_stored", 0),
        "load_faults": transfers.get("load_faults", 0),
        "store_faults": transfers.get("store_faults", 0),
        "slots_checked": report.slots_checked,
        "wrong_reads": report.wrong_reads,
        "wrong_reads_by_request": dict(engine.tally.wrong_by),
        "ended_requests": sorted(
            rid
            for rid, request in engine.requests.items()
            if request.status.name in ("FINISHED_ABORTED", "FINISHED_ERROR")
        ),
        "leaked_blocks": report.leaked_blocks,
        "schedule_us": round(report.schedule_us, 1),
        "connector_us": round(report.connector_us, 1),
    }
