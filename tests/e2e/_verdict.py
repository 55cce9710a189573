"""How a run's answers are judged against its model's baseline.

float32 models: every answer equals the baseline's. bfloat16 models: the run stays within
vLLM's own variation on that model (``_drift``: the reference of prefix caching off against on),
and the negative control lands far outside it. Each check returns the words the session's
report prints for it, so the report shows the figures the verdict was reached on.
"""

from __future__ import annotations

from pathlib import Path

import _baselines
import _drift
from _llm import Run


def _exact(name: str, root: Path) -> bool:
    return _baselines.model(name, root).shape.dtype == "float32"


def answers_hold(name: str, root: Path, run: Run) -> str:
    """Assert ``run``'s answers pass; return what was measured."""
    base = _baselines.baseline(name, root).transcript
    measured = _drift.measure(run.transcript, base)
    if _exact(name, root):
        differing = run.transcript.differing(base)
        assert not differing, f"{name}: requests {differing} answered unlike the baseline"
        return f"{measured.requests} requests equal"
    criterion = _baselines.criterion(name, root)
    assert criterion.admits(measured), (
        f"{name}: the connector's answers moved beyond vLLM's own variation: connector "
        f"{measured}; reference (prefix caching off) {criterion.reference}; {criterion}"
    )
    return f"reference {criterion.reference}; connector {measured}; {criterion}"


def control_fails(name: str, root: Path, control: Run) -> str:
    """Assert the corrupting control's answers fail, far from the bound in bfloat16; return
    what was measured."""
    base = _baselines.baseline(name, root).transcript
    measured = _drift.measure(control.transcript, base)
    if _exact(name, root):
        changed = control.transcript.differing(base)
        assert changed, f"{name}: corrupted loads changed no answer: the check cannot see loads"
        return f"control changed {len(changed)}/{measured.requests}"
    criterion = _baselines.criterion(name, root)
    assert criterion.far_outside(measured), (
        f"{name}: the control's drift {measured.drift:.4f} is not {_drift.CONTROL_FACTOR:g} x "
        f"the bound {criterion.max_drift:.4f}: the criterion cannot tell corrupted loads apart"
    )
    return f"control {measured} ({measured.drift / criterion.max_drift:.1f} x the drift bound)"
