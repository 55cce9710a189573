"""The keys of a hybridkv tier inside native's ``secondary_tiers`` entry, checked eagerly.

vLLM's ``SecondaryTierFactory`` passes every key of the entry except ``type``, ``module_path``
and ``backpressure`` to the tier's constructor as a keyword. Each key here is named like the
``HybridKVConnector`` key that means the same (``remote_url``, ``remote_namespace``, ...,
``disk_dir``, ``disk_bytes``), and each bad value is a :class:`HybridKVConfigError` naming the
key, the value and the fix, raised when vLLM builds the tier (at engine start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hybridkv import HybridKVConfigError
from hybridkv.disk import DiskConfig
from hybridkv.remote import BreakerConfig, RemoteConfig

__all__ = ["TierSettings", "disk_settings", "remote_settings"]


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What a tier is built from: the chunk store's settings and the plug-in's own.

    Attributes:
        remote: the remote tier's settings (server, deadline, TTL, queue bound; its namespace
            is the user's, the tier scopes it by the model, :mod:`hybridkv.native.identity`).
        disk: the disk client's settings, or None for a Redis/Valkey tier.
        threads: the plug-in's transfer threads (>= 1): stores copied and promotions fetched
            side by side, never on the scheduler's thread.
        breaker: when a Redis tier stops asking a server seen down, and for how long (a disk
            tier has none: a local directory does not go away and come back).
    """

    remote: RemoteConfig
    disk: DiskConfig | None
    threads: int
    breaker: BreakerConfig | None = None

    def disk_config(self) -> DiskConfig:
        """The disk client's settings; a Redis tier's settings have none."""
        if self.disk is None:
            raise HybridKVConfigError("disk_dir", None, "is not set", "pass disk_dir, disk_bytes")
        return self.disk


def remote_settings(
    *,
    remote_url: str | None = None,
    remote_namespace: str = "hybridkv",
    remote_ttl_s: int = 0,
    remote_max_pending_writes: int = 64,
    remote_timeout_ms: int = 200,
    remote_breaker_failures: int = 3,
    remote_breaker_backoff_ms: int = 5000,
    threads: int = 4,
    **unknown: Any,
) -> TierSettings:
    """A Redis/Valkey tier's settings from the ``secondary_tiers`` entry's keys.

    ``remote_url``: ``redis://host:port`` (required). The rest as ``HybridKVConnector``'s keys
    of the same names (docs/howto/serve.md).
    """
    _no_unknown(unknown, "HybridKVRemoteTier")
    if not isinstance(remote_url, str) or not remote_url.startswith("redis://"):
        raise HybridKVConfigError(
            "remote_url", remote_url, "must be redis://host:port", "name the Redis/Valkey server"
        )
    parts = urlsplit(remote_url)
    try:
        port = parts.port or 6379
    except ValueError as error:
        raise HybridKVConfigError(
            "remote_url", remote_url, f"has a bad port ({error})", "use redis://host:6379"
        ) from None
    deadline_s = _int(remote_timeout_ms, "remote_timeout_ms", 1, 3_599_999) / 1000
    remote = RemoteConfig(
        host=parts.hostname or "",
        port=port,
        connect_timeout_s=deadline_s,
        deadline_s=deadline_s,
        ttl_s=_int(remote_ttl_s, "remote_ttl_s", 0, 2**31 - 1),
        max_pending=_int(remote_max_pending_writes, "remote_max_pending_writes", 1, 2**31 - 1),
        namespace=_namespace(remote_namespace),
    )
    breaker = BreakerConfig(
        failures=_int(remote_breaker_failures, "remote_breaker_failures", 1, 1_000_000),
        backoff_s=_int(remote_breaker_backoff_ms, "remote_breaker_backoff_ms", 1, 3_600_000) / 1000,
    )
    return TierSettings(remote, None, _int(threads, "threads", 1, 256), breaker)


def disk_settings(
    *,
    disk_dir: str | None = None,
    disk_bytes: int | None = None,
    disk_policy: str = "lru",
    disk_threads: int = 4,
    disk_fsync: str = "file",
    disk_direct: str = "auto",
    remote_namespace: str = "hybridkv",
    remote_max_pending_writes: int = 64,
    threads: int = 4,
    **unknown: Any,
) -> TierSettings:
    """A disk tier's settings: ``disk_dir`` and ``disk_bytes`` required, the rest as
    ``HybridKVConnector``'s keys of the same names (docs/howto/disk-tier.md). The directory
    the files go in is ``disk_dir``/<the model identity's digest> (:mod:`.identity`), made by
    the tier, so another model never reads them."""
    _no_unknown(unknown, "HybridKVDiskTier")
    if not isinstance(disk_dir, str) or not disk_dir:
        raise HybridKVConfigError("disk_dir", disk_dir, "must name a directory", "pass a path")
    if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes <= 0:
        raise HybridKVConfigError(
            "disk_bytes", disk_bytes, "must be an int > 0", "pass the directory's byte limit"
        )
    disk = DiskConfig(
        directory=Path(disk_dir),
        capacity_bytes=disk_bytes,
        policy=disk_policy,
        threads=disk_threads,
        fsync=disk_fsync,  # DiskConfig takes the value ("file", "never") and checks it
        direct=disk_direct,
    )
    remote = RemoteConfig(
        namespace=_namespace(remote_namespace),
        max_pending=_int(remote_max_pending_writes, "remote_max_pending_writes", 1, 2**31 - 1),
    )
    return TierSettings(remote, disk, _int(threads, "threads", 1, 256))


def _int(value: object, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HybridKVConfigError(key, value, f"must be an int in [{low}, {high}]", "pass one")
    return value


def _namespace(value: object) -> bytes:
    if not isinstance(value, str) or not value:
        raise HybridKVConfigError(
            "remote_namespace", value, "must be a non-empty string", "pass e.g. 'fleet-a'"
        )
    return value.encode()


def _no_unknown(unknown: dict[str, Any], tier: str) -> None:
    if unknown:
        name = sorted(unknown)[0]
        raise HybridKVConfigError(
            name,
            unknown[name],
            f"is not a key of {tier}",
            "see docs/howto/native-offloading.md for the keys",
        )
