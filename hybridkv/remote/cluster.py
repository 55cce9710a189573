"""The remote tier on a Redis Cluster or Valkey Cluster: a :class:`ChunkClient` on redis-py's
``RedisCluster``, every failure a returned fault, never an exception.

Spread. A chunk's server key (:func:`hybridkv.remote.redis_key`) carries no hash tag, so the
cluster hashes each key to its own slot and chunks spread over every shard. A lookup asks one
EXISTS per key (a multi-key EXISTS across slots is refused with CROSSSLOT); redis-py's cluster
pipeline groups them by the node that owns each slot, one round trip per node.

Redirects. The client keeps the cluster's slot map; a MOVED reply (the slot has moved: a
reshard, a failover) updates it and resends to the new owner, an ASK reply (the slot is moving
now) resends once to the importing node behind ASKING. redis-py follows both, in pipelines too.
Nothing read can be wrong for being stale: chunks are content-addressed and verified
(:func:`hybridkv.remote.decode_chunk`), so a key holds one value or none.

Deadline (TT-4). One call may wait on several servers: redirects, a refresh of the slot map
after a connection error, redis-py's own pause on CLUSTERDOWN (a quarter second). Bounding each
socket wait (``socket_timeout``: the deadline) bounds none of those sums, so each call runs on
one of the client's :data:`CALL_THREADS` call threads and the caller waits at most
``connect_timeout_s + deadline_s``: what one call to a single server may take (a connect, then
one reply). Past it the call answers :attr:`ClientFault.TIMEOUT` and finishes on its thread,
its answer dropped (a late SET lands an identical value: harmless). While every call thread is
still busy, a call answers TIMEOUT at once instead of queueing behind them. redis-py's reruns
after a connection error are off (``Retry(NoBackoff(), 0)``): one attempt per call. (Older
redis-py versions take the cluster's reruns from ``cluster_error_retry_attempts``, 3 by
default, instead: those reruns run on the call thread, and the caller's wait stays bounded.)

Failover. When a primary dies, calls on its slots fault (connection refused, or CLUSTERDOWN on
every slot where the servers run with ``cluster-require-full-coverage yes``) until its replica
is promoted. Each connection error makes redis-py reload the slot map, so at most one call per
client faults after the promotion (its map, reloaded before it, still named the dead node) and
the next reaches the new primary. The tier counts each fault and recomputes (TT-5).

Slot-map races. While a shard joins or slots move, one call thread may find a slot with no
node at all in the slot map another thread is rebuilding: redis-py then raises an
AttributeError (or a KeyError, IndexError, TypeError) from inside itself, not a RedisError
(redis/redis-py#2432, #3835). A call that hits one runs once more (the map is whole again by
then, within the same budget); a second such error is a FAULT, logged once. Never an exception:
it would end the tier's writer thread or the scheduler step that asked.

Security. Every node is reached with the single-server client's keywords
(:func:`hybridkv.remote.client.connection_kwargs`): the same deadlines, AUTH (a password, or an
ACL user and password, which every node must accept alike) and TLS files; ``rediss+cluster://``
seeds speak TLS to every node. Values are the same keyed values, MACed over the key each is
stored under (:mod:`hybridkv.remote.codec`): which shard holds a value changes nothing.

Start-up check. Building a :class:`ClusterClient` runs the single-server client's probe (one
EXISTS of a key no chunk uses) as a call: on a call thread, the caller waiting at most the
budget. A refusal that will not go away by itself (a seed refusing the password or the ACL
user, a user without the commands a cluster client runs, a failed TLS handshake) is one
:class:`~hybridkv.errors.HybridKVConfigError`; a cluster that is down or slow is logged once,
never raised, and the client runs, counting faults.

The cluster client (redis-py's, with its slot map) is built by that probe, on a call thread, not
on the caller's: building it asks the seeds for the slot map, which must not wait past a
deadline at engine start-up when the cluster is down. A failed build is a FAULT and the next
call builds again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.client import (
    _GRANT,
    _PROBE,
    ChunkClient,
    RedisClient,
    _redis,
    _startup_refusal,
    _unanswered,
    connection_kwargs,
    fault_of,
)
from hybridkv.remote.config import RemoteConfig
from hybridkv.remote.values import ClientFault

__all__ = ["CALL_THREADS", "ClusterClient", "client_for", "cluster_kwargs"]

CALL_THREADS = 4
"""Calls one client runs at once (the writer's SET, a fetch's GET, a lookup, with room)."""

_T = TypeVar("_T")
logger = logging.getLogger(__name__)
# What redis-py raises from inside itself when a slot has no node in its map (module
# docstring, "Slot-map races"); none of these is a RedisError.
_MAP_RACES: tuple[type[Exception], ...] = (AttributeError, KeyError, IndexError, TypeError)
# A cluster client also asks for the slot map and the command table (where each command
# names its keys), and sends ASKING when a slot is moving.
_CLUSTER_GRANT = _GRANT + " +cluster|slots +command +asking"


def client_for(config: RemoteConfig) -> ChunkClient:
    """The client of ``config``'s server: a :class:`ClusterClient` when it names cluster seeds,
    else a :class:`~hybridkv.remote.client.RedisClient`.

    Errors: HybridKVConfigError (field ``remote_url``) when redis-py is not installed.
    """
    return ClusterClient(config) if config.cluster_nodes else RedisClient(config)


def cluster_kwargs(config: RemoteConfig) -> dict[str, Any]:
    """redis-py's ``RedisCluster`` keyword arguments for ``config`` (besides the seeds): the
    single-server client's (deadlines, one attempt per call, credentials, TLS), which
    ``RedisCluster`` hands every node's connections, and the cluster's own."""
    return {
        **connection_kwargs(config),  # one attempt per call (module docstring, Deadline)
        # A slot map with a shard missing still serves the other shards' slots.
        "require_full_coverage": False,
    }


class ClusterClient:
    """:class:`ChunkClient` on a Redis/Valkey Cluster (redis-py ``RedisCluster``, RESP2)."""

    def __init__(self, config: RemoteConfig, *, calls: int = CALL_THREADS) -> None:
        """A client of ``config``'s cluster (``config.cluster_nodes``: the seeds), checked at
        once (module docstring, "Start-up check").

        Errors: HybridKVConfigError (field ``remote_url``) when redis-py is not installed,
        (``remote_cluster_nodes``) when ``config`` names no seed, (``calls``) when < 1; when a
        seed refuses the credentials (``remote_password``), the ACL user's rights
        (``remote_username``) or the TLS handshake (``remote_tls_ca_file``,
        ``remote_tls_cert_file``).
        """
        seeds = ",".join(f"{host}:{port}" for host, port in config.cluster_nodes)
        if not seeds:
            raise HybridKVConfigError(
                "remote_cluster_nodes", (), "names no seed node", "pass the cluster's seeds"
            )
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise HybridKVConfigError("calls", calls, "must be an int >= 1", "pass e.g. 4")
        redis = _redis(f"redis+cluster://{seeds}")
        self.config = config
        self._errors: tuple[type[Exception], ...] = (
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,  # not a RedisError: no slot map, no seed
            OSError,
        )
        self._budget_s = config.connect_timeout_s + config.deadline_s
        self._races = 0  # calls lost to a slot-map race (module docstring): logged once
        self._cluster: Any = None
        self._build = threading.Lock()
        self._free = threading.BoundedSemaphore(calls)
        self._pool = concurrent.futures.ThreadPoolExecutor(calls, "hybridkv-cluster")
        scheme = "rediss+cluster" if config.tls else "redis+cluster"
        self._check(f"{scheme}://{seeds}")

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """One EXISTS per key (slots differ), pipelined: one round trip per node."""
        asked = list(keys)

        def ask(cluster: Any) -> tuple[bool, ...]:
            pipe = cluster.pipeline()
            for key in asked:
                pipe.exists(key)
            return tuple(bool(n) for n in pipe.execute())

        return self._call(ask)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """GET ``key`` from its slot's primary: the whole value or None (TT-1)."""

        def ask(cluster: Any) -> bytes | None:
            value = cluster.get(key)
            return value if value is None else bytes(value)

        return self._call(ask)

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """SET ``key`` on its slot's primary (with EX ``ttl_s`` when > 0)."""

        def ask(cluster: Any) -> None:
            cluster.set(key, value, ex=ttl_s or None)

        return self._call(ask)

    def close(self) -> None:
        """Stop the call threads (a call still waiting finishes alone) and disconnect."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._build:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            # Closing a dead connection changes nothing the caller needs.
            with contextlib.suppress(*self._errors):
                cluster.close()

    # --- internals ---

    def _check(self, server: str) -> None:
        """The start-up probe, as a call (module docstring, "Start-up check")."""
        self._free.acquire()  # a new client: every call thread is free
        try:
            error = self._pool.submit(self._probe).result(timeout=self._budget_s)
        except concurrent.futures.TimeoutError:
            error = TimeoutError(f"no answer within {self._budget_s:g} s")
        if error is None:
            return
        refused = _startup_refusal(self.config, server, error, _CLUSTER_GRANT)
        if refused is None:
            _unanswered(server, error)
            return
        self.close()
        raise refused from None

    def _probe(self) -> Exception | None:
        """Build the cluster client and ask the probe's EXISTS: what failed, or None."""
        try:
            self._connected().exists(_PROBE)
        except self._errors as error:
            return error
        finally:
            self._free.release()
        return None

    def _call(self, ask: Callable[[Any], _T]) -> _T | ClientFault:
        """``ask`` on a call thread; the caller waits at most the budget (module docstring)."""
        if not self._free.acquire(blocking=False):
            return ClientFault.TIMEOUT  # every call thread still waits on the cluster
        try:
            future = self._pool.submit(self._run, ask)
        except RuntimeError:  # closed: the pool takes no more calls
            self._free.release()
            return ClientFault.FAULT
        try:
            return future.result(timeout=self._budget_s)
        except concurrent.futures.TimeoutError:
            return ClientFault.TIMEOUT
        except concurrent.futures.CancelledError:  # closed while the call waited to start
            return ClientFault.FAULT

    def _run(self, ask: Callable[[Any], _T]) -> _T | ClientFault:
        try:
            try:
                return ask(self._connected())
            except _MAP_RACES:  # module docstring, "Slot-map races": once more
                return ask(self._connected())
        except self._errors as error:
            return fault_of(error)
        except _MAP_RACES as error:
            self._races += 1
            if self._races == 1:
                logger.warning(
                    "hybridkv remote tier: redis-py's cluster client raised %s twice running "
                    "one call (its slot map lacked a node); the call is a fault and the tier "
                    "recomputes. Logged once per client.",
                    repr(error),
                )
            return ClientFault.FAULT
        finally:
            self._free.release()

    def _connected(self) -> Any:
        with self._build:
            if self._cluster is None:
                cluster = importlib.import_module("redis.cluster")
                self._cluster = cluster.RedisCluster(
                    startup_nodes=[
                        cluster.ClusterNode(host, port) for host, port in self.config.cluster_nodes
                    ],
                    **cluster_kwargs(self.config),
                )
            return self._cluster
