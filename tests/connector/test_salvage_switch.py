"""``ConnectorCore._set_salvage``: the benchmark control of ``tools/bench_salvage.py``.

On (the default), a request restarted after a failed load is re-claimed up to the failed
segment (the failure memory at work); off, the re-ask claims nothing until the request is
scheduled again or finishes, which is vLLM 0.33's whole-request recompute. Everything else (the
failure memory, the failed keys' eviction) is the same either way.
"""

from __future__ import annotations

import pytest
from small_core import mamba_full_core

from hybridkv.connector import (
    BlockTable,
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
TOKENS = tuple(range(1, 34))  # 33 tokens: 32 claimable, 8 units of 4


def _core() -> ConnectorCore:
    return mamba_full_core(1024)


def _view(rid: str) -> RequestView:
    return RequestView(RequestId(rid), TOKENS, len(TOKENS))


def _table(base: int) -> BlockTable:
    return tuple(tuple(base + g * 1000 + i for i in range(9)) for g in range(2))


def _fail_a_load(core: ConnectorCore, failed_segment: int) -> int:
    """Seed the host, claim B's 32 tokens, fail one segment of the load; the claim's size."""
    core.seed(_view("S"), 32)
    b = _view("B")
    claim = core.get_num_new_matched_tokens(b, 0)
    assert claim.kind is ClaimKind.ASYNC
    core.update_state_after_alloc(b, _table(1), claim.num_tokens)
    meta = core.build_connector_meta(StepView(1, ()))
    results = tuple(
        JobResult(JobId(job.job_id), i != failed_segment) for i, job in enumerate(meta.load_jobs)
    )
    assert len(results) > failed_segment + 1
    core.update_connector_output(KVConnectorOutput(completed_jobs=results))
    return claim.num_tokens


@pytest.mark.parametrize("salvage", [True, False])
def test_the_re_ask_after_a_failed_load_salvages_only_when_on(salvage: bool) -> None:
    core = _core()
    core._set_salvage(salvage)
    claimed = _fail_a_load(core, failed_segment=2)
    assert claimed == 32
    assert core.stats().load_jobs_failed == 1
    again = core.get_num_new_matched_tokens(_view("B"), 0)  # vLLM restarted it from 0
    if salvage:
        assert again.kind is ClaimKind.ASYNC
        assert again.num_tokens == 8  # the two segments before the failed third one
    else:
        assert again.kind is ClaimKind.NONE
        assert core.get_num_new_matched_tokens(_view("B"), 0).kind is ClaimKind.NONE


def test_salvage_off_answers_again_once_the_request_was_scheduled() -> None:
    core = _core()
    core._set_salvage(False)
    _fail_a_load(core, failed_segment=2)
    assert core.get_num_new_matched_tokens(_view("B"), 0).kind is ClaimKind.NONE
    core.build_connector_meta(StepView(2, (ScheduledRequest(_view("B"), _table(1), 0, 8),)))
    # e.g. preempted later: the claim rule answers as usual (the failed segment is gone)
    assert core.get_num_new_matched_tokens(_view("B"), 0).num_tokens == 8


def test_salvage_off_forgets_a_finished_request() -> None:
    core = _core()
    core._set_salvage(False)
    _fail_a_load(core, failed_segment=2)
    assert core.request_finished_all_groups(_view("B"), _table(1)) is False
    # the same id again (a new request reusing it) is not a restarted one
    assert core.get_num_new_matched_tokens(_view("B"), 0).num_tokens == 8


def test_salvage_switch_changes_nothing_else() -> None:
    on, off = _core(), _core()
    off._set_salvage(False)
    for core in (on, off):
        _fail_a_load(core, failed_segment=2)
    assert on.snapshot() == off.snapshot()
    assert on.stats() == off.stats()


def test_salvage_switch_takes_a_bool() -> None:
    with pytest.raises(HybridKVConfigError, match="enabled"):
        _core()._set_salvage(0)  # type: ignore[arg-type]


@pytest.mark.parametrize("salvage", [True, False])
def test_the_rule_answers_unless_salvage_off_holds_a_restarted_request(salvage: bool) -> None:
    # answers_by_rule: False exactly while the core answers NONE without a search (the per-group
    # metric then compares the groups' ends one by one, hybridkv.vllm.metrics.GroupAgreement).
    core = _core()
    core._set_salvage(salvage)
    assert core.answers_by_rule(RequestId("B"))
    _fail_a_load(core, failed_segment=2)
    assert core.answers_by_rule(RequestId("B")) is salvage
    assert core.answers_by_rule(RequestId("other"))
    core.build_connector_meta(StepView(2, (ScheduledRequest(_view("B"), _table(1), 0, 8),)))
    assert core.answers_by_rule(RequestId("B"))  # scheduled: no longer restarting
