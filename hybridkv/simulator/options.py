"""What ``hybridkv simulate`` is asked for (:class:`SimOptions`) and the version of the report's
schema: the light half of the simulator, which the command line imports to parse its flags
without loading torch or the engines."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.testbed.copy_time import DEFAULT_GBPS, DEFAULT_LATENCY_US, DEFAULT_STEP_MS

__all__ = ["DEFAULT_REQUESTS", "SCHEMA_VERSION", "SimOptions"]

SCHEMA_VERSION = 2  # 2: first-time token identity, served_again, observed recovery, transfers

DEFAULT_REQUESTS = 32


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Everything ``hybridkv simulate`` was asked for (flags of the same names)."""

    preset: str | None = None
    config: str | None = None
    trace: str = "multi-turn"
    requests: int | None = None
    device: str = "cpu"
    host_bytes: int = 2**30
    policy: str = "lru"
    faults: float = 0.0
    check: bool = False
    seed: int = 0
    connector: str = "optimized"
    gpu_blocks: int | None = None
    layers_per_group: int = 1
    max_num_batched_tokens: int = 2048
    max_num_running: int = 8
    max_model_len: int = 32768
    load_deadline_steps: int | None = 64
    transfer_gbps: float = DEFAULT_GBPS
    transfer_latency_us: float = DEFAULT_LATENCY_US
    step_ms: float = DEFAULT_STEP_MS
    aborts: float = 0.0
    engine: str = "spec"
