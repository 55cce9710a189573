"""The spec side: :class:`spec.scheduler.Scheduler` driven by a trace. Imports no vLLM.

By default the scheduler runs with ``SchedulerConfig(vllm_exact=True)``, the mode that models
vLLM 0.33 exactly; the divergence tests pass other config values (``vllm_exact=False``, a load
deadline, shared truncation) to show what each divergence changes on the same trace.
"""

from __future__ import annotations

from typing import Any

from diffharness.layouts import RECIPES
from diffharness.observe import (
    ClaimObs,
    Hook,
    HookCall,
    Phase,
    RecoveryObs,
    RequestObs,
    StepObservation,
)
from diffharness.trace import (
    ClaimMode,
    FailurePolicy,
    KVReport,
    RequestScript,
    ScriptPlayer,
    Trace,
    sample_token,
)
from spec.block_pool import BlockId
from spec.connector_api import (
    BlockTable,
    Claim,
    ClaimKind,
    ConnectorMeta,
    KVConnectorOutput,
    RequestId,
    RequestView,
    StepView,
)
from spec.scheduler import (
    ClaimOutcome,
    FailureReport,
    RecoveryMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = ["SpecSide", "TraceConnector"]

_KINDS = {
    ClaimMode.DEFER: ClaimKind.DEFER,
    ClaimMode.NONE: ClaimKind.NONE,
    ClaimMode.SYNC: ClaimKind.SYNC,
    ClaimMode.ASYNC: ClaimKind.ASYNC,
}
_ADMITTED = (ClaimOutcome.SCHEDULED, ClaimOutcome.WAITING_FOR_REMOTE_KVS)


def _tables(block_ids: BlockTable) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in t) for t in block_ids)


class TraceConnector:
    """A scheduler-side connector (:class:`spec.connector_api.SchedulerConnector`) whose answers
    come from a trace; it records every call as a :class:`~diffharness.observe.HookCall`."""

    def __init__(self, player: ScriptPlayer, block_sizes: tuple[int, ...]) -> None:
        self.player = player
        self.block_sizes = block_sizes
        self.calls: list[HookCall] = []

    def drain(self) -> tuple[HookCall, ...]:
        """The calls since the last drain."""
        calls, self.calls = tuple(self.calls), []
        return calls

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        mode, tokens = self.player.answer(
            request.request_id, num_computed_tokens, len(request.token_ids)
        )
        self.calls.append(
            HookCall(
                Hook.GET_NUM_NEW_MATCHED_TOKENS,
                request.request_id,
                (num_computed_tokens,),
                answer=(mode.value, tokens),
            )
        )
        return Claim(_KINDS[mode], tokens)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        self.calls.append(
            HookCall(
                Hook.UPDATE_STATE_AFTER_ALLOC,
                request.request_id,
                (num_external_tokens,),
                tables=_tables(block_ids),
            )
        )
        self.player.allocated(
            request.request_id, num_external_tokens, _tables(block_ids), self.block_sizes
        )

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        scheduled = tuple((s.request.request_id, s.num_scheduled_tokens) for s in step.scheduled)
        self.calls.append(
            HookCall(
                Hook.BUILD_CONNECTOR_META,
                None,
                (scheduled, tuple(sorted(step.finished_ids)), tuple(sorted(step.preempted_ids))),
            )
        )
        return ConnectorMeta()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append(
            HookCall(
                Hook.UPDATE_CONNECTOR_OUTPUT,
                None,
                (
                    tuple(sorted(output.finished_recving)),
                    tuple(sorted(output.failed_recving)),
                    tuple(sorted(output.finished_sending)),
                ),
            )
        )
        self.player.saw_output(frozenset(output.finished_recving))

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        hold = self.player.finished(request.request_id)
        self.calls.append(
            HookCall(
                Hook.REQUEST_FINISHED_ALL_GROUPS,
                request.request_id,
                tables=_tables(block_ids),
                answer=(hold,),
            )
        )
        return hold


