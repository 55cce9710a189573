"""What a simulation ends with: the report's counts (:class:`SimResult`) and the timeline
that ``--plot`` draws (:class:`StepSample`).

The values are filled by :class:`~hybridkv.simulator.engine.Simulation` from the step's events
(the token ledger, the recovery watch, the transfer events); this module holds only their shape
and the two figures derived from them (the identity and the hit rate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.simulator.transfers import TransferCounts

__all__ = ["SimResult", "StepSample"]


@dataclass(frozen=True, slots=True)
class StepSample:
    """One step of the timeline (``--plot``): the prompt tokens first served in the step by
    each source (the ledger's figures, so their sums are the report's), the failed jobs it
    reported, the bytes loaded so far and the host store's occupancy."""

    step: int
    hit_tokens: int
    loaded_tokens: int
    computed_tokens: int
    failed_loads: int
    failed_stores: int
    bytes_loaded: int
    host_used: int
    host_capacity: int


@dataclass
class SimResult:
    """The counts a run ends with (``hybridkv simulate``'s report)."""

    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_loaded: int = 0
    local_hit_tokens: int = 0
    prompt_tokens_unserved: int = 0
    served_again: dict[str, dict[str, int]] = field(default_factory=dict)
    unaccounted_reads: int = 0
    continuation_turns: int = 0
    continuation_hits: int = 0
    continuation_hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    load_jobs: int = 0
    store_jobs: int = 0
    failures_injected: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    failures_recovered: int = 0
    recovered_loads: int = 0
    recovered_stores: int = 0
    failures_ended: int = 0
    tokens_discarded_by_recovery: int = 0
    blocks_verified: int = 0
    wrong_content_loads: int = 0
    wrong_content_reads: int = 0
    invariant_checks: int = 0
    invariant_violations: int = 0
    violations: list[str] = field(default_factory=list)
    timeline: list[StepSample] = field(default_factory=list)
    transfers: TransferCounts = field(default_factory=TransferCounts)

    @property
    def identity_holds(self) -> bool:
        """Prompt tokens = first-time computed + loaded + GPU hit (+ those of requests that
        ended before their prompt was served)."""
        served = self.prefill_tokens_computed + self.prefill_tokens_loaded + self.local_hit_tokens
        return self.prompt_tokens == served + self.prompt_tokens_unserved

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from a cache (GPU prefix hit or host load) per prompt token."""
        hits = self.local_hit_tokens + self.prefill_tokens_loaded
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0
