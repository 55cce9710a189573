"""The bfloat16 criterion: a run judged against vLLM's own variation, not against ties.

In bfloat16, greedy answers of the same prompts change with how vLLM computes them: prefix
caching on or off changes which tokens a step computes and which it reads back, so the logits
move by a rounding and a near-tie can flip. Equal answers would pass or fail on where the ties
fall, not on whether the loaded KV is right. So a bfloat16 run is measured, and the measure
compared with vLLM's own variation on the same model:

- **differing**: the requests whose answer differs from the baseline's (every run answers the
  baseline's prompts, ``_workload.replay``, so each request counts once);
- **drift**: the largest change, over all requests, of the chosen token's logprob at the
  positions up to and including the answer's first differing token. The greedy token's logprob
  is the largest log-softmax value, a continuous function of the logits even where the argmax
  flips, so the position where the two runs choose differently still compares like with like;
  after it the two answers continue different texts and are not compared. A logprob that is
  not finite (NaN logits) counts as an infinite drift.

The **reference** is the same model without a connector and with prefix caching off, measured
against the baseline (no connector, prefix caching on). The connector's run must stay within

- drift <= ``DRIFT_MARGIN`` x max(reference drift, ``DRIFT_FLOOR``), and
- differing <= reference differing + ``DIFFERING_SLACK``,

and the negative control (every load reads random bytes) must be far outside: its drift at
least ``CONTROL_FACTOR`` times the drift bound. The floor keeps a reference that happens to
move little (its ties fell elsewhere) from making the bound a test of equality; the margin and
the slack absorb that the connector's run and the reference read different blocks back, so
their roundings differ. float32 models need none of this: every answer equals the baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from _workload import Transcript

DRIFT_FLOOR = 0.02
"""Nats. The drift a bfloat16 reference is taken to have at least (a few bfloat16 roundings of
the logits of these tiny models)."""
DRIFT_MARGIN = 2.0
DIFFERING_SLACK = 2
CONTROL_FACTOR = 5.0


@dataclass(frozen=True, slots=True)
class Drift:
    """How far one run's answers moved from the baseline's (module docstring)."""

    requests: int
    differing: int
    drift: float  # nats, the largest over requests

    def __str__(self) -> str:
        return f"drift {self.drift:.4f}, {self.differing}/{self.requests} differ"


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The first position where the answers differ, or their length if none does."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def measure(run: Transcript, base: Transcript) -> Drift:
    """``run`` against ``base``: both must have answered the same prompts."""
    if run.prompts != base.prompts:
        raise AssertionError("the run did not answer the baseline's prompts (use replay)")
    drift = 0.0
    for ours, theirs, our_lp, their_lp in zip(
        run.answers, base.answers, run.logprobs, base.logprobs, strict=True
    ):
        last = min(_first_difference(ours, theirs), len(ours) - 1)
        for i in range(last + 1):
            moved = abs(our_lp[i] - their_lp[i])
            # A NaN logit (random bytes read as bfloat16) is the farthest a run can move.
            drift = max(drift, moved if math.isfinite(moved) else math.inf)
    return Drift(len(run.answers), len(run.differing(base)), drift)


@dataclass(frozen=True, slots=True)
class Criterion:
    """The bound a bfloat16 run must stay within, from the reference's measure."""

    reference: Drift

    @property
    def max_drift(self) -> float:
        return DRIFT_MARGIN * max(self.reference.drift, DRIFT_FLOOR)

    @property
    def max_differing(self) -> int:
        return self.reference.differing + DIFFERING_SLACK

    def admits(self, run: Drift) -> bool:
        """Whether ``run`` moved no more than vLLM's own variation allows."""
        return run.drift <= self.max_drift and run.differing <= self.max_differing

    def far_outside(self, control: Drift) -> bool:
        """Whether the control moved at least ``CONTROL_FACTOR`` times the drift bound."""
        return control.drift >= CONTROL_FACTOR * self.max_drift

    def __str__(self) -> str:
        return (
            f"bound: drift <= {DRIFT_MARGIN:g} x max({self.reference.drift:.4f}, "
            f"{DRIFT_FLOOR:g}) = {self.max_drift:.4f}, differing <= "
            f"{self.reference.differing} + {DIFFERING_SLACK} = {self.max_differing}"
        )