class SpecSide:
    """The spec scheduler and its scripted connector, one trace at a time.

    ``config_changes`` override :class:`spec.scheduler.SchedulerConfig` fields (the default is
    the vLLM-exact mode); ``name`` labels the side in reports.
    """

    def __init__(self, trace: Trace, *, name: str = "spec", **config_changes: Any) -> None:
        recipe = RECIPES[trace.layout]
        layout = recipe.spec_layout()
        settings = trace.settings
        recovery = {
            FailurePolicy.RECOMPUTE: RecoveryMode.VLLM_RECOMPUTE,
            FailurePolicy.FAIL: RecoveryMode.VLLM_FAIL,
        }[settings.failure_policy]
        fields: dict[str, Any] = {
            "groups": recipe.spec_groups(),
            "num_blocks": settings.num_blocks,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "max_num_running": settings.max_num_seqs,
            "hash_block_size": layout.hash_block_size,
            "recovery": recovery,
            "retention_interval": settings.retention_interval,
            "max_model_len": trace.max_model_len,
            "full_sequence_must_fit": settings.reserve_full_sequence,
            "vllm_exact": True,
        }
        fields.update(config_changes)
        self.name = name
        self.trace = trace
        self.player = ScriptPlayer(trace, layout.scheduler_block_size)
        self.connector = TraceConnector(self.player, tuple(g.block_size for g in fields["groups"]))
        self.scheduler = Scheduler(SchedulerConfig(**fields), self.connector)
        self._output: SchedulerOutput | None = None
        self._sampled: dict[RequestId, int] = {}

    # ------------------------------------------------------------ driving
    def add(self, script: RequestScript) -> None:
        """Add a request of the trace (before this step's schedule)."""
        self.scheduler.add_request(
            Request(
                RequestId(script.request_id),
                script.prompt,
                script.max_tokens,
                cache_salt=script.cache_salt,
                arrival_step=self.scheduler.step,
            )
        )

    def abort(self, request_id: str) -> None:
        """Abort a request (vLLM's ``finish_requests(..., FINISHED_ABORTED)``)."""
        self.scheduler.abort_request(RequestId(request_id))

    def schedule(self) -> StepObservation:
        """``schedule()``, then what the fabricated model samples from this step."""
        output = self.scheduler.schedule()
        self._output = output
        self._sampled = {}
        for s in output.scheduled:
            r = self.scheduler.requests[s.request.request_id]
            if r.status is RequestStatus.RUNNING and r.num_computed_tokens >= r.num_tokens:
                self._sampled[r.request_id] = sample_token(r.request_id, len(r.output_token_ids))
        claims = tuple(
            ClaimObs(c.request_id, c.num_computed_tokens, c.claimed, c.accepted)
            for c in output.claims
            if c.outcome in _ADMITTED
        )
        return self._observe(Phase.SCHEDULE, output, claims, ())

    def update(self, report: KVReport) -> StepObservation:
        """``update_from_output()`` with the sampled tokens and the worker's report."""
        if self._output is None:
            raise RuntimeError("update() before schedule()")
        kv_output = KVConnectorOutput(
            finished_recving=frozenset(RequestId(r) for r in report.finished_recving),
            failed_recving=frozenset(RequestId(r) for r in report.failed_recving),
            finished_sending=frozenset(RequestId(r) for r in report.finished_sending),
        )
        failures = tuple(
            FailureReport(RequestId(rid), frozenset(BlockId(b) for b in blocks))
            for rid, blocks in report.invalid_blocks
        )
        self.scheduler.update_from_output(self._output, self._sampled, kv_output, failures)
        recoveries = tuple(
            RecoveryObs(
                r.request_id,
                r.computed_before,
                "error" if r.mode is RecoveryMode.VLLM_FAIL else "recompute",
                0 if r.mode is RecoveryMode.VLLM_FAIL else r.truncated_to,
            )
            for r in self.scheduler.recoveries
        )
        return self._observe(Phase.UPDATE, None, (), recoveries)

    # ------------------------------------------------------------ observing
    def quiescent(self) -> bool:
        """Every request finished and freed, and no report is still to come."""
        s = self.scheduler
        done = all(r.status.is_finished for r in s.requests.values())
        return done and not s.holds and not s.parked and not self.player.pending()

    def _observe(
        self,
        phase: Phase,
        output: SchedulerOutput | None,
        claims: tuple[ClaimObs, ...],
        recoveries: tuple[RecoveryObs, ...],
    ) -> StepObservation:
        s = self.scheduler
        tables = []
        for rid in sorted(s.requests):
            blocks = s.kv.get_blocks(rid)
            if any(blocks):
                tables.append((str(rid), _tables(blocks)))
        return StepObservation(
            step=s.step,
            phase=phase,
            scheduled=tuple(output.num_scheduled_tokens.items()) if output else (),
            preempted=tuple(sorted(output.preempted_ids)) if output else (),
            finished_ids=tuple(sorted(output.finished_ids)) if output else (),
            requests=tuple(
                RequestObs(
                    str(r.request_id),
                    r.status.value,
                    r.num_computed_tokens,
                    len(r.output_token_ids),
                )
                for _, r in sorted(s.requests.items())
            ),
            running=tuple(s.running),
            waiting=tuple(s.waiting),
            kv_holding=tuple(s.kv_holding),
            tables=tuple(tables),
            num_free_blocks=s.kv.pool.get_num_free_blocks(),
            hooks=self.connector.drain(),
            claims=claims,
            recoveries=recoveries,
        )
