"""How long :class:`hybridkv.connector.ConnectorCore` keeps what it knows of a request.

``request_finished_all_groups`` forgets the request's hash chain, asked position and claim
answer at once, and its load record unless a load job is still in flight; the record of a load
in flight lives until its last job reports, so ``invalid_blocks`` answers for the whole load.
A request id used again after its request finished is a new request: its claim and its load
are its own. Each test here was written for a mutant mutmut left alive in ``tools/mutants.py``'s
run over ``hybridkv/connector/core.py`` (docs/explanation/mutations.md).
"""

from __future__ import annotations

from small_core import mamba_full_core

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    StepView,
    TransferJob,
)
from hybridkv.errors import HybridKVConfigError

TABLE = tuple(tuple(1 + g * 1000 + i for i in range(9)) for g in range(2))


def _view(rid: str, first: int = 1) -> RequestView:
    tokens = tuple(range(first, first + 33))  # 33 tokens: 32 claimable, 8 units of 4
    return RequestView(RequestId(rid), tokens, len(tokens))


def _loading(core: ConnectorCore, view: RequestView, seeded: int) -> tuple[TransferJob, ...]:
    """``view``'s claim over ``seeded`` seeded tokens, accepted whole: its load jobs."""
    core.seed(RequestView(RequestId(f"seed-{view.request_id}"), view.token_ids, 33), seeded)
    claim = core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, seeded)
    core.update_state_after_alloc(view, TABLE, claim.num_tokens)
    return core.build_connector_meta(StepView(1, ())).load_jobs


def _report(core: ConnectorCore, *results: tuple[TransferJob, bool]) -> None:
    done = tuple(JobResult(JobId(job.job_id), ok) for job, ok in results)
    core.update_connector_output(KVConnectorOutput(completed_jobs=done))


def _no_record(core: ConnectorCore, rid: str) -> bool:
    try:
        core.invalid_blocks(RequestId(rid))
    except HybridKVConfigError as e:
        return (e.field, e.value, e.problem) == ("request_id", rid, "has no load recorded")
    return False


def test_invalid_blocks_name_the_failed_jobs_blocks_only() -> None:
    core = mamba_full_core(64)
    view = _view("A")
    first, *rest = _loading(core, view, 16)
    assert rest
    _report(core, (first, True))
    assert core.invalid_blocks(view.request_id) == frozenset()  # a success marks no block
    _report(core, *((job, False) for job in rest))
    assert core.invalid_blocks(view.request_id) == {
        item.block_id for job in rest for item in job.items
    }
    assert not {item.block_id for item in first.items} & core.invalid_blocks(view.request_id)


def test_a_finished_requests_load_record_lives_until_its_last_job_reports() -> None:
    core = mamba_full_core(64)
    view = _view("A")
    first, *rest = _loading(core, view, 16)
    assert rest
    assert core.request_finished_all_groups(view, TABLE) is False  # its load reports for it
    _report(core, (first, False))
    assert core.invalid_blocks(view.request_id) == {item.block_id for item in first.items}
    _report(core, *((job, True) for job in rest))
    assert _no_record(core, "A")
    assert not core.has_transfers(view.request_id)


def test_a_finished_requests_one_job_load_is_forgotten_at_its_report() -> None:
    core = mamba_full_core(64)
    view = _view("A")
    (only,) = _loading(core, view, 4)  # one unit: one job
    assert core.request_finished_all_groups(view, TABLE) is False
    _report(core, (only, True))
    assert _no_record(core, "A")


def test_finishing_forgets_the_asked_position_at_once() -> None:
    core = mamba_full_core(64)
    view = _view("A")
    core.seed(RequestView(RequestId("seed"), view.token_ids, 33), 16)
    claim = core.get_num_new_matched_tokens(view, 0)
    assert claim.num_tokens == 16
    assert core.request_finished_all_groups(view, TABLE) is False
    try:
        core.update_state_after_alloc(view, TABLE, claim.num_tokens)
    except HybridKVConfigError as e:
        assert (e.field, e.value, e.problem) == ("num_external_tokens", 16, "no claim was asked")
    else:
        raise AssertionError("an allocation for a finished request was accepted")
    assert core.stats().load_jobs == 0


def test_a_request_never_asked_finishes_with_nothing_to_forget() -> None:
    """Nothing changes but the hashes its finish computed (its units are looked for on the
    host, to refresh them: none are there)."""
    core = mamba_full_core(64)
    before = core.stats()
    assert core.request_finished_all_groups(_view("never"), TABLE) is False
    assert core.stats()._replace(hashes_computed=0) == before._replace(hashes_computed=0)


def test_a_request_id_used_again_is_a_new_request() -> None:
    """The first "A" finished during its load; the second "A" has other tokens of the same
    length (so the same claim question: start, length, salt, store statuses) and its own
    load, which fails and must stay recorded while the request runs."""
    core = mamba_full_core(64)
    old = _view("A")
    (job,) = _loading(core, old, 4)
    assert core.request_finished_all_groups(old, TABLE) is False
    _report(core, (job, True))
    new = _view("A", first=500)
    assert core.get_num_new_matched_tokens(new, 0).kind is ClaimKind.NONE  # nothing of its own
    jobs = _loading(core, new, 8)
    _report(core, *((j, False) for j in jobs))
    assert core.invalid_blocks(new.request_id) == {i.block_id for j in jobs for i in j.items}
