"""The v1 scheduler of vLLM 0.33 with an external KV connector, and our stronger contract.

- :mod:`spec.scheduler.request`: :class:`Request` (an immutable value) and :class:`RequestStatus`.
- :mod:`spec.scheduler.config`: :class:`SchedulerConfig`, :class:`RecoveryMode` and the
  catalogue of divergences from vLLM 0.33 (D1-D7).
- :mod:`spec.scheduler.split`: the mamba block-aligned split.
- :mod:`spec.scheduler.loads`: async loads in flight, parked (abandoned) loads, delayed frees.
- :mod:`spec.scheduler.recovery`: the recovery models, :class:`FailureReport`, shared truncation.
- :mod:`spec.scheduler.output`: :class:`SchedulerOutput` and the claim records.
- :mod:`spec.scheduler.state`: the state, its copy, freeze and snapshot.
- :mod:`spec.scheduler.completion`: ``update_from_output``, finishing and freeing.
- :mod:`spec.scheduler.scheduler`: ``schedule()`` (:class:`Scheduler`).

The ``SC-*`` invariants read :meth:`Scheduler.snapshot` (:mod:`spec.invariants.scheduler`).
"""

from __future__ import annotations

from spec.scheduler.config import RecoveryMode, SchedulerConfig
from spec.scheduler.loads import Hold, LoadRecord, ParkedLoad
from spec.scheduler.output import ClaimOutcome, ClaimRecord, SchedulerOutput
from spec.scheduler.recovery import (
    BlockLevelReportError,
    FailureReport,
    RecoveryRecord,
    Truncation,
    shared_truncation,
)
from spec.scheduler.request import Request, RequestStatus, block_hashes
from spec.scheduler.scheduler import ConnectorContractError, Scheduler
from spec.scheduler.split import mamba_block_aligned_split

STUCK_INVARIANT_ID = "SC-3"
"""The id under which an explorer reports a non-final state without actions (a wedge)."""

__all__ = [
    "STUCK_INVARIANT_ID",
    "BlockLevelReportError",
    "ClaimOutcome",
    "ClaimRecord",
    "ConnectorContractError",
    "FailureReport",
    "Hold",
    "LoadRecord",
    "ParkedLoad",
    "RecoveryMode",
    "RecoveryRecord",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Truncation",
    "block_hashes",
    "mamba_block_aligned_split",
    "shared_truncation",
]
