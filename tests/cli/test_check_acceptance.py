"""The configurations the formal model is accepted on: each exhaustive, fully covered, sound.

``hybridkv check --requests 2 --groups G --depth 10 --start seeded``, ``--depth 12 --start
empty`` and ``--depth 10 --start seeded --recovery shared``, for G in full,mamba and
full,sliding. Every state within the depth bound is checked against every registered invariant,
every event kind and request status is reached, and no violation is found. (Their speed is
reported by the command itself and listed in docs/reference/cli.md, not asserted here.)
"""

from __future__ import annotations

import pytest

from hybridkv.cli.check import run_check
from spec.system.scenarios import Recovery, Scenario, Start, parse_groups

CONFIGS = [
    (groups, start, depth, recovery)
    for groups in ("full,mamba", "full,sliding")
    for start, depth, recovery in (
        (Start.SEEDED, 10, Recovery.VLLM),
        (Start.EMPTY, 12, Recovery.VLLM),
        (Start.SEEDED, 10, Recovery.SHARED),
    )
]


@pytest.mark.parametrize(
    ("groups", "start", "depth", "recovery"),
    CONFIGS,
    ids=[f"{g}-{s.value}-d{d}-{r.value}" for g, s, d, r in CONFIGS],
)
def test_check_passes_exhaustively_with_everything_covered(
    groups: str, start: Start, depth: int, recovery: Recovery
) -> None:
    scenario = Scenario(num_requests=2, groups=parse_groups(groups), start=start, recovery=recovery)
    report = run_check(scenario, depth)
    assert report["violations"] == []
    assert report["uncovered"] == []
    assert report["exhaustive"] is True
    assert report["depth"] == depth  # the bound was reached: the search went the full depth
    assert report["verdict"] == "pass"
    statuses = set(report["coverage"]["statuses"])
    assert {"WAITING_FOR_REMOTE_KVS", "PREEMPTED", "FINISHED_ABORTED"} <= statuses
    events = report["coverage"]["events"]
    assert events["load_fail"] > 0
    assert events["preempt_during_transfer"] > 0
