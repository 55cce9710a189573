"""vLLM 0.33's native ``OffloadingConnector`` with ``TieringOffloadingSpec`` and any secondary
tiers, its worker on CPU tensors: how the tests and the bench run hybridkv's native plug-ins.

As :class:`~.native_tiering.NativeTieringOnCPU` (the worker's host chunks are this rank's views
of the spec's shared region, so what a secondary tier reads from or writes into the primary
tier is what the worker stores and loads), with the ``secondary_tiers`` entries given rather
than the ``fs`` tier's. The tiers are built by vLLM's own ``SecondaryTierFactory`` from those
entries (``type`` + ``module_path``), exactly as a server builds them.
"""

from __future__ import annotations

import copy
from typing import Any

from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU
from hybridkv.vllm.harness.native_tiering import NativeTieringOnCPU

__all__ = ["NativePluginsOnCPU"]


class NativePluginsOnCPU(NativeTieringOnCPU):
    """The worker adapter for ``OffloadingConnector`` + ``TieringOffloadingSpec`` + ``tiers``.

    ``host_chunks``: the CPU primary tier in chunks; ``tiers``: the ``secondary_tiers`` entries
    (copied into the connector's extra config by :meth:`configure`); ``delay``: the steps a
    GPU <-> host copy takes.
    """

    def __init__(self, host_chunks: int, tiers: list[dict[str, Any]], *, delay: int = 1):
        NativeOffloadOnCPU.__init__(self, host_chunks, delay)
        self.tiers = copy.deepcopy(tiers)
        self._tally = None
        self._region = None

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        NativeOffloadOnCPU.configure(self, vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = copy.deepcopy(self.tiers)

    @staticmethod
    def secondary_tiers(engine: Any) -> list[Any]:
        """The tiers vLLM built, in the entries' order (the scheduler side's manager's)."""
        return list(engine.scheduler.connector.connector_scheduler.manager.secondary_tiers)
