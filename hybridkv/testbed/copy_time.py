"""The copy-time model of ``hybridkv simulate``: in which step a transfer job completes.

A step of the simulated engine lasts ``step_ms`` of modelled time. Each direction (host to GPU
for loads, GPU to host for stores) is one link that moves ``gbps`` GB/s and serves its jobs one
after another in submission order (the transfer engine's contract): a job occupies its link for
``latency_us`` plus its bytes over the bandwidth, starting when it is submitted or when the job
before it is done, whichever is later. Loads are submitted when their step starts, stores when
its forward ends (vLLM's ``wait_for_save``), and a job is reported in the first step whose end it
does not outlast.

The bytes are those the model moves, not the ones the simulation copies: the simulation keeps
``layers_per_group`` of the model's layers per group, so every copied byte stands for
``byte_scale`` (the model's layers per group over the simulated ones) bytes of the real transfer.

All times are integer nanoseconds, so a run is exact and reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError

__all__ = [
    "DEFAULT_GBPS",
    "DEFAULT_LATENCY_US",
    "DEFAULT_STEP_MS",
    "CopyTimeModel",
]

# PCIe 4.0 x16 moves about 25 GB/s per direction at best; a KV offload moves many separate
# block runs per job, and reaches about half of it (docs/howto/simulate.md).
DEFAULT_GBPS = 12.0
# Launch and completion-event cost of one job on a CUDA stream: tens of microseconds.
DEFAULT_LATENCY_US = 50.0
# One decode step of a ~27B model on one H100-class GPU reads its ~54 GB of weights at about
# 3 TB/s: about 20 ms.
DEFAULT_STEP_MS = 20.0

_LIMITS = {
    "--transfer-gbps": (1e-3, 1e4),
    "--transfer-latency-us": (0.0, 1e7),
    "--step-ms": (1e-3, 1e6),
}


@dataclass(frozen=True, slots=True)
class CopyTimeModel:
    """Bandwidth, per-job latency and step length (module docstring).

    Attributes:
        gbps: bandwidth of each direction's link, in GB/s (10**9 bytes per second).
        latency_us: fixed cost of each job, in microseconds.
        step_ms: modelled length of one engine step, in milliseconds.
        byte_scale: modelled bytes per byte the simulation copies (> 0).

    Refusal: a value out of range raises :class:`HybridKVConfigError` naming its flag.
    """

    gbps: float = DEFAULT_GBPS
    latency_us: float = DEFAULT_LATENCY_US
    step_ms: float = DEFAULT_STEP_MS
    byte_scale: float = 1.0

    def __post_init__(self) -> None:
        values = {
            "--transfer-gbps": self.gbps,
            "--transfer-latency-us": self.latency_us,
            "--step-ms": self.step_ms,
        }
        for flag, value in values.items():
            low, high = _LIMITS[flag]
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not low <= value <= high
            ):
                raise HybridKVConfigError(
                    flag, value, f"must be a number in [{low:g}, {high:g}]", _FIXES[flag]
                )
        scale = self.byte_scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
            or scale <= 0
        ):
            raise HybridKVConfigError(
                "byte_scale",
                scale,
                "must be a positive number",
                "pass the model's layers per group over the simulated ones",
            )

    @property
    def step_ns(self) -> int:
        """One step, in nanoseconds (at least 1)."""
        return max(1, round(self.step_ms * 1e6))

    def job_ns(self, nbytes: int) -> int:
        """How long a job that copies ``nbytes`` (simulated bytes) holds its link, in ns."""
        modelled = nbytes * self.byte_scale
        # 1 GB/s is one byte per nanosecond.
        return round(self.latency_us * 1e3) + math.ceil(modelled / self.gbps)

    def step_start_ns(self, step: int) -> int:
        """When step ``step`` (1-based) starts: its loads are submitted then."""
        return (step - 1) * self.step_ns

    def step_end_ns(self, step: int) -> int:
        """When step ``step`` ends: its stores are submitted and its results polled then."""
        return step * self.step_ns

    def steps_for(self, nbytes: int) -> int:
        """Steps a lone load of ``nbytes`` spans, its start step included (docs, tests)."""
        return max(1, -(-self.job_ns(nbytes) // self.step_ns))


_FIXES = {
    "--transfer-gbps": "pass the host link's bandwidth in GB/s, e.g. --transfer-gbps 12",
    "--transfer-latency-us": "pass the per-job cost in microseconds, e.g. --transfer-latency-us 50",
    "--step-ms": "pass one engine step's length in milliseconds, e.g. --step-ms 20",
}
