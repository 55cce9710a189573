"""The catalogued vLLM 0.33 findings: traces on which vLLM itself breaks one of our invariants.

A random trace may end in a crash that both sides share (:class:`~diffharness.lockstep.Crash`):
vLLM raises, and the spec in its vLLM-exact mode raises too, naming the invariant vLLM breaks.
Such a crash is accepted only if it matches a finding listed here; each finding has a shrunk
trace kept as a test marked ``known_vllm_behaviour`` (``tests/vllm/test_vllm_findings.py``) and
an entry in ``docs/explanation/vllm-differential.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diffharness.lockstep import Crash
from spec.errors import InvariantViolation

__all__ = ["FINDINGS", "Finding", "classify"]


@dataclass(frozen=True, slots=True)
class Finding:
    """A vLLM 0.33 behaviour that breaks one of our invariants.

    Attributes:
        finding_id: ``F<n>``, cited by the docs and the tests.
        invariant_id: the invariant vLLM breaks.
        summary: one line.
        matches: whether a shared crash is this finding.
    """

    finding_id: str
    invariant_id: str
    summary: str
    matches: Callable[[Crash], bool]


def _mamba_external_under_reserve(crash: Crash) -> bool:
    spec, vllm = crash.left, crash.right
    return (
        crash.call == "schedule"
        and isinstance(spec, InvariantViolation)
        and spec.invariant_id == "GR-7"
        and isinstance(vllm, ValueError)
        and "free blocks" in str(vllm)
    )


FINDINGS: tuple[Finding, ...] = (
    Finding(
        "F1",
        "GR-7",
        "a sync claim on a mamba layout reserves one block per mamba group too few; with no "
        "slack in the pool get_new_blocks raises ValueError inside schedule()",
        _mamba_external_under_reserve,
    ),
)


def classify(crash: Crash) -> Finding | None:
    """The catalogued finding a shared crash is, or ``None``."""
    for finding in FINDINGS:
        if finding.matches(crash):
            return finding
    return None
