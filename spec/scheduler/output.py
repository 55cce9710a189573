"""What one scheduler step hands out and records: the output and the claim record.

``SchedulerOutput`` is the part of vLLM 0.33's ``SchedulerOutput``
(``v1/core/sched/output.py``) the model uses, plus the claims made during the step so the
``SC-1``/``SC-2`` predicates can read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spec.connector_api import ClaimKind, ConnectorMeta, RequestId, ScheduledRequest

__all__ = ["ClaimOutcome", "ClaimRecord", "SchedulerOutput"]


class ClaimOutcome(Enum):
    """What became of a request after the connector answered for it in a step.

    - ``DEFERRED``: the connector said DEFER; skipped, asked again next step.
    - ``WAITING_FOR_REMOTE_KVS``: an async load was allocated; the request waits for it.
    - ``SCHEDULED``: admitted to the running queue (sync load or nothing to load).
    - ``NO_SPACE``: ``allocate_slots`` refused; the request stays at the head of the queue.
    - ``NO_PROGRESS``: the chunk came out empty (budget or split); the request stays queued.
    """

    DEFERRED = "deferred"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    SCHEDULED = "scheduled"
    NO_SPACE = "no_space"
    NO_PROGRESS = "no_progress"


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """One ``get_num_new_matched_tokens`` call and what the scheduler did with the answer.

    Attributes:
        request_id: the request asked for.
        num_computed_tokens: the aligned local hit passed to the connector.
        kind: the connector's answer kind.
        claimed: tokens the connector claimed beyond ``num_computed_tokens``.
        accepted: tokens the scheduler took (``claimed`` unless aligned down, D2).
        unit: the claim unit (the scheduler block size).
        outcome: what happened to the request in this step.
    """

    request_id: RequestId
    num_computed_tokens: int
    kind: ClaimKind
    claimed: int
    accepted: int
    unit: int
    outcome: ClaimOutcome


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's schedule.

    Attributes:
        step: the step number (1 for the first ``schedule()``).
        scheduled: the requests run this step with their block tables after allocation and
            their computed count before the step.
        meta: the connector's jobs for this step (empty without a connector).
        preempted_ids: requests preempted in this step.
        finished_ids: requests finished since the previous step.
        claims: every connector answer of this step.
        abandoned_ids: requests whose load passed its deadline this step (D3).
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    meta: ConnectorMeta
    preempted_ids: frozenset[RequestId]
    finished_ids: frozenset[RequestId]
    claims: tuple[ClaimRecord, ...] = ()
    abandoned_ids: frozenset[RequestId] = frozenset()

    @property
    def num_scheduled_tokens(self) -> dict[RequestId, int]:
        """Request id -> tokens scheduled this step."""
        return {s.request.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens scheduled this step over every request."""
        return sum(s.num_scheduled_tokens for s in self.scheduled)
