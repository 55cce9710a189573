"""The data plane as the simulation drives it: the worker side of a connector, in vLLM's hook order.

:class:`~hybridkv.simulator.engine.Simulation` calls these hooks once per step, in the order
vLLM's worker calls a connector's (``v1/worker/gpu/kv_connector.py:76-160``). Two planes
implement them: :class:`hybridkv.simulator.optimized.OptimizedPlane` (the optimized core's
worker) and :class:`hybridkv.simulator.reference.ReferencePlane` (the spec's reference
connector); both move real bytes through a timed transfer engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from spec.connector_api import ConnectorMeta, KVConnectorOutput, RequestId

__all__ = ["DataPlane", "PlaneStats"]


class PlaneStats(Protocol):
    """What a data plane has moved so far."""

    bytes_loaded: int
    bytes_stored: int
    load_seconds: float
    store_seconds: float
    failures_injected: int


class DataPlane(Protocol):
    """The worker side as the simulation drives it (vLLM's worker hooks, in step order)."""

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs."""
        ...

    def start_load_kv(self) -> None:
        """Start this step's loads (vLLM ``start_load_kv``)."""
        ...

    def wait_for_save(self) -> None:
        """Start this step's stores, after the forward wrote their blocks."""
        ...

    def get_transfer_results(self) -> KVConnectorOutput:
        """Wait for every started job, fold the results (vLLM ``get_transfer_results``)."""
        ...

    def get_block_ids_with_load_errors(self) -> Mapping[RequestId, frozenset[int]]:
        """Per failed load, the blocks its failed jobs left invalid (handed out once)."""
        ...

    def stats(self) -> PlaneStats:
        """Bytes and seconds moved per direction, failures injected."""
        ...

    def store_occupancy(self) -> tuple[int, int]:
        """The host store's ``(used entries, capacity)``."""
        ...

    def store_snapshot(self) -> Mapping[str, Any] | None:
        """The host store's snapshot in the spec's schema (``None``: not available)."""
        ...

    def store_holds(self, key: bytes) -> bool:
        """Whether the host store holds ``key`` (READY or STORING)."""
        ...

    def close(self) -> None:
        """Release threads and memory."""
        ...
