"""The negative controls: ``HybridKVConnector`` whose loads deliver corrupted bytes.

Loaded by module path (``kv_connector_module_path="_corrupting_connector"``, with tests/e2e on
the engine's ``sys.path``), so vLLM builds it exactly as it builds the real connector. Its
worker side wraps the transfer engine through the connector's in-package engine hook
(``HybridKVConnector._register(wrap_engine=...)``, the hook hybridkv.vllm.harness.cpu_worker injects
its faults through): before each load is queued, the host slots it reads are overwritten with
seeded random bytes, so every block the host tier hands back holds garbage. The job still
reports success: vLLM trusts it and computes on those blocks.

A run with this connector must answer differently from the baseline on some request, or the
end-to-end check that answers equal the baseline's could not tell loaded KV from recomputed KV.

``ZeroingHybridKVConnector`` overwrites the slots with zeros instead. It is the control of the
bfloat16 models, judged by logprob drift (``_drift``): random bytes read as bfloat16 include
NaNs, which any check sees, while zeroed KV and state keep every logit finite, a subtler wrong
load the drift bound must still tell apart from vLLM's own variation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridkv.transfer import TransferEngine
from hybridkv.transfer.api import Direction, FinishedJob, JobId, TransferPair
from hybridkv.vllm import HybridKVConnector

__all__ = ["CorruptingHybridKVConnector", "ZeroingHybridKVConnector"]


class _CorruptLoads(TransferEngine):
    """Delegates every call; overwrites a load's source slots before the load is queued."""

    def __init__(
        self, inner: TransferEngine, owner: CorruptingHybridKVConnector, zeros: bool
    ) -> None:
        self._inner = inner
        self._owner = owner
        self._zeros = zeros
        self._random = torch.Generator().manual_seed(0)

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if direction is Direction.LOAD:
            host = self._owner._host
            assert host is not None, "a load before register_kv_caches finished"
            for pair in pairs:
                slot = host.slot(pair.slot)
                if self._zeros:
                    slot.zero_()
                else:
                    slot.copy_(
                        torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=self._random)
                    )
            self._owner.corrupted_slots += len(pairs)
        return self._inner.submit(direction, pairs)

    def poll(self) -> list[FinishedJob]:
        return self._inner.poll()

    def wait(self, job_ids: Iterable[JobId]) -> None:
        self._inner.wait(job_ids)

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        self._inner.abandon(job_ids)

    def close(self) -> None:
        self._inner.close()


class CorruptingHybridKVConnector(HybridKVConnector):
    """``HybridKVConnector`` whose every load reads random bytes (module docstring)."""

    ZEROS = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupted_slots = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._register(
            kv_caches, wrap_engine=lambda engine: _CorruptLoads(engine, self, self.ZEROS)
        )


class ZeroingHybridKVConnector(CorruptingHybridKVConnector):
    """``HybridKVConnector`` whose every load reads zeros (module docstring)."""

    ZEROS = True
