"""The bookkeeping of :class:`hybridkv.connector.ConnectorCore` that no claim or load shows at
once: each count of ``stats()`` adds every event, the snapshot carries each load's claim and each
job's salt, a request's stores are counted one by one, a refused pin is refused whole, and a
step's mixed NORMAL and LOW units are stored each at its own priority.

Each test was written for mutants mutmut left alive in ``tools/mutants.py``'s run over
``hybridkv/connector/core.py`` (docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from small_core import mamba_full_core

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    LoadMode,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
    TransferJob,
)
from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore, PrepareLoadOutput, Refusal

FULL, MAMBA, SLIDING = GroupKind.FULL, GroupKind.MAMBA, GroupKind.SLIDING
TABLE = tuple(tuple(1 + g * 1000 + i for i in range(9)) for g in range(2))


def _view(rid: str, first: int, salt: str | None = None) -> RequestView:
    tokens = tuple(range(first, first + 33))  # 33 tokens: 32 claimable, 8 units of 4
    return RequestView(RequestId(rid), tokens, len(tokens), salt)


def _report(core: ConnectorCore, jobs: Sequence[TransferJob], ok: bool = True) -> None:
    done = tuple(JobResult(JobId(job.job_id), ok) for job in jobs)
    core.update_connector_output(KVConnectorOutput(completed_jobs=done))


def _store_step(core: ConnectorCore, view: RequestView, step: int, start: int) -> TransferJob:
    row = ScheduledRequest(view, TABLE, start, 8)
    (job,) = core.build_connector_meta(StepView(step, (row,))).store_jobs
    return job


def test_every_count_adds_each_of_its_events() -> None:
    core = mamba_full_core(64)
    core.seed(_view("seed", 1), 16)
    a, e = _view("A", 1), _view("E", 1)
    claim = core.get_num_new_matched_tokens(a, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 16)
    core.update_state_after_alloc(a, TABLE, 16)
    loads_a = core.build_connector_meta(StepView(1, ())).load_jobs
    for _ in range(2):  # asked again while its load is in flight
        assert core.get_num_new_matched_tokens(a, 0).kind is ClaimKind.DEFER
    claim = core.get_num_new_matched_tokens(e, 4)  # the first 4 tokens computed already
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 12)
    core.update_state_after_alloc(e, TABLE, 12)
    loads_e = core.build_connector_meta(StepView(2, ())).load_jobs
    # B stores units no one holds yet; D, with B's tokens, waits for them (STORING), twice.
    b, d = _view("B", 500), _view("D", 500)
    store_b = _store_step(core, b, 3, 0)
    for _ in range(2):
        assert core.get_num_new_matched_tokens(d, 0).kind is ClaimKind.DEFER
    c = _view("C", 900)
    store_c = _store_step(core, c, 4, 0)
    assert core.request_finished_all_groups(b, TABLE) is True
    assert core.request_finished_all_groups(c, TABLE) is True
    stats = core.stats()
    assert (stats.lookups, stats.deferred) == (6, 4)
    assert (stats.claims, stats.claimed_tokens, stats.loaded_tokens) == (2, 28, 28)
    assert stats.load_jobs == len(loads_a) + len(loads_e)
    assert stats.load_items == sum(len(j.items) for j in (*loads_a, *loads_e))
    assert stats.store_jobs == 2
    assert stats.store_items == len(store_b.items) + len(store_c.items)
    assert stats.delayed_frees == 2
    assert core.counts() == tuple(stats)[:14]


def _plain_loads(core: ConnectorCore) -> dict[str, tuple[object, ...]]:
    return {load[0]: load[1:6] for load in core.snapshot()["loads"]}


@pytest.mark.parametrize("mode", list(LoadMode))
def test_the_snapshot_carries_each_loads_claim_and_each_jobs_salt(mode: LoadMode) -> None:
    planner = HybridOffloadPlanner(((FULL, 4), (MAMBA, 4)), 2, 4, 1 << 14)
    core = ConnectorCore(planner, HostStore(64), (FULL, MAMBA), 2, 4, load_mode=mode)
    view = _view("A", 1, salt="tenant")
    core.seed(view, 16)
    claim = core.get_num_new_matched_tokens(view, 0)
    assert claim.num_tokens == 16
    core.update_state_after_alloc(view, TABLE, 16)
    sync = mode is LoadMode.SYNC
    assert _plain_loads(core) == {"A": (0, 16, 33, sync, "tenant")}
    jobs = core.snapshot()["jobs"]
    assert jobs
    assert {job[1:5] for job in jobs} == {("load", "A", "tenant", sync)}


class _LosingStore(HostStore):
    """A host store that loses an entry between the look-up and the pin (what a store shared
    with another reader could do): it answers READY, then refuses the pin."""

    def prepare_load(self, keys: Sequence[bytes]) -> PrepareLoadOutput | Refusal:
        return Refusal.MISSING


def test_a_pin_the_store_refuses_is_refused_whole_and_records_nothing() -> None:
    planner = HybridOffloadPlanner(((FULL, 4), (MAMBA, 4)), 2, 4, 1 << 14)
    core = ConnectorCore(planner, _LosingStore(64), (FULL, MAMBA), 2, 4)
    view = _view("A", 1)
    core.seed(view, 16)
    assert core.get_num_new_matched_tokens(view, 0).num_tokens == 16
    with pytest.raises(HybridKVConfigError) as caught:
        core.update_state_after_alloc(view, TABLE, 16)
    e = caught.value
    assert (e.field, e.value, e.problem, e.fix) == (
        "num_external_tokens",
        16,
        "not ready",
        "ask again",
    )
    assert str(e) == "num_external_tokens=16: not ready; ask again"
    assert core.build_connector_meta(StepView(1, ())).load_jobs == ()
    assert core.stats().load_jobs == 0


class _Pool:
    """A GPU block pool that counts references (touch +1, free -1)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}

    def touch(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        for b in ordered_blocks:
            self.refs[b] -= 1


def test_a_requests_stores_report_one_by_one() -> None:
    """Two store jobs of one finished request: its free waits for both, and the held count
    follows each report."""
    core = mamba_full_core(64)
    pool = _Pool()
    core.bind_gpu_block_pool(pool)
    view = _view("A", 1)
    first = _store_step(core, view, 1, 0)
    second = _store_step(core, view, 2, 8)
    held = len(first.items) + len(second.items)
    assert core.stats().held_blocks == held
    assert core.request_finished_all_groups(view, TABLE) is True
    _report(core, [first])
    assert core.delayed_requests() == {view.request_id}  # the second store still reads
    assert core.stats().held_blocks == len(second.items) == sum(pool.refs.values())
    _report(core, [second])
    assert core.delayed_requests() == frozenset()
    assert core.stats().held_blocks == 0 == sum(pool.refs.values())


def test_a_step_stores_its_normal_and_low_units_together() -> None:
    """Full attention and a sliding window over one step: at each end the sliding unit that
    no claim of the prompt reads goes LOW, the full unit NORMAL, and both are stored; a second
    request with the prompt then claims every full unit it needs."""
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 4, 4, 1 << 14)
    core = ConnectorCore(planner, HostStore(64), (FULL, SLIDING), 4, 4, sliding_windows=(0, 3))
    view = RequestView(RequestId("A"), tuple(range(1, 34)), 33)
    row = ScheduledRequest(view, TABLE, 0, 32)
    (job,) = core.build_connector_meta(StepView(1, (row,))).store_jobs
    assert {item.group_idx for item in job.items} == {0, 1}
    assert len([item for item in job.items if item.group_idx == 0]) == 8
    _report(core, [job])
    again = RequestView(RequestId("B"), view.token_ids, 33)
    assert core.get_num_new_matched_tokens(again, 0).num_tokens == 32


