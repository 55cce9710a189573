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

from diffharness.layouts import RECIPES, Layout
from diffharness.lockstep import Crash
from diffharness.trace import (
    ClaimMode,
    ClaimScript,
    EngineSettings,
    LoadScript,
    RequestScript,
    Trace,
)
from spec.errors import ConfigError, InvariantViolation

__all__ = [
    "FINDINGS",
    "Finding",
    "abort_during_load_with_store_hold",
    "classify",
    "failed_load_reclaimed",
    "mamba_sync_claims",
]


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


def _late_report_after_early_free(crash: Crash) -> bool:
    spec, vllm = crash.left, crash.right
    return (
        crash.call == "update_from_output"
        and isinstance(spec, ConfigError)
        and spec.field in ("finished_recving", "finished_sending")
        and type(vllm) is AssertionError
    )


FINDINGS: tuple[Finding, ...] = (
    Finding(
        "F1",
        "GR-7",
        "a sync claim on a mamba layout reserves one block per mamba group too few; with no "
        "slack in the pool get_new_blocks raises ValueError inside schedule()",
        _mamba_external_under_reserve,
    ),
    Finding(
        "F2",
        "SC-3",
        "a request whose async load failed stays in vLLM's in-flight prefill set, so when the "
        "connector claims it again its own reservation gates its admission: a request needing "
        "more than half the pool waits forever",
        lambda crash: False,  # a wedge, not a crash: both sides agree on every step
    ),
    Finding(
        "F3",
        "TR-1",
        "a request aborted during its load, whose blocks the connector also holds for a store, "
        "is freed at the first of finished_sending and finished_recving while the other "
        "transfer still uses the blocks; the second report then fails an assert",
        _late_report_after_early_free,
    ),
)


def classify(crash: Crash) -> Finding | None:
    """The catalogued finding a shared crash is, or ``None``."""
    for finding in FINDINGS:
        if finding.matches(crash):
            return finding
    return None


# ------------------------------------------------------------------ the findings' traces


def _prompt(base: int, length: int) -> tuple[int, ...]:
    return tuple(range(base, base + length))


def mamba_sync_claims() -> Trace:
    """F1 (shrunk by hypothesis from a random trace): two requests of two blocks, each with a
    sync claim of one unit, on a 14-block pool (13 usable). r0 is admitted and takes 2 (full)
    + 3x2 (mamba) blocks; r1's admission reserves 2 + 3x1 = 5 of the 5 free and takes
    2 + 3x2, so the second mamba group finds none and vLLM's ``get_new_blocks`` raises inside
    ``schedule()``."""
    sync = (ClaimScript(ClaimMode.SYNC, 1),)
    return Trace(
        Layout.MAMBA_FULL,
        EngineSettings(14, 1280, 2),
        (
            RequestScript("r0", 1, _prompt(200_000, 1280), 1, claims=sync),
            RequestScript("r1", 1, _prompt(210_000, 1280), 1, claims=sync),
        ),
    )


def failed_load_reclaimed(steps: int = 30) -> Trace:
    """F2: a 15-block request on a 16-block pool; its first async load (2 units) fails, and the
    connector keeps claiming 2 units. vLLM gates each new claim on free minus the request's OWN
    15-block reservation: 16 - 15 < 2, refused at every step."""
    unit = RECIPES[Layout.FULL_ONLY].unit
    return Trace(
        Layout.FULL_ONLY,
        EngineSettings(17, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 15 * unit),
                1,
                claims=tuple(ClaimScript(ClaimMode.ASYNC, 2) for _ in range(steps)),
                loads=(LoadScript(1, fails=True),),
            ),
        ),
        max_steps=steps,
    )


def abort_during_load_with_store_hold() -> Trace:
    """F3: r0's async load (2 blocks) reports at step 5; r0 is aborted at step 2 and the
    connector also keeps its blocks for a store, reported at step 3. vLLM frees the blocks at
    step 3 while the load still writes them, and asserts when the load reports at step 5."""
    return Trace(
        Layout.FULL_ONLY,
        EngineSettings(20, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 96),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 2),),
                loads=(LoadScript(4),),
                store_hold=1,
                hold_during_load=True,
                abort_step=2,
            ),
        ),
    )
