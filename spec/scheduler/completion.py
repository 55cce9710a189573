"""After the forward: samples, finished and failed loads, recoveries, finishes and frees.

vLLM 0.33 ``Scheduler.update_from_output`` (``v1/core/sched/scheduler.py:2259-2640``) in the
order it runs: failed receives first (``_handle_failed_recving`` 3688-3701), block-level
reports (``_handle_invalid_blocks`` 3703-3783), the per-request outputs (stop checks), errors
finished FINISHED_ERROR (2557-2566), then ``_update_from_kv_xfer_finished`` (3556-3582):
``update_connector_output``, finished receives, finished sends. Finishing follows
``finish_requests``/``_free_request`` (2964-3062): a request aborted during its load keeps its
blocks until the load reports; ``request_finished_all_groups`` returning True keeps them until
``finished_sending``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spec.block_pool import NULL_BLOCK, BlockId
from spec.connector_api import KVConnectorOutput, RequestId
from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.managers.group_spec import cdiv
from spec.scheduler.config import RecoveryMode
from spec.scheduler.loads import Hold
from spec.scheduler.output import SchedulerOutput
from spec.scheduler.recovery import (
    BlockLevelReportError,
    FailureReport,
    RecoveryRecord,
    shared_truncation,
)
from spec.scheduler.request import RequestStatus
from spec.scheduler.state import SchedulerState

__all__ = ["SchedulerCompletion"]

_WFR = RequestStatus.WAITING_FOR_REMOTE_KVS


class SchedulerCompletion(SchedulerState):
    """The half of the scheduler that consumes a step's results."""

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[RequestId, int],
        kv_output: KVConnectorOutput,
        failures: Sequence[FailureReport] = (),
    ) -> None:
        """Apply one step's results: sampled tokens, load reports, failures.

        ``sampled`` gives one token for every scheduled request whose prefill is complete after
        the step; ``failures`` are block-level reports (:class:`FailureReport`).

        Pre: ``output`` is the latest ``schedule()``'s; every report names an outstanding load or
        hold. Post: failed loads recovered per ``config.recovery``, samples appended, stopped
        requests finished, reported loads promoted or released, delayed frees done;
        ``recoveries`` holds this update's recovery records.
        Refusal: a stale output, a missing sample or an unmatched report raises
        :class:`ConfigError`; a block-level report on a multi-group layout outside shared
        truncation raises :class:`BlockLevelReportError` (vLLM's engine error). A refused call
        changes nothing.
        """
        self._check_update(output, sampled, kv_output, failures)
        self.in_flight = {}  # the step's tokens are processed (scheduler.py:2311-2316)
        reports = {f.request_id: f for f in failures}
        recoveries: list[RecoveryRecord] = []
        affected: set[RequestId] = set()
        for rid in sorted(kv_output.failed_recving):
            if rid in self.loads and rid not in self.recv_done:
                affected.add(rid)
                recoveries.append(self._recover_load(rid, reports.pop(rid, None)))
        errors = set(affected) if self.config.recovery is RecoveryMode.VLLM_FAIL else set()
        for report in reports.values():
            hit = self._truncate_holders(report, recoveries)
            affected |= hit
            if self.config.recovery is RecoveryMode.VLLM_FAIL:
                errors |= hit
        self._apply_samples(output, sampled, affected)
        for rid in sorted(errors):
            self._finish(rid, RequestStatus.FINISHED_ERROR)
        self._transfers_finished(kv_output)
        self.recoveries = tuple(recoveries)
        for record in recoveries:
            if record.mode is not RecoveryMode.VLLM_FAIL:
                self.counters["tokens_discarded_by_recovery"] += record.discarded
            self.counters["num_recoveries"] += 1

    def abort_request(self, request_id: RequestId) -> None:
        """Finish a request FINISHED_ABORTED (vLLM ``finish_requests``).

        Pre: none. Post: the request is finished; its blocks are freed now, or when its load
        reports and its stores finish. Refusal: an unknown or already finished request is left
        alone (vLLM skips it too); nothing changes.
        """
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------ checks (no mutation)
    def _check_update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[RequestId, int],
        kv_output: KVConnectorOutput,
        failures: Sequence[FailureReport],
    ) -> None:
        if output.step != self.step:
            raise ConfigError("output", output.step, f"not step {self.step}'s output", _FIX_OUT)
        shared = self.config.recovery is RecoveryMode.SHARED_TRUNCATION
        if failures and len(self.config.groups) > 1 and not shared:
            raise BlockLevelReportError(
                "block-level load failures are not supported with several KV cache groups; "
                "report failed requests through failed_recving"
            )
        for s in output.scheduled:
            rid = s.request.request_id
            r = self.requests[rid]
            done = r.status is RequestStatus.RUNNING and r.num_computed_tokens >= r.num_tokens
            if done and rid not in sampled:
                raise ConfigError("sampled", dict(sampled), f"no token for {rid}", _FIX_SAMPLE)
        for rid in kv_output.finished_recving:
            if not self._load_outstanding(rid):
                raise ConfigError("finished_recving", rid, "no outstanding load", _FIX_REPORT)
        for rid in kv_output.finished_sending:
            if Hold.STORE not in self.holds.get(rid, frozenset()):
                raise ConfigError("finished_sending", rid, "no delayed free", _FIX_REPORT)

    def _load_outstanding(self, rid: RequestId) -> bool:
        if rid in self.parked or (rid in self.loads and rid not in self.recv_done):
            return True
        return Hold.LOAD in self.holds.get(rid, frozenset())

    # ------------------------------------------------------------ recovery
    def _recover_load(self, rid: RequestId, report: FailureReport | None) -> RecoveryRecord:
        """A failed async load, by the configured model (the request stays WFR till promotion)."""
        load = self.loads[rid]
        mode = self.config.recovery
        groups = self.config.groups
        if mode is RecoveryMode.SHARED_TRUNCATION:
            tables = self.kv.get_blocks(rid)
            invalid = report.invalid_blocks if report else _loaded_blocks(self, rid, tables)
            cut = shared_truncation(
                groups, tables, invalid, load.claim_end, self.kv.scheduler_block_size
            )
            point, valid = cut.point, cut.valid_points
        else:
            point, valid = 0, tuple((0,) for _ in groups)
        if mode is not RecoveryMode.VLLM_FAIL:
            self.requests[rid] = self.requests[rid].evolve(num_computed_tokens=point)
            self.failed.add(rid)
        return RecoveryRecord(rid, mode, load.claim_end, point, valid)

    def _truncate_holders(
        self, report: FailureReport, recoveries: list[RecoveryRecord]
    ) -> set[RequestId]:
        """Shared bookkeeping: truncate every request whose table holds an invalid block."""
        invalid = report.invalid_blocks
        hit: set[RequestId] = set()
        for rid, r in list(self.requests.items()):
            if r.status.is_finished or r.status is _WFR:
                continue
            tables = self.kv.get_blocks(rid)
            if not any(b in invalid for t in tables for b in t if b != NULL_BLOCK):
                continue
            cut = shared_truncation(
                self.config.groups,
                tables,
                invalid,
                r.num_computed_tokens,
                self.kv.scheduler_block_size,
            )
            hit.add(rid)
            mode = self.config.recovery
            recoveries.append(
                RecoveryRecord(rid, mode, r.num_computed_tokens, cut.point, cut.valid_points)
            )
            if mode is not RecoveryMode.VLLM_FAIL:
                self._truncate_running(rid, cut.point)
        self.kv.pool.evict_blocks(b for b in invalid if b != NULL_BLOCK)
        return hit

    def _truncate_running(self, rid: RequestId, point: int) -> None:
        if point == 0:
            self.kv.free(rid)  # nothing valid: start over with fresh tables
        self.requests[rid] = self.requests[rid].evolve(num_computed_tokens=point)
        if point < self.requests[rid].num_tokens:
            self.inflight.add(rid)

    # ------------------------------------------------------------ samples and finishing
    def _apply_samples(
        self, output: SchedulerOutput, sampled: Mapping[RequestId, int], skip: set[RequestId]
    ) -> None:
        for s in output.scheduled:
            rid = s.request.request_id
            r = self.requests[rid]
            if rid in skip or r.status is not RequestStatus.RUNNING:
                continue
            if r.num_computed_tokens < r.num_tokens:
                continue  # a prefill chunk: nothing sampled
            token = sampled[rid]
            r = r.evolve(output_token_ids=(*r.output_token_ids, token))
            self.requests[rid] = r
            if token in r.stop_token_ids:
                self._finish(rid, RequestStatus.FINISHED_STOPPED)
            elif len(r.output_token_ids) >= r.max_tokens:
                self._finish(rid, RequestStatus.FINISHED_LENGTH)

    def _set_status(self, rid: RequestId, status: RequestStatus, **changes: int) -> None:
        """Change a request's status, keeping ``num_waiting_for_remote_kvs`` by hand."""
        old = self.requests[rid]
        self.num_waiting_for_remote_kvs += (status is _WFR) - (old.status is _WFR)
        self.requests[rid] = old.evolve(status=status, **changes)

    def _finish(self, rid: RequestId, status: RequestStatus) -> None:
        """vLLM ``finish_requests`` + ``_free_request`` for one request."""
        r = self.requests[rid]
        for queue in (self.running, self.waiting, self.kv_holding):
            if rid in queue:
                queue.remove(rid)
        holds: set[Hold] = set()
        if r.status is _WFR and rid not in self.recv_done:
            holds.add(Hold.LOAD)  # the transfer may still write the blocks
        self.loads.pop(rid, None)
        self.recv_done.discard(rid)
        self.failed.discard(rid)
        self.inflight.discard(rid)
        self._set_status(rid, status)
        self.finished_since.add(rid)
        if self.connector is not None:
            # vLLM frees out-of-window blocks before the connector sees the table (3364-3375),
            # on the processed-token basis: an abort while the step runs leaves its tokens out.
            processed = max(0, r.num_computed_tokens - self.in_flight.get(rid, 0))
            self.kv.remove_skipped_blocks(rid, processed)
            blocks = self._blocks_for_computed(rid, r.num_computed_tokens)
            if self.connector.request_finished_all_groups(r.view(), blocks):
                holds.add(Hold.STORE)
        if holds:
            self.holds[rid] = frozenset(holds)
        else:
            self.kv.free(rid)

    def _blocks_for_computed(self, rid: RequestId, computed: int) -> tuple[tuple[int, ...], ...]:
        """vLLM ``get_block_ids_for_computed_tokens``: attention clipped, mamba whole."""
        tables = []
        for spec, table in zip(self.config.groups, self.kv.get_blocks(rid), strict=True):
            keep = len(table) if spec.kind is GroupKind.MAMBA else cdiv(computed, spec.block_size)
            tables.append(tuple(int(b) for b in table[:keep]))
        return tuple(tables)

    def _release(self, rid: RequestId, hold: Hold) -> None:
        """One holder reported; free when none is left (vLLM: at the first report, D5)."""
        left = self.holds[rid] - {hold}
        if left and not self.config.vllm_exact:
            self.holds[rid] = left
            return
        del self.holds[rid]
        self.kv.free(rid)

    def _transfers_finished(self, kv_output: KVConnectorOutput) -> None:
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        for rid in sorted(kv_output.finished_recving):
            if rid in self.parked:
                parked = self.parked.pop(rid)  # the late report of an abandoned load
                self.kv.pool.free_blocks(reversed(parked.blocks))
            elif rid in self.loads:
                self.recv_done.add(rid)
            elif rid in self.holds:
                self._release(rid, Hold.LOAD)
        for rid in sorted(kv_output.finished_sending):
            if rid in self.holds:
                self._release(rid, Hold.STORE)


def _loaded_blocks(
    state: SchedulerState, rid: RequestId, tables: tuple[tuple[BlockId, ...], ...]
) -> frozenset[BlockId]:
    """A request-level failure: every block the load wrote (past the local hit) is invalid."""
    local = state.loads[rid].num_local_tokens
    found: set[BlockId] = set()
    for spec, table in zip(state.config.groups, tables, strict=True):
        found.update(b for b in table[local // spec.block_size :] if b != NULL_BLOCK)
    return frozenset(found)


_FIX_OUT = "pass the output of the latest schedule()"
_FIX_SAMPLE = "sample one token for every request whose prefill is complete"
_FIX_REPORT = "report only loads and stores the scheduler is waiting for"
