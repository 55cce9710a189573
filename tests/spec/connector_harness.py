"""A fake scheduler for the connector tests: vLLM's call order, tables given by hand.

Not a test module (no ``test_`` prefix); the connector test files import it by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.connector import LoadMode, ReferenceConnector, ReferenceWorker
from spec.connector_api import (
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from spec.hashing import offload_key, request_block_hashes
from spec.kinds import GroupKind
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
Row = tuple[RequestView, tuple[tuple[int, ...], ...], int, int]
"""One scheduled request: view, block table per group, computed before, scheduled now."""


def make(
    kinds: Sequence[GroupKind] = (FULL, MAMBA),
    *,
    block: int = 2,
    capacity: int = 32,
    windows: Sequence[int] = (),
    mode: LoadMode = LoadMode.ASYNC,
    cls: type[ReferenceConnector] = ReferenceConnector,
) -> tuple[ReferenceConnector, ReferenceWorker]:
    """Groups of ``block``-token blocks, hash block 2, chunk 2, a ``capacity``-entry LRU store."""
    planner = HybridOffloadPlanner(tuple((k, block) for k in kinds), 2, 2, 64)
    connector = cls(
        planner, HostStore(capacity), tuple(kinds), 2, 2, sliding_windows=windows, load_mode=mode
    )
    return connector, ReferenceWorker()


def view(rid: str, tokens: Sequence[int], salt: str | None = None) -> RequestView:
    return RequestView(RequestId(rid), tuple(tokens), len(tokens), salt)


def key(tokens: Sequence[int], end: int, group: int, salt: str | None = None) -> bytes:
    """The offload key of the unit ending at ``end`` (hash block 2), computed independently."""
    hashes = request_block_hashes(tuple(tokens), 2, cache_salt=salt)
    return offload_key(hashes[end // 2 - 1], group)


class Harness:
    """Drives a connector and its worker step by step, remembering the last metadata."""

    def __init__(self, connector: ReferenceConnector, worker: ReferenceWorker) -> None:
        self.connector = connector
        self.worker = worker
        self.step_no = 0
        self.meta = ConnectorMeta()

    def step(
        self,
        scheduled: Sequence[Row] = (),
        results: Sequence[tuple[int, bool]] = (),
    ) -> KVConnectorOutput:
        """build_connector_meta -> bind -> fold ``results`` -> update_connector_output."""
        self.step_no += 1
        rows = tuple(ScheduledRequest(v, t, c, n) for v, t, c, n in scheduled)
        self.meta = self.connector.build_connector_meta(StepView(self.step_no, rows))
        self.worker.bind_connector_metadata(self.meta)
        output = self.worker.get_transfer_results(
            tuple(JobResult(JobId(j), ok) for j, ok in results)
        )
        self.connector.update_connector_output(output)
        return output

    def store_all(self, scheduled: Sequence[Row]) -> None:
        """One step that stores, then a step that completes every store job successfully."""
        self.step(scheduled)
        self.step(results=[(job.job_id, True) for job in self.meta.store_jobs])
