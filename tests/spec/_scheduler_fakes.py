"""A scripted scheduler-side connector and small layouts for the scheduler tests."""

from __future__ import annotations

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
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers import GroupSpec
from spec.scheduler import Request, Scheduler, SchedulerConfig


class ScriptedConnector:
    """Answers claims from a script (then NONE) and records every call."""

    def __init__(self, *answers: Claim, delay_free: bool = False) -> None:
        self.answers = list(answers)
        self.delay_free = delay_free
        self.asked: list[tuple[RequestId, int]] = []
        self.allocs: list[tuple[RequestId, BlockTable, int]] = []
        self.finished: list[tuple[RequestId, BlockTable]] = []
        self.outputs: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        self.asked.append((request.request_id, num_computed_tokens))
        return self.answers.pop(0) if self.answers else Claim(ClaimKind.NONE)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, block_ids, num_external_tokens))

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        del step
        return ConnectorMeta()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        self.finished.append((request.request_id, block_ids))
        return self.delay_free


FULL4 = GroupSpec(GroupKind.FULL, 4)
MAMBA4 = GroupSpec(GroupKind.MAMBA, 4)
SLIDING4 = GroupSpec(GroupKind.SLIDING, 4, sliding_window=8)


def config(*groups: GroupSpec, **kw: object) -> SchedulerConfig:
    """Defaults: full+mamba at block 4, 8 usable blocks, budget 16, 2 running."""
    base: dict[str, object] = {
        "groups": groups or (FULL4, MAMBA4),
        "num_blocks": 9,
        "max_num_batched_tokens": 16,
        "max_num_running": 2,
        "hash_block_size": 4,
    }
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def request(rid: str, num_prompt: int = 12, max_tokens: int = 2, **kw: object) -> Request:
    return Request(RequestId(rid), tuple(range(100, 100 + num_prompt)), max_tokens, **kw)  # type: ignore[arg-type]


def done(*rids: str) -> KVConnectorOutput:
    """A report: these loads finished successfully."""
    return KVConnectorOutput(finished_recving=frozenset(RequestId(r) for r in rids))


def failed(*rids: str) -> KVConnectorOutput:
    ids = frozenset(RequestId(r) for r in rids)
    return KVConnectorOutput(finished_recving=ids, failed_recving=ids)


NOTHING = KVConnectorOutput()


def broken(s: Scheduler) -> dict[str, list[str]]:
    """Every SC-* and GR-* invariant that fails on the scheduler's snapshot."""
    snap = s.snapshot()
    found = check_all("scheduler", snap)
    found.update(check_all("kv_cache_groups", snap["kv_cache_groups"]))
    return found
