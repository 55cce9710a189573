"""Where the remote tier's server is, how to reach it safely and how long it may take: checked
eagerly, one field each."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.security import Credentials, FleetKey, TlsFiles

__all__ = ["RemoteConfig"]


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The remote tier's server, deadlines, TTL, queue bound and namespace.

    Attributes:
        host: the Redis/Valkey server's address.
        port: its TCP port, 1..65535.
        connect_timeout_s: the longest a connection attempt waits (> 0).
        deadline_s: the load deadline: the longest any one wait on the server takes (> 0);
            past it a fetch resolves TIMEOUT and a write FAILED (TT-4).
        ttl_s: seconds a written chunk lives on the server, 0 = until the server evicts it.
        max_pending: writes queued or in flight at most (>= 1); beyond it a write is dropped.
        namespace: mixed into every chunk key; engines share chunks only under equal namespaces.
        index_entries: chunks the tier remembers having written (>= 1); the oldest is
            forgotten past it, so a long-running engine's memory stays bounded. A forgotten
            chunk is written again when it is next stored (an identical SET: harmless).
        credentials: the AUTH the client sends (none by default; :mod:`.security`).
        tls: the TLS files, or None for a plaintext connection.
        key: the fleet key values are MACed (or encrypted) under, or None: unkeyed values,
            whose digest anyone who can write to the server can compute (docs/howto/
            share-prefix-cache.md, "Threat model").
        cluster_nodes: seed nodes ``(host, port)`` of a Redis/Valkey Cluster; empty (the
            default) = the one server at ``host:port``. With seeds, ``host`` and ``port`` are
            not used: the client learns every shard from the first seed that answers
            (:mod:`hybridkv.remote.cluster`).
    """

    host: str = "127.0.0.1"
    port: int = 6379
    connect_timeout_s: float = 0.5
    deadline_s: float = 0.5
    ttl_s: int = 0
    max_pending: int = 64
    namespace: bytes = b"hybridkv"
    index_entries: int = 1 << 16
    credentials: Credentials = field(default_factory=Credentials)
    tls: TlsFiles | None = None
    key: FleetKey | None = None
    cluster_nodes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise HybridKVConfigError("remote_host", self.host, "must be a host name", "pass one")
        _int_in("remote_port", self.port, 1, 65535, "pass the server's port")
        _positive_seconds("remote_connect_timeout", self.connect_timeout_s)
        _positive_seconds("remote_deadline", self.deadline_s)
        _int_in("remote_ttl", self.ttl_s, 0, 2**31 - 1, "pass seconds, 0 for no TTL")
        _int_in("remote_max_pending", self.max_pending, 1, 2**31 - 1, "allow >= 1 queued write")
        _int_in("remote_index_entries", self.index_entries, 1, 2**31 - 1, "remember >= 1 chunk")
        _seeds(self.cluster_nodes)
        if not isinstance(self.namespace, bytes):
            raise HybridKVConfigError(
                "remote_namespace", self.namespace, "must be bytes", "encode it (utf-8)"
            )
        for name, value, kind in (
            ("remote_credentials", self.credentials, Credentials),
            ("remote_tls", self.tls, TlsFiles | None),
            ("remote_key", self.key, FleetKey | None),
        ):
            if not isinstance(value, kind):
                raise HybridKVConfigError(name, value, f"must be a {kind}", "build one")


def _int_in(field: str, value: object, low: int, high: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HybridKVConfigError(field, value, f"must be an int in [{low}, {high}]", fix)


def _seeds(nodes: object) -> None:
    fix = 'pass a tuple of (host, port) pairs, e.g. (("10.0.0.5", 7000), ("10.0.0.6", 7000))'
    if not isinstance(nodes, tuple):
        raise HybridKVConfigError("remote_cluster_nodes", nodes, "must be a tuple", fix)
    for node in nodes:
        host, port = node if isinstance(node, tuple) and len(node) == 2 else ("", 0)
        if not isinstance(host, str) or not host:
            raise HybridKVConfigError("remote_cluster_nodes", node, "is not (host, port)", fix)
        _int_in("remote_cluster_nodes", port, 1, 65535, fix)
    if len(set(nodes)) != len(nodes):
        raise HybridKVConfigError("remote_cluster_nodes", nodes, "names a node twice", fix)


def _positive_seconds(field: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 3600
    if not ok:
        raise HybridKVConfigError(field, value, "must be seconds in (0, 3600)", "pass e.g. 0.5")
