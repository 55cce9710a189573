"""What the random traces of one pytest session covered, for the terminal summary.

``tests/vllm/conftest.py`` prints it after the session; the counts show that comparisons ran on
traces that preempted, loaded, failed, aborted and hit the prefix cache, not only on idle ones.
"""

from __future__ import annotations

from collections import Counter

from diffharness.findings import classify
from diffharness.layouts import Layout
from diffharness.lockstep import RunResult

__all__ = ["TALLY", "record", "summary"]

TALLY: dict[Layout, Counter[str]] = {layout: Counter() for layout in Layout}


def record(result: RunResult) -> None:
    """Add one finished lock-step run to the tally of its layout."""
    counts = TALLY[result.trace.layout]
    counts["traces"] += 1
    counts["steps"] += result.steps
    counts["observations"] += result.observations
    counts.update(result.counts)
    if result.crash is not None:
        finding = classify(result.crash)
        counts[f"ended in {finding.finding_id if finding else 'an unknown crash'}"] += 1
    else:
        counts["agreed to the end"] += 1


_SHOWN = (
    "traces",
    "agreed to the end",
    "steps",
    "observations",
    "preemptions",
    "claims_accepted",
    "finished_recving",
    "failed_recving",
    "tokens_recomputed",
    "finished_sending",
    "final:finished_aborted",
    "final:finished_error",
)


def summary() -> list[str]:
    """One line per layout that ran traces."""
    lines = []
    for layout, counts in TALLY.items():
        if not counts["traces"]:
            continue
        shown = [f"{key}={counts[key]}" for key in _SHOWN]
        shown += [f"{k}={v}" for k, v in sorted(counts.items()) if k.startswith("ended in")]
        lines.append(f"{layout.value}: " + ", ".join(shown))
    return lines