def test_a_full_host_refuses_low_units_and_then_ends_the_job_at_a_normal_refusal() -> None:
    """A host of 8 entries, 4 of them another prompt's (NORMAL, READY, evictable by NORMAL
    units only). One step stores 32 tokens of full attention and a 3-token sliding reach: the
    early sliding units are LOW. Once the host is full of this job's STORING entries, each
    LOW unit is refused and the job goes on (a hole in LOW units leaves every claim whole);
    the first NORMAL refusal (end 28) ends the job, so the stored prefix has no hole."""
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 4, 4, 1 << 14)
    core = ConnectorCore(planner, HostStore(8), (FULL, SLIDING), 4, 4, sliding_windows=(0, 3))
    core.seed(RequestView(RequestId("S"), tuple(range(1000, 1033)), 33), 16, (0,))
    view = RequestView(RequestId("A"), tuple(range(1, 34)), 33)
    table = (tuple(range(1, 9)), tuple(range(101, 109)))
    row = ScheduledRequest(view, table, 0, 32)
    (job,) = core.build_connector_meta(StepView(1, (row,))).store_jobs
    stored = [(item.group_idx, item.end_token) for item in job.items]
    assert stored == [(0, 4), (1, 4), (0, 8), (1, 8), (0, 12), (0, 16), (0, 20), (0, 24)]
    assert core.stats().stores_refused == 5  # LOW at 12, 16, 20, 24; NORMAL at 28
    _report(core, [job])
    again = RequestView(RequestId("B"), view.token_ids, 33)
    assert core.get_num_new_matched_tokens(again, 0).num_tokens == 8


def test_a_salted_store_records_its_salt_and_its_span_until_it_reports() -> None:
    core = mamba_full_core(64)
    view = _view("A", 1, salt="tenant")
    job = _store_step(core, view, 1, 0)
    snap = core.snapshot()
    assert [j[1:4] for j in snap["jobs"]] == [("store", "A", "tenant")]
    assert snap["store_spans"] == ((job.job_id, 0, 8),)
    stored = {item.key.hex() for item in job.items}
    assert {k: s for k, s in snap["key_salts"] if k in stored} == dict.fromkeys(stored, "tenant")
    _report(core, [job])
    assert core.snapshot()["store_spans"] == ()


def test_the_checkpoint_rules_reach_the_geometry() -> None:
    planner = HybridOffloadPlanner(((FULL, 4), (MAMBA, 4)), 2, 4, 1 << 14)
    rules = (NO_CHECKPOINTS, CheckpointRule(4, 2, 2))
    core = ConnectorCore(planner, HostStore(64), (FULL, MAMBA), 2, 4, checkpoints=rules)
    assert core.geometry.checkpoints == rules
    assert core.snapshot()["checkpoints"] == ((None, 1, 1, False, 0), (4, 2, 2, False, 0))


def test_an_allocation_past_the_claim_loads_only_the_ready_units() -> None:
    """vLLM's accepted count is the claim, but the reference connector takes any count and
    loads only the units the host holds READY and no failed load is remembered for (its
    ``load_items``); the core agrees: past the claim, nothing absent is pinned or loaded."""
    core = mamba_full_core(64)
    view = _view("A", 1)
    core.seed(view, 8)
    claim = core.get_num_new_matched_tokens(view, 0)
    assert claim.num_tokens == 8
    core.update_state_after_alloc(view, TABLE, 16)  # 8 tokens past the claim: not in the host
    loads = core.build_connector_meta(StepView(1, ())).load_jobs
    assert max(item.end_token for job in loads for item in job.items) == 8
    assert core.stats().loaded_tokens == 16
