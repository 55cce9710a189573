"""``GroupAgreement``, the ``group_prefix_disagreements`` counter: its count is the definition's.

The definition (``GroupAgreement.group_ends``): each group's own claim end, the claim rule run
on that group alone with STORING keys counted as absent; a decided lookup counts when the ends
differ, once per request and position. ``observe`` decides it from the core's answer instead
(one group passing the answer, ``hybridkv.connector.claims.some_group_passes``) whenever the
claim rule gave it; these tests hold it to the definition on random hosts (per-group seeds,
promotions in flight) and on the one answer the rule does not give (salvage off, a restarted
request answered NONE without a search).
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.connector import (  # noqa: E402
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    StepView,
)
from hybridkv.kinds import GroupKind  # noqa: E402
from hybridkv.planner import HybridOffloadPlanner  # noqa: E402
from hybridkv.store import HostStore  # noqa: E402
from hybridkv.vllm.metrics import GroupAgreement  # noqa: E402

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
KINDS = (FULL, SLIDING, MAMBA)


def _core() -> ConnectorCore:
    planner = HybridOffloadPlanner(tuple((kind, 4) for kind in KINDS), 2, 4, 1 << 10)
    return ConnectorCore(planner, HostStore(4096), KINDS, 2, 4, sliding_windows=(0, 7, 0))


def _view(rid: str, tokens: tuple[int, ...]) -> RequestView:
    return RequestView(RequestId(rid), tokens, len(tokens))


def _differ(core: ConnectorCore, view: RequestView, start: int) -> bool:
    return len(set(GroupAgreement.group_ends(core, view, start))) > 1


def test_the_count_is_the_definitions_on_random_hosts() -> None:
    rng = random.Random(18)
    counted = {True: 0, False: 0}
    claimed = 0
    for trial in range(150):
        core, agreement = _core(), GroupAgreement()
        base = tuple(range(1, 81))
        prompts = [(*base[: rng.randrange(20, 81)], 1000 + trial) for _ in range(3)]
        for i, prompt in enumerate(prompts):  # per-group prefixes of different lengths
            groups = rng.sample(range(3), rng.randrange(1, 4))
            core.seed(_view(f"s{i}", prompt), rng.randrange(0, len(prompt)) // 4 * 4, groups)
        for end in rng.sample(range(4, 80, 4), 3):  # chunks on their way in: STORING
            members = core.chunk_members(_view("p", base), end)
            if members:
                core.reserve_promotion(members, None)
        for i, prompt in enumerate(prompts):
            view = _view(f"r{i}", prompt)
            start = rng.randrange(0, len(prompt)) // 4 * 4
            claim = core.get_num_new_matched_tokens(view, start)
            if claim.kind is ClaimKind.DEFER:
                continue
            before = agreement.count
            agreement.observe(core, view, start, claim.num_tokens)
            expected = _differ(core, view, start)
            assert agreement.count - before == expected
            agreement.observe(core, view, start, claim.num_tokens)  # the same position
            assert agreement.count - before == expected
            counted[expected] += 1
            claimed += claim.num_tokens > 0
    assert min(counted.values()) >= 20, counted
    assert claimed >= 20


def test_an_answer_the_rule_did_not_give_is_checked_group_by_group() -> None:
    # Salvage off: a request whose load failed is answered NONE, unsearched, until it is
    # scheduled. Its groups all reach 8 here, so they agree, although each passes 0.
    core, agreement = _core(), GroupAgreement()
    core._set_salvage(False)
    tokens = tuple(range(1, 42))
    view = _view("B", tokens)
    core.seed(_view("S", tokens), 8)
    claim = core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 8)
    table = tuple(tuple(range(g * 100, g * 100 + 11)) for g in range(3))
    core.update_state_after_alloc(view, table, 8)
    meta = core.build_connector_meta(StepView(1, ()))
    results = tuple(JobResult(JobId(job.job_id), False) for job in meta.load_jobs)
    core.update_connector_output(KVConnectorOutput(completed_jobs=results))
    core.build_connector_meta(StepView(2, ()))  # the failed keys left: forgotten
    core.seed(_view("S", tokens), 8)  # and stored again
    again = core.get_num_new_matched_tokens(view, 0)
    assert again.kind is ClaimKind.NONE
    assert not core.answers_by_rule(view.request_id)
    assert GroupAgreement.group_ends(core, view, 0) == (8, 8, 8)
    agreement.observe(core, view, 0, 0)
    assert agreement.count == 0
    # A request the rule answers NONE while one group passes 0: counted.
    core.seed(_view("F", tuple(range(500, 541))), 16, (0,))
    other = _view("C", tuple(range(500, 541)))
    assert core.answers_by_rule(other.request_id)
    assert core.get_num_new_matched_tokens(other, 0).kind is ClaimKind.NONE
    agreement.observe(core, other, 0, 0)
    assert agreement.count == 1
