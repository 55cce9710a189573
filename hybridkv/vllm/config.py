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

- ``remote_url`` (``"redis://host:port"`` or ``"redis://host:port/0"``, ``rediss://`` for TLS,
  or null = no remote tier): the Redis/Valkey server engines share. Only database 0 (chunks are
  namespaced by ``remote_namespace`` instead). No user or password in it, in any form: those
  come from the keys below. Under tensor parallelism each rank shares its own shard of every
  chunk (:mod:`hybridkv.remote.shards`).
  A Redis/Valkey Cluster: ``"redis+cluster://host1:port1,host2:port2"`` (``rediss+cluster://``
  for TLS), its seed nodes (one is enough, the client learns every shard from the first that
  answers; no database). The security keys below apply to every node alike.
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

Security (issue 30; docs/howto/share-prefix-cache.md, "Secure set-up" and "Threat model").
Secrets are read when the config is parsed (engine start-up, every process), from an
environment variable or a file, never from the config, which vLLM logs:

- ``remote_username`` (str or null): the ACL user; needs a password.
- ``remote_password_env`` / ``remote_password_file`` (str or null, at most one): the variable
  or the file holding the password (``requirepass``, or the ACL user's).
- ``remote_tls_ca_file`` (str or null = the system's CAs), ``remote_tls_cert_file`` and
  ``remote_tls_key_file`` (both or neither: a client certificate): TLS files; need ``rediss://``.
- ``remote_secret_env`` / ``remote_secret_file`` (str or null, at most one): the fleet secret
  (at least 32 bytes), the same on every engine sharing the namespace. With it every value
  carries an HMAC-SHA256 over its chunk key and bytes, and values without a valid one are
  refused (a miss). Without it values carry a plain digest, which anyone who can write to the
  server can forge.
- ``remote_encrypt`` (bool, default false; needs the secret and ``hybridkv[remote-crypto]``):
  payloads are written AES-256-GCM encrypted.

The disk tier (issue 31, :mod:`hybridkv.vllm.disk`; off by default, docs/howto/disk-tier.md):
chunks written to files under a directory, under the host tier, through the remote tier's
write-behind and verified fetches (:mod:`hybridkv.disk`):

- ``disk_dir`` (str or null = no disk tier): the root directory. Each model identity (and each
  tensor-parallel rank's shard) gets its own subdirectory, named by the hex SHA-256 of the
  identity (:func:`hybridkv.vllm.disk.disk_directory`), so a restart of the same model finds
  its files and another model never does. Created if missing. Several engines may share it
  (locally or on NFS, Lustre, GPFS).
- ``disk_bytes`` (int >= 1, required with ``disk_dir``): bytes the tier's files may take on
  disk, all tensor-parallel ranks together (each rank's shard gets ``disk_bytes // shards``);
  it holds at every moment, writes in flight included.
- ``disk_policy`` (``"lru"`` | ``"arc"``, default ``"lru"``): the disk index's eviction policy.
- ``disk_threads`` (int >= 1, default 4): each worker's disk I/O threads.
- ``disk_fsync`` (``"file"`` | ``"never"``, default ``"file"``): ``"file"`` fsyncs each file
  before its rename (a chunk survives a power loss once visible); ``"never"`` renames without
  (a kill -9 never tears a visible chunk; a power loss may, and the digest then makes it a
  miss).
- ``disk_direct`` (``"auto"`` | ``"on"`` | ``"off"``, default ``"auto"``): O_DIRECT I/O;
  ``"auto"`` falls back to buffered where the filesystem refuses it (logged once), ``"on"``
  refuses to start there.

With ``remote_url`` too, the tiers stack host -> disk -> server
(:class:`hybridkv.remote.StackedClient`): a lookup or a read asks the disk first, then the
server, and a server hit is written to the disk; a write goes to both. The server's keys
(``remote_namespace``, timeout, breaker) apply; the disk is never behind the breaker.

Unknown keys and bad values raise a one-line :class:`~hybridkv.errors.HybridKVConfigError`
naming the key, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.security import Credentials, FleetKey, TlsFiles, read_secret

__all__ = [
    "DEFAULTS",
    "DiskSettings",
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
    "remote_username": None,
    "remote_password_env": None,
    "remote_password_file": None,
    "remote_tls_ca_file": None,
    "remote_tls_cert_file": None,
    "remote_tls_key_file": None,
    "remote_secret_env": None,
    "remote_secret_file": None,
    "remote_encrypt": False,
    "disk_dir": None,
    "disk_bytes": None,
    "disk_policy": "lru",
    "disk_threads": 4,
    "disk_fsync": "file",
    "disk_direct": "auto",
}
_POLICIES = ("lru", "arc")
_TLS_FILES = ("remote_tls_ca_file", "remote_tls_cert_file", "remote_tls_key_file")
_SECURITY_STRINGS = (
    "remote_username",
    "remote_password_env",
    "remote_password_file",
    *_TLS_FILES,
    "remote_secret_env",
    "remote_secret_file",
)
CLUSTER_SCHEME = "redis+cluster://"
# Every remote_url scheme; each with "s" after "redis" speaks TLS. No one is a prefix of another.
_SCHEMES = ("redis://", "rediss://", CLUSTER_SCHEME, "rediss+cluster://")
_URL_FIX = (
    'write "redis://HOST:PORT" (database 0; separate engines with remote_namespace), '
    f'or "{CLUSTER_SCHEME}HOST:PORT,HOST:PORT" for a cluster'
)
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
    credentials: Credentials = field(default_factory=Credentials)
    tls: TlsFiles | None = None
    key: FleetKey | None = None
    cluster_nodes: tuple[tuple[str, int], ...] = ()  # a cluster's seeds; host, port the first


@dataclass(frozen=True, slots=True)
class DiskSettings:
    """The disk tier's keys, parsed (module docstring); :mod:`hybridkv.vllm.disk` builds each
    rank's :class:`hybridkv.disk.DiskConfig` from them. ``fsync`` and ``direct`` are the key's
    words (``"file"``, ``"auto"``...)."""

    root: str
    capacity_bytes: int
    policy: str = "lru"
    threads: int = 4
    fsync: str = "file"
    direct: str = "auto"


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
    disk: DiskSettings | None = None


def parse_extra_config(extra: Mapping[str, Any] | None) -> HybridKVConfig:
    """The validated config of ``extra`` (vLLM's ``kv_connector_extra_config``; None = {}).

    Refusal: the first unknown key or bad value, as :class:`HybridKVConfigError`.
    """
    given = dict(extra or {})
    for key in sorted(given):
        if key not in DEFAULTS:
            # "remote_password": "..." is a likely mistake: never echo what may be a secret.
            secret = "password" in key or "secret" in key
            raise HybridKVConfigError(
                f"{_WHERE}.{key}",
                "<hidden>" if secret else given[key],
                "is not a hybridkv key",
                _known_keys(key),
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
        disk=_disk(values),
    )
    _refuse_unimplemented(config)
    return config


def _known_keys(unknown: str) -> str:
    """The keys to use instead of ``unknown``: the remote tier's for a ``remote_*`` typo, else
    the others (all of them make a line past what an error message shows)."""
    if unknown.startswith("remote_"):
        remote = ", ".join(k for k in sorted(DEFAULTS) if k.startswith("remote_"))
        return f"use only {remote} (docs/howto/share-prefix-cache.md)"
    if unknown.startswith("disk_"):
        disk = ", ".join(k for k in sorted(DEFAULTS) if k.startswith("disk_"))
        return f"use only {disk} (docs/howto/disk-tier.md)"
    others = ", ".join(k for k in sorted(DEFAULTS) if not k.startswith(("remote_", "disk_")))
    return f"use only {others}, or a remote_* or disk_* key (docs/howto/serve.md)"


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
        for key in (k for k in DEFAULTS if k.startswith("remote_")):  # remote_url: at default
            if values[key] != DEFAULTS[key]:
                raise HybridKVConfigError(
                    f"{_WHERE}.{key}", values[key], "is set but remote_url is null",
                    'set "remote_url": "redis://host:port", or drop the key',
                )  # fmt: skip
        return None
    scheme, where = _scheme(url)
    seeds = _cluster_url(url, where) if scheme.endswith("+cluster://") else ()
    host, port = seeds[0] if seeds else _redis_url(url, where)
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
        **_security(values, tls=scheme.startswith("rediss")),
    )


_DISK_WORDS = {
    "disk_policy": ("lru", "arc"),
    "disk_fsync": ("file", "never"),
    "disk_direct": ("auto", "on", "off"),
}


def _disk(values: Mapping[str, Any]) -> DiskSettings | None:
    """The disk tier's keys (module docstring), or None without ``disk_dir``."""
    root = values["disk_dir"]
    if root is None:
        for key in (k for k in DEFAULTS if k.startswith("disk_")):  # disk_dir: at default
            if values[key] != DEFAULTS[key]:
                raise HybridKVConfigError(
                    f"{_WHERE}.{key}", values[key], "is set but disk_dir is null",
                    'set "disk_dir": "/path/to/dir" (and disk_bytes), or drop the key',
                )  # fmt: skip
        return None
    if not isinstance(root, str) or not root or "\0" in root:
        raise HybridKVConfigError(
            f"{_WHERE}.disk_dir", root, "must be a non-empty path string",
            'e.g. "/mnt/nvme/hybridkv" (created if missing)',
        )  # fmt: skip
    size = values["disk_bytes"]
    if not _is_int(size) or size < 1:
        raise HybridKVConfigError(
            f"{_WHERE}.disk_bytes", size,
            "is required with disk_dir" if size is None else "must be an integer >= 1",
            'give the bytes the tier may use on disk, e.g. "disk_bytes": 107374182400 (100 GiB)',
        )  # fmt: skip
    for key, words in _DISK_WORDS.items():
        if values[key] not in words:
            raise HybridKVConfigError(
                f"{_WHERE}.{key}", values[key], f"is not one of {', '.join(words)}",
                f"use {' or '.join(words)} (default {DEFAULTS[key]})",
            )  # fmt: skip
    return DiskSettings(
        root=root,
        capacity_bytes=int(size),
        policy=values["disk_policy"],
        threads=_int(values, "disk_threads", low=1),
        fsync=values["disk_fsync"],
        direct=values["disk_direct"],
    )


def _int_at_most(values: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = _int(values, key, low=low)
    if value > high:
        raise HybridKVConfigError(
            f"{_WHERE}.{key}", value, f"must be at most {high}", f"e.g. {DEFAULTS[key]}"
        )
    return value


def _security(values: Mapping[str, Any], *, tls: bool) -> dict[str, Any]:
    """The credentials, TLS files and fleet key of the security keys (module docstring), the
    secrets read now; a library refusal comes back under its ``kv_connector_extra_config`` key."""
    for key in _SECURITY_STRINGS:
        value = values[key]
        if value is not None and (not isinstance(value, str) or not value):
            raise HybridKVConfigError(
                f"{_WHERE}.{key}", value, "must be a non-empty string or null", "e.g. null"
            )
    encrypt = _bool(values, "remote_encrypt")
    given_tls = next((k for k in _TLS_FILES if values[k] is not None), None)
    if given_tls is not None and not tls:
        raise HybridKVConfigError(
            f"{_WHERE}.{given_tls}", values[given_tls], "is set but remote_url is plaintext",
            'write "remote_url": "rediss://HOST:PORT" (TLS), or drop the key',
        )  # fmt: skip
    try:
        password = _text(read_secret("remote_password", *_sources(values, "remote_password")))
        secret = read_secret("remote_secret", *_sources(values, "remote_secret"))
        if encrypt and secret is None:
            raise HybridKVConfigError(
                "remote_encrypt", True, "needs the fleet secret (the AES key derives from it)",
                "set remote_secret_env or remote_secret_file, or drop remote_encrypt",
            )  # fmt: skip
        return {
            "credentials": Credentials(values["remote_username"], password),
            "tls": TlsFiles(*(values[k] for k in _TLS_FILES)) if tls else None,
            "key": None if secret is None else FleetKey(secret, encrypt),
        }
    except HybridKVConfigError as refused:
        where = refused.field
        if where in ("remote_password", "remote_secret"):  # the secret: name the key giving it
            where += "_env" if _sources(values, where)[0] is not None else "_file"
        raise HybridKVConfigError(
            f"{_WHERE}.{where}", refused.value, refused.problem, refused.fix
        ) from None


def _sources(values: Mapping[str, Any], name: str) -> tuple[str | None, str | None]:
    return values[f"{name}_env"], values[f"{name}_file"]


def _text(password: bytes | None) -> str | None:
    try:
        return None if password is None else password.decode()
    except UnicodeDecodeError:
        raise HybridKVConfigError(
            "remote_password", "<hidden>", "is not UTF-8 text", "give the password as text"
        ) from None


def _scheme(url: object) -> tuple[str, str]:
    """``remote_url``'s scheme (one of ``_SCHEMES``) and the rest; a URL with credentials is
    refused first, whatever its form, and no refusal shows them."""
    field = f"{_WHERE}.remote_url"
    shown = _masked(url)  # every refusal below may be logged: never the credentials
    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        raise HybridKVConfigError(field, shown, "is not a redis:// or rediss:// URL", _URL_FIX)
    scheme = next(s for s in _SCHEMES if url.startswith(s))
    if shown != url:
        raise HybridKVConfigError(
            field, shown, "carries credentials: the URL is logged with vLLM's config",
            "drop them from the URL; give remote_username and remote_password_env or "
            "remote_password_file",
        )  # fmt: skip
    return scheme, url[len(scheme) :]


def _redis_url(url: str, rest: str) -> tuple[str, int]:
    """``redis://host:port[/0]`` (or ``rediss://``; ``rest``: after the scheme) -> (host, port)."""
    field = f"{_WHERE}.remote_url"
    where, _, db = rest.partition("/")
    if db not in ("", "0"):
        raise HybridKVConfigError(field, url, f"names database {db!r}: only 0 is used", _URL_FIX)
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HybridKVConfigError(field, url, "needs a host and a port 1..65535, no user", _URL_FIX)
    return host, int(port)


def _masked(url: object) -> object:
    """``url`` with whatever comes before its last ``@`` after the scheme hidden."""
    if not isinstance(url, str) or "@" not in url:
        return url
    scheme, sep, _ = url.partition("//")
    return f"{scheme}{sep}<credentials>@{url.rpartition('@')[2]}"


def _cluster_url(url: str, rest: str) -> tuple[tuple[str, int], ...]:
    """``redis+cluster://h1:p1,h2:p2[/0]`` (or ``rediss+cluster://``; ``rest``: after the
    scheme) -> the seeds ((h1, p1), (h2, p2))."""
    field = f"{_WHERE}.remote_url"
    fix = f'write "{CLUSTER_SCHEME}HOST:PORT,HOST:PORT" (the seed nodes, no user, no database)'
    where, _, db = rest.partition("/")
    if db not in ("", "0"):
        raise HybridKVConfigError(field, url, f"names database {db!r}: a cluster has only 0", fix)
    seeds = []
    for node in where.split(","):
        host, _, port = node.strip().rpartition(":")
        number = port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
        if not host or not number:
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
