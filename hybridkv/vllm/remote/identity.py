"""What scopes the remote tier's chunk keys to one engine, read from vLLM's configuration:
the model identity (:func:`model_identity`, with :func:`config_digest` over what vLLM's own
config hashes say about the KV bytes) and how the tensor-parallel ranks map onto each chunk's
shards (:func:`remote_shards`). The package docstring says why the scope exists."""

from __future__ import annotations

import hashlib
from typing import Any

from hybridkv.remote import ModelIdentity, ShardPlan
from hybridkv.vllm.ranks import HostSharding

__all__ = ["config_digest", "model_identity", "remote_shards"]


def model_identity(vllm_config: Any, layout: Any, tp_rank: int = 0) -> ModelIdentity:
    """The :class:`~hybridkv.remote.ModelIdentity` of the engine ``vllm_config`` serves, over
    its :class:`~hybridkv.vllm.layout.VllmLayout`. ``tp_rank``: the rank whose shard the chunks
    hold (each shard's namespace names its own: :func:`hybridkv.remote.shard_namespaces`)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    groups = ";".join(
        f"{g.kind.value}:{g.block_size}:{g.page_size_bytes}:{g.real_page_size_bytes}:"
        + ",".join(g.layer_names)
        for g in layout.groups
    )
    return ModelIdentity(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=f"{model.dtype}/{cache.cache_dtype}",
        layout=f"hash={layout.hash_block_size};{groups}",
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        config=config_digest(vllm_config),
    )


def config_digest(vllm_config: Any) -> str:
    """SHA-256 over what the engine's configuration says about its KV bytes beyond the named
    fields, read from vLLM rather than picked by hand: vLLM's version, its model config hash
    (``ModelConfig.compute_hash``, ``config/model.py:457-526``: quantization, dtype, revision,
    max length, ...), its cache config hash (``CacheConfig.compute_hash``, ``config/cache.py``:
    KV-cache and mamba dtypes, block size, ...), and the model's config as vLLM loaded it, which
    carries ``hf_overrides`` (vLLM's own hash leaves them out, ``config/model.py:488``). Two
    engines whose digests differ might hold different KV for the same tokens: they never share.
    """
    from vllm import __version__

    model = vllm_config.model_config
    hf_config = model.hf_config
    to_json = getattr(hf_config, "to_json_string", None)
    hf_text = to_json(use_diff=False) if callable(to_json) else repr(hf_config)
    parts = (__version__, model.compute_hash(), vllm_config.cache_config.compute_hash(), hf_text)
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed: no part runs into the next
        data = str(part).encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def remote_shards(sharding: HostSharding, kv_cache_config: Any) -> ShardPlan:
    """The shards of a chunk for vLLM's ranks: one per group of ranks holding identical KV
    (``kv_tp_replicas``, whether or not the group shares a host region), fetched into a shared
    region by its first rank only (``sharding``, :func:`hybridkv.vllm.ranks.host_sharding`,
    which refused a replica count that does not divide the ranks)."""
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1))
    return ShardPlan(sharding.world_size, replicas, shared_host=sharding.replicas > 1)
