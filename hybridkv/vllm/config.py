"""``kv_connector_extra_config`` for :class:`~hybridkv.vllm.connector.HybridKVConnector`, parsed
and validated once, when vLLM builds the connector (engine start-up), never later.

Every key, its default and what it does (docs/howto/serve.md repeats this table):

- ``host_memory_bytes`` (int >= 1, default 4 GiB): the host tier's size, all tensor-parallel
  ranks together; it is cut into whole slots of the largest group's block (all its layers, one
  rank's shard), so the store holds ``host_memory_bytes // (slot_bytes * world_size)`` chunks
  and each rank holds that many slots. Ranks holding identical KV (vLLM's ``kv_tp_replicas``,
  MLA) share one copy: the division is by the distinct shards, ``world_size //
  kv_tp_replicas`` (:class:`hybridkv.vllm.ranks.HostSharding`). Per engine: under data
  parallelism each DP engine allocates all of it for its own ranks.
- ``chunk_size`` (int or null, default null = the recommendation of
  :func:`hybridkv.vllm.layout.recommended_chunk_size`): the offload chunk in tokens.
- ``eviction_policy`` (``"lru"`` | ``"arc"``, default ``"lru"``): the host store's policy.
- ``load_deadline_steps`` (int >= 1 or null, default null = none): a load not reported within
  this many engine steps after the step that started it is abandoned: the worker stops its copy
  and reports the request failed, and vLLM recomputes it (``kv_load_failure_policy`` must be
  ``"recompute"``). null: wait for every load, as vLLM 0.33 does
  (:mod:`hybridkv.connector.deadlines`).
- ``offload_decode_state`` (bool, default true): store the units completed by decode steps
  (the continuation a next turn hits), not only the prompt's.
- ``gpu_scratch_bytes`` (int >= 0, default 64 MiB): GPU memory each worker allocates once, when
  it registers its caches, as scratch of the CUDA engine's index-kernel copies (half per
  direction; :mod:`hybridkv.transfer.cuda_kernels`). vLLM has sized its KV cache by then, so
  it comes out of the headroom ``--gpu-memory-utilization`` leaves; the worker logs it. 0: no
  scratch, every copy by DMA. Unused on CPU caches.
- ``sync_load_max_bytes`` (int >= 0, default 0 = every load async): loads up to this many bytes
  would run before the step's forward. Only 0 is accepted: vLLM 0.33 has no way to undo a
  failed sync load on a model with more than one KV cache group. Block ids raise
  (``v1/core/sched/scheduler.py:3712-3721``), a ``failed_recving`` id is ignored for a running
  request (3688-3701) or dropped by the multi-worker aggregator
  (``distributed/kv_transfer/kv_connector/utils.py:180-183``), and with ``finished_recving``
  it trips an assert (3577); the forward has read the blocks by then.
  ``tests/vllm/test_sync_load_failures_vs_vllm.py`` shows each
  (docs/explanation/vllm-differential.md, "Sync loads").

The remote tier (issue 12, :mod:`hybridkv.vllm.remote`; off by default,
docs/howto/share-prefix-cache.md):

- ``remote_url`` (``"redis://host:port"`` or ``"redis://host:port/0"``, or null = no remote
  tier): the Redis/Valkey server engines share. Only database 0 (chunks are namespaced by
  ``remote_namespace`` instead). Under tensor parallelism each rank shares its own shard of
  every chunk (:mod:`hybridkv.remote.shards`).
  A Redis/Valkey Cluster: ``"redis+cluster://host1:port1,host2:port2"``, its seed nodes (one
  is enough, the client learns every shard from the first that answers; no database).
- ``remote_namespace`` (non-empty str, default ``"hybridkv"``): mixed into every chunk key;
  engines share chunks only under equal namespaces (and equal models and salts).
- ``remote_ttl_s`` (int >= 0, default 0 = none): the TTL of each written chunk on the server.
- ``remote_max_pending_writes`` (int >= 1, default 64): writes queued or in flight at most; a
  write beyond it is dropped (counted), never waited for.
- ``remote_timeout_ms`` (int in [1, 60000], default 200): the longest any one server call
  (connect, EXISTS, GET, SET) waits; past it a fetch resolves TIMEOUT and is recomputed.
- ``remote_lookup_wait_ms`` (int in [0, 60000], default 20): lookups run off the scheduler
  thread; a request whose lookup is not answered is deferred (vLLM asks again next step) for
  at most this long (and 16 steps) in all, then scheduled without the remote hit. 0: never
  deferred.
- ``remote_breaker_failures`` (int >= 1, default 3) and ``remote_breaker_backoff_ms`` (int in
  [1, 3600000], default 5000): that many consecutive failed server calls open each side's
  circuit breaker; the tier is then skipped (lookups answer no hit at once, fetches fail at
  once, writes are dropped, all counted) for the backoff, then probed with one call.

Unknown keys and bad values raise a one-line :class:`~hybridkv.errors.HybridKVConfigError`
naming the key, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError

__all__ = [
    "DEFAULTS",
    "HybridKVConfig",
    "RemoteSettings",
    "check_failure_policy",
    "parse_extra_config",
]

DEFAULTS: dict[str, Any] = {
    "host_memory_bytes": 4 << 30,
    "chunk_size": None,
    "eviction_policy": "lru",
    "load_deadline_steps": None,
    "offload_decode_state": True,
    "gpu_scratch_bytes": 64 << 20,
    "sync_load_max_bytes": 0,
    "remote_url": None,
    "remote_namespace": "hybridkv",
    "remote_ttl_s": 0,
    "remote_max_pending_writes": 64,
    "remote_timeout_ms": 200,
    "remote_lookup_wait_ms": 20,
    "remote_breaker_failures": 3,
    "remote_breaker_backoff_ms": 5000,
}
_POLICIES = ("lru", "arc")
CLUSTER_SCHEME = "redis+cluster://"
_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """The remote tier's keys, parsed (module docstring); the connector builds a
    :class:`hybridkv.remote.RemoteConfig` from them."""

    host: str
    port: int
    namespace: str
    ttl_s: int
    max_pending_writes: int
    timeout_s: float
    lookup_wait_s: float = 0.02
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0
    cluster_nodes: tuple[tuple[str, int], ...] = ()  # a cluster's seeds; host, port the first


@dataclass(frozen=True, slots=True)
class HybridKVConfig:
    """The parsed extra config (module docstring for each field's meaning)."""

    host_memory_bytes: int
    chunk_size: int | None
    eviction_policy: str
    load_deadline_steps: int | None
    offload_decode_state: bool
    sync_load_max_bytes: int
    gpu_scratch_bytes: int = 64 << 20
    remote: RemoteSettings | None = None


def parse_extra_config(extra: Mapping[str, Any] | None) -> HybridKVConfig:
    """The validated config of ``extra`` (vLLM's ``kv_connector_extra_config``; None = {}).

    Refusal: the first unknown key or bad value, as :class:`HybridKVConfigError`.
    """
    given = dict(extra or {})
    for key in sorted(given):
        if key not in DEFAULTS:
            raise HybridKVConfigError(
                f"{_WHERE}.{key}",
                given[key],
                "is not a hybridkv key",
                f"use only {', '.join(sorted(DEFAULTS))} (docs/howto/serve.md)",
            )
    values = {**DEFAULTS, **given}
    config = HybridKVConfig(
        host_memory_bytes=_int(values, "host_memory_bytes", low=1),
        chunk_size=_optional_int(values, "chunk_size"),
        eviction_policy=_policy(values["eviction_policy"]),
        load_deadline_steps=_optional_int(values, "load_deadline_steps"),
        offload_decode_state=_bool(values, "offload_decode_state"),
        sync_load_max_bytes=_int(values, "sync_load_max_bytes", low=0),
        gpu_scratch_bytes=_int(values, "gpu_scratch_bytes", low=0),
        remote=_remote(values),
    )
    _refuse_unimplemented(config)
    return config


def check_failure_policy(config: HybridKVConfig, kv_load_failure_policy: str) -> None:
    """Refuse a load deadline unless vLLM recomputes failed loads: an abandoned load is reported
    failed, and under ``"fail"`` vLLM would end the request with an error instead."""
    if config.load_deadline_steps is not None and kv_load_failure_policy != "recompute":
        raise HybridKVConfigError(
            f"{_WHERE}.load_deadline_steps",
            config.load_deadline_steps,
            f"needs kv_load_failure_policy 'recompute' (it is {kv_load_failure_policy!r}: an "
            "abandoned load would fail its request)",
            'set "kv_load_failure_policy": "recompute", or leave the deadline null',
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(values: Mapping[str, Any], key: str, *, low: int) -> int:
    value = values[key]
    if not _is_int(value) or value < low:
        raise HybridKVConfigError(
            f"{_WHERE}.{key}", value, f"must be an integer >= {low}", f"e.g. {DEFAULTS[key]}"
        )
    return int(value)


def _optional_int(values: Mapping[str, Any], key: str) -> int | None:
    value = values[key]
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise HybridKVConfigError(
            f"{_WHERE}.{key}", value, "must be an integer >= 1 or null", "e.g. null (default)"
        )
    return int(value)


def _bool(values: Mapping[str, Any], key: str) -> bool:
    value = values[key]
    if not isinstance(value, bool):
        raise HybridKVConfigError(
            f"{_WHERE}.{key}", value, "must be true or false", "write a JSON boolean"
        )
    return value


def _policy(value: object) -> str:
    if value not in _POLICIES:
        raise HybridKVConfigError(
            f"{_WHERE}.eviction_policy", value, "is not an eviction policy", "use lru or arc"
        )
    return str(value)


def _remote(values: Mapping[str, Any]) -> RemoteSettings | None:
    url = values["remote_url"]
    if url is None:
        for key in (
            "remote_namespace",
            "remote_ttl_s",
            "remote_max_pending_writes",
            "remote_timeout_ms",
            "remote_lookup_wait_ms",
            "remote_breaker_failures",
            "remote_breaker_backoff_ms",
        ):
            if values[key] != DEFAULTS[key]:
                raise HybridKVConfigError(
                    f"{_WHERE}.{key}", values[key], "is set but remote_url is null",
                    'set "remote_url": "redis://host:port", or drop the key',
                )  # fmt: skip
        return None
    seeds = _cluster_url(url) if str(url).startswith(CLUSTER_SCHEME) else ()
    host, port = seeds[0] if seeds else _redis_url(url)
    namespace = values["remote_namespace"]
    if not isinstance(namespace, str) or not namespace:
        raise HybridKVConfigError(
            f"{_WHERE}.remote_namespace", namespace, "must be a non-empty string", 'e.g. "prod"'
        )
    timeout_ms = _int(values, "remote_timeout_ms", low=1)
    if timeout_ms > 60_000:
        raise HybridKVConfigError(
            f"{_WHERE}.remote_timeout_ms", timeout_ms, "must be at most 60000", "e.g. 200"
        )
    return RemoteSettings(
        host=host,
        port=port,
        namespace=namespace,
        ttl_s=_int(values, "remote_ttl_s", low=0),
        max_pending_writes=_int(values, "remote_max_pending_writes", low=1),
        timeout_s=timeout_ms / 1000,
        lookup_wait_s=_int_at_most(values, "remote_lookup_wait_ms", 0, 60_000) / 1000,
        breaker_failures=_int(values, "remote_breaker_failures", low=1),
        breaker_backoff_s=_int_at_most(values, "remote_breaker_backoff_ms", 1, 3_600_000) / 1000,
        cluster_nodes=seeds,
    )


def _int_at_most(values: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = _int(values, key, low=low)
    if value > high:
        raise HybridKVConfigError(
            f"{_WHERE}.{key}", value, f"must be at most {high}", f"e.g. {DEFAULTS[key]}"
        )
    return value


def _redis_url(url: object) -> tuple[str, int]:
    """``redis://host:port[/0]`` -> (host, port)."""
    field = f"{_WHERE}.remote_url"
    fix = (
        'write "redis://HOST:PORT" (database 0; separate engines with remote_namespace), '
        f'or "{CLUSTER_SCHEME}HOST:PORT,HOST:PORT" for a cluster'
    )
    if not isinstance(url, str) or not url.startswith("redis://"):
        raise HybridKVConfigError(field, url, "is not a redis:// URL", fix)
    rest = url[len("redis://") :]
    where, _, db = rest.partition("/")
    if db not in ("", "0"):
        raise HybridKVConfigError(field, url, f"names database {db!r}: only 0 is used", fix)
    host, _, port = where.rpartition(":")
    if not host or "@" in host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HybridKVConfigError(field, url, "needs a host and a port 1..65535, no user", fix)
    return host, int(port)


def _cluster_url(url: str) -> tuple[tuple[str, int], ...]:
    """``redis+cluster://h1:p1,h2:p2[/0]`` -> the seeds ((h1, p1), (h2, p2))."""
    field = f"{_WHERE}.remote_url"
    fix = f'write "{CLUSTER_SCHEME}HOST:PORT,HOST:PORT" (the seed nodes, no user, no database)'
    where, _, db = url[len(CLUSTER_SCHEME) :].partition("/")
    if db not in ("", "0"):
        raise HybridKVConfigError(field, url, f"names database {db!r}: a cluster has only 0", fix)
    seeds = []
    for node in where.split(","):
        host, _, port = node.strip().rpartition(":")
        number = port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
        if not host or "@" in host or not number:
            raise HybridKVConfigError(
                field, url, f"seed {node!r} needs a host and a port 1..65535, no user", fix
            )
        seeds.append((host, int(port)))
    if len(set(seeds)) != len(seeds):
        raise HybridKVConfigError(field, url, "names a seed twice", fix)
    return tuple(seeds)


def _refuse_unimplemented(config: HybridKVConfig) -> None:
    """Values of keys whose behaviour is not built yet are refused, never silently ignored."""
    if config.sync_load_max_bytes != 0:
        raise HybridKVConfigError(
            f"{_WHERE}.sync_load_max_bytes",
            config.sync_load_max_bytes,
            "sync loads are refused: with several KV cache groups vLLM 0.33 cannot undo a "
            "failed sync load (block ids raise at v1/core/sched/scheduler.py:3712, "
            "failed_recving of a running request is ignored at 3688-3701)",
            "leave it 0, every load async (docs/explanation/vllm-differential.md, Sync loads)",
        )
