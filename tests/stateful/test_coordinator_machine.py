"""A hypothesis state machine over the KV cache coordinator alone: GR-* and BP-* after every call.

The system under test is :class:`spec.managers.KVCacheCoordinator` over one pool (full attention,
sliding window and mamba groups of 1-token blocks, nine usable blocks), driven as the scheduler
drives it: allocations that grow a request by a few tokens from its computed count, frees, and
roll-backs. A roll-back puts a request's computed count back without freeing its tables, as
shared truncation does to a running request whose block a report names, and as vLLM does when
it rejects speculative tokens.

Why this machine exists beside the engine explorer: GR-6 (no negative reservation) catches
vLLM 0.33's unclamped align-mode mamba count (divergence D1) only when a mamba table is longer
than the next allocation needs, which takes a roll-back. The engine makes none: speculative
decoding is not modelled, and a failed load's report names the loading request's own blocks,
never a running request's (the "39 < 40" regression of tests/regressions/test_crashes.py needs
a scheduler-level script for that reason), and on a mamba layout the loading request itself
resumes at its claim end (the state is loaded there only, MB-1) or restarts from 0 with its
tables freed. So no engine scenario reaches a negative count, and GR-6's mutation evidence is
this machine (listed in tests/spec/test_explorer_mutations.py).

Runs: the profile's max_examples machines (ci: 200) of 12 steps each; the mutation guard runs
its own 200 (generation only).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spec.block_pool import Refused
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers import KVCacheCoordinator
from spec.managers.group_spec import GroupSpec
from spec.managers.mamba import MambaManager

GROUPS = (
    GroupSpec(GroupKind.FULL, 1),
    GroupSpec(GroupKind.SLIDING, 1, sliding_window=2),
    GroupSpec(GroupKind.MAMBA, 1),
)
REQUESTS = ("r0", "r1", "r2")


class CoordinatorMachine(RuleBasedStateMachine):
    """The coordinator under allocations, frees and roll-backs (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheCoordinator(GROUPS, num_blocks=10)
        self.computed = dict.fromkeys(REQUESTS, 0)

    @rule(rid=st.sampled_from(REQUESTS), n=st.integers(1, 4))
    def allocate(self, rid: str, n: int) -> None:
        got = self.kv.allocate_slots(rid, n, num_computed_tokens=self.computed[rid])
        if not isinstance(got, Refused):
            self.computed[rid] += n

    @precondition(lambda self: any(self.computed.values()))
    @rule(data=st.data())
    def roll_back(self, data: st.DataObject) -> None:
        """Rejected speculative tokens: the computed count goes back, the tables stay."""
        rid = data.draw(st.sampled_from([r for r, n in self.computed.items() if n]))
        self.computed[rid] -= data.draw(st.integers(1, self.computed[rid]))

    @rule(rid=st.sampled_from(REQUESTS))
    def free(self, rid: str) -> None:
        self.kv.free(rid)
        self.computed[rid] = 0

    @invariant()
    def every_invariant_holds(self) -> None:
        snapshot = self.kv.snapshot()
        broken = check_all("kv_cache_groups", snapshot) | check_all(
            "block_pool", snapshot["block_pool"]
        )
        assert broken == {}, broken


CoordinatorMachine.TestCase.settings = settings(settings(), stateful_step_count=12)
test_coordinator_machine = CoordinatorMachine.TestCase


@pytest.mark.mutation("GR-6")
def test_gr6_unclamped_mamba_count_after_a_roll_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's align-mode count is not clamped at 0 (D1; the field's "39 < 40" crash
    after a truncation): once a request rolls back, its mamba table is longer than the next
    allocation needs and the reservation goes negative, which GR-6 names (generation only, no
    shrinking)."""
    monkeypatch.setattr(MambaManager, "_clamp", lambda self, num_new: num_new)

    class Broken(CoordinatorMachine):
        pass

    Broken.TestCase.settings = settings(
        CoordinatorMachine.TestCase.settings,
        phases=[Phase.explicit, Phase.generate],
        print_blob=False,
        report_multiple_bugs=False,
        max_examples=200,
    )
    with pytest.raises(AssertionError, match="GR-6"):
        Broken.TestCase().runTest()
