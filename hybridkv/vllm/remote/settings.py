"""The connector's parsed ``remote_*`` keys (:class:`~hybridkv.vllm.config.RemoteSettings`) as
the library's configs, each side's defaults, and the refusal of block hashes no two engines
share (a shared tier keyed by them would never hit)."""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import BreakerConfig, LookupPolicy, RemoteConfig
from hybridkv.vllm.config import RemoteSettings

__all__ = [
    "DEFAULT_BREAKER",
    "DEFAULT_LOOKUPS",
    "breaker_config",
    "lookup_policy",
    "refuse_unshared_hashes",
    "remote_config",
]

DEFAULT_LOOKUPS = LookupPolicy()
DEFAULT_BREAKER = BreakerConfig()


def lookup_policy(settings: RemoteSettings) -> LookupPolicy:
    """The scheduler side's lookup policy for the connector's parsed keys."""
    return LookupPolicy(wait_s=settings.lookup_wait_s)


def breaker_config(settings: RemoteSettings) -> BreakerConfig:
    """Each side's circuit breaker for the connector's parsed keys."""
    return BreakerConfig(settings.breaker_failures, settings.breaker_backoff_s)


def remote_config(settings: RemoteSettings) -> RemoteConfig:
    """The library tier's config for the connector's parsed keys."""
    return RemoteConfig(
        host=settings.host,
        port=settings.port,
        connect_timeout_s=settings.timeout_s,
        deadline_s=settings.timeout_s,
        ttl_s=settings.ttl_s,
        max_pending=settings.max_pending_writes,
        namespace=settings.namespace.encode(),
        credentials=settings.credentials,
        tls=settings.tls,
        key=settings.key,
        cluster_nodes=settings.cluster_nodes,
    )


# vLLM's non-cryptographic block hashes (``_NON_CRYPTO_HASH_FUNCTIONS``,
# ``v1/core/kv_cache_utils.py:111``): without PYTHONHASHSEED their seed is fresh random bytes per
# process (``resolve_none_hash_seed``, 117-130), so no two engines, nor one engine after a
# restart, ever compute the same block hash.
_PER_PROCESS_SEEDED = frozenset({"xxhash", "xxhash_cbor"})


def refuse_unshared_hashes(
    hash_algo: str, environ: Mapping[str, str], key: str = "remote_url"
) -> None:
    """A remote or disk tier (``key``: the one configured) is keyed by vLLM's block hashes:
    refuse a hash whose seed is random per process (it would never hit across engines or
    restarts, and nothing would say so)."""
    if hash_algo in _PER_PROCESS_SEEDED and environ.get("PYTHONHASHSEED") is None:
        raise HybridKVConfigError(
            f"kv_connector_extra_config.{key}",
            f"--prefix-caching-hash-algo {hash_algo} without PYTHONHASHSEED",
            f"{hash_algo} block hashes are seeded with random bytes per process, so the shared "
            "tier would never hit across engines or restarts",
            "set PYTHONHASHSEED to the same value on every engine, or use "
            f"--prefix-caching-hash-algo sha256 (the default), or drop {key}",
        )
