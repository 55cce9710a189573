"""What a host-tier ``BlockStored`` event says about its block, snapshotted at the store.

Routers and indexers chain the blocks of a request by ``parent_block_hash`` and may re-hash
``token_ids``; vLLM's block pool publishes both for the GPU tier
(``BlockPool._build_block_stored_event``), and vLLM's OffloadingConnector publishes them for
the CPU tier in its self-describing mode (``offloading/events.py:287-350``). The host store
keeps only keys (a block hash and a group), so :class:`BlockPayloads` takes the rest from the
vLLM request when the connector emits the store, while the request is alive, and keeps it
until the store's entry leaves the host (its ``BlockRemoved``).

A key names one GPU block of its group (the connector moves whole blocks), ending at
``end_token``: its hash is ``request.block_hashes[end_token // hash_block_size - 1]``, its
parent the hash at ``end_token - block_size`` (None for the first block), its tokens
``all_token_ids[end_token - block_size : end_token]``. Kept only while vLLM's KV events are on.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from hybridkv.connector import TransferJob

__all__ = ["BlockPayload", "BlockPayloads"]


@dataclass(frozen=True, slots=True)
class BlockPayload:
    """A stored block's event fields besides its hash, group and block size."""

    parent_block_hash: Any  # vLLM's external block hash, or None for a request's first block
    token_ids: array[int]  # 8 bytes a token: a host tier holds many blocks
    lora_id: int | None
    lora_name: str | None


class BlockPayloads:
    """Per offload key, the :class:`BlockPayload` of its block (module docstring)."""

    def __init__(self, block_sizes: tuple[int, ...], hash_block_size: int) -> None:
        self._block_sizes = block_sizes
        self._hash_block_size = hash_block_size
        self._payloads: dict[bytes, BlockPayload] = {}

    def __len__(self) -> int:
        return len(self._payloads)

    def record(self, store_jobs: Iterable[TransferJob], requests: Mapping[str, Any]) -> None:
        """Snapshot every block these store jobs name (a key already known keeps its payload:
        equal hashes name equal blocks)."""
        payloads = self._payloads
        for job in store_jobs:
            request = requests.get(job.request_id)
            if request is None:
                continue
            for item in job.items:
                if item.key not in payloads:
                    payloads[item.key] = self._payload(request, item.group_idx, item.end_token)

    def get(self, key: bytes) -> BlockPayload | None:
        return self._payloads.get(key)

    def forget(self, key: bytes) -> None:
        """The key's entry left the host tier."""
        self._payloads.pop(key, None)

    def _payload(self, request: Any, group: int, end: int) -> BlockPayload:
        start = end - self._block_sizes[group]
        parent = None
        if start > 0:
            parent_hash = request.block_hashes[start // self._hash_block_size - 1]
            parent = maybe_convert_block_hash(parent_hash)
        lora = request.lora_request
        return BlockPayload(
            parent,
            array("q", request.all_token_ids[start:end]),
            None if lora is None else lora.adapter_id,
            None if lora is None else lora.name,
        )
