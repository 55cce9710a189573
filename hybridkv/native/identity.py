"""What a hybridkv tier under native scopes its chunks by: the model and the KV layout.

Native's keys are ``block_hash + group index`` (``make_offload_key``): equal prompts give equal
keys under another model, dtype or tensor-parallel layout. The tier mixes, into every chunk key,
the same identity fields native's own ``fs`` tier names its directory by
(``FileMapper.from_offloading_spec``'s run config: model, dtype, hash block, chunk blocks,
parallel layout, each KV cache group's layers) plus the chunk's byte size and the user's
namespace, so two engines share chunks exactly when all of them are equal.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm.v1.kv_offload.file_mapper import FileMapper

__all__ = ["identity_fields", "scoped"]


def identity_fields(offloading_spec: Any, block_bytes: int) -> dict[str, Any]:
    """The identity's fields, plain JSON values (logged at start and shown in ``snapshot``)."""
    mapper = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=offloading_spec, blocks_per_file=1, parallel_agnostic=True
    )
    fields = dict(mapper.get_run_config())
    fields["blocks_per_chunk"] = offloading_spec.blocks_per_chunk
    fields["chunk_bytes"] = block_bytes
    return fields


def scoped(namespace: bytes, fields: dict[str, Any]) -> bytes:
    """The namespace the tier's chunk keys are made under: SHA-256 of the user's namespace and
    the identity's fields (32 bytes; its hex names a disk tier's directory)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(namespace + b"\0" + canonical.encode()).digest()
