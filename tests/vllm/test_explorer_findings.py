"""What the configuration explorer (tests/vllm/test_explorer.py) found on the way, each as the
minimal configuration it shrank to, replayed with every invariant checked after every step. A
finding still open is ``xfail(strict=True)`` with its cause (none today); the fixed ones stay as
regression tests.

Replay any of them: ``python tools/explore.py --replay '<the config's to_json()>'``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _explorer import explore  # noqa: E402
from _explorer_config import Config  # noqa: E402


def test_bp3_holds_on_vllms_own_partial_prefix_keys() -> None:
    """Found as a BP-3 violation on vLLM's own state, with or without a connector: with a
    ``prefix_match_unit`` below the block vLLM 0.33 keeps a block's partial-prefix keys beside
    its own (``cached_block_hashes_by_block``), and BP-3 kept one key per block. BP-3 now takes
    every key a block carries (``spec/invariants/block_pool.py``): the oracle was wrong."""
    # Shrunk from sliding+full configurations with prefix_match_unit 8 (first met at seed 32831).
    out = explore(Config(prefix_match_unit=8))
    assert out.failure is None, out.failure


def test_tr1_holds_after_a_reset_with_running_requests_and_a_store_in_flight() -> None:
    """Found as a TR-1 violation: a reset with running requests gives the pins of the stores in
    flight back and drops those stores when they report (their keys never READY), but the
    checker still listed them as reading the blocks vLLM freed. The checker now leaves the
    released stores out of TR-1 (``_invariants_on_vllm._in_flight``): what they read is never
    trusted."""
    # Shrunk from seed 11610's configuration: copies 3 steps late, the reset at step 6.
    config = Config(delay=3, events=((6, "reset_running"),))
    out = explore(config)
    assert out.failure is None, f"{out.failure}\n  replay: {config.replay}"


def test_tr1_holds_after_a_pause_that_clears_the_cache_with_a_store_in_flight() -> None:
    """The same, through ``pause_generation(clear_cache=True)`` as the in-process engine core
    runs it (its reset preempts the running requests and resets the connector)."""
    # Shrunk by Hypothesis in test_explorer.py (seed 7, the pause at step 1, copies 3 late).
    config = Config(delay=3, failure_policy="fail", seed=7, events=((1, "pause_inproc"),))
    out = explore(config)
    assert out.failure is None, f"{out.failure}\n  replay: {config.replay}"


# Issue 29 through the pool_fit axis: found on the commit before hybridkv/vllm/admission.py
# (ed0670a) by tight-pool configurations of 2sliding+full (budget 128, copies 3 steps late, a
# pool of two whole requests): requests sharing the prefix loaded it side by side and none
# could allocate its next chunk; SC-12's window named the wedge at step 65-66, where the step
# cap alone would have waited for step 800.
ISSUE_29 = [
    Config(
        layout="2sliding+full",
        max_num_batched_tokens=128,
        max_num_seqs=4,
        delay=3,
        pool_extra=0,
        pool_fit=2,
        seed=seed,
    )
    for seed in (0, 2)
]


@pytest.mark.parametrize("config", ISSUE_29, ids=lambda c: f"seed{c.seed}")
def test_issue29_loads_sharing_a_prefix_on_a_pool_of_two_finish(config: Config) -> None:
    out = explore(config)
    assert out.failure is None, f"{out.failure}\n  replay: {config.replay}"
    assert out.counts["external_hits"] > 0


@pytest.mark.parametrize("config", ISSUE_29, ids=lambda c: f"seed{c.seed}")
def test_issue29_without_the_admission_rule_the_same_run_wedges(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: every async claim admitted as the core made it (the rule off), the same
    configuration wedges, and SC-12 names it long before the step cap."""
    from hybridkv.vllm.admission import LoadAdmission

    monkeypatch.setattr(LoadAdmission, "defers", lambda self, request, start, num_tokens: False)
    out = explore(config)
    assert out.failure is not None
    assert out.failure.kind == "wedge"
    assert out.failure.detail.startswith("SC-12: step 6"), out.failure.detail
