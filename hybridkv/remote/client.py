"""A thin client over redis-py: three calls, every failure a returned fault, never an exception.

The remote tier talks to the server only through :class:`ChunkClient`, so the queue and the
promotion logic run the same against a real server (:class:`RedisClient`) or a fake one in the
unit tests. Each call waits at most the load deadline (``socket_timeout``); connecting waits at
most the connect timeout; redis-py's own retries are off, because a retry would wait past the
deadline the caller was promised (TT-4).

Mapping (every redis and socket error the client can raise): a timeout (redis-py's
``TimeoutError``, the socket's ``TimeoutError``) is :attr:`ClientFault.TIMEOUT`; any other
``RedisError`` (connection refused or reset, server gone, a reply it cannot parse, an error
reply such as OOM) or ``OSError`` is :attr:`ClientFault.FAULT`.

redis-py is imported when a :class:`RedisClient` is built, not with this module: the connector
imports the remote tier's package whether or not a tier is configured, and redis-py is an
optional dependency (``pip install 'hybridkv[remote]'``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.config import RemoteConfig
from hybridkv.remote.values import ClientFault

__all__ = ["ChunkClient", "RedisClient", "fault_of"]


class ChunkClient(Protocol):
    """What the remote tier needs from a server. No method raises on a server failure."""

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """Whether each key exists, in one pipelined round trip."""

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """The value of ``key``, None when the server has none."""

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """Write ``value`` under ``key`` (expiring after ``ttl_s`` seconds unless 0)."""

    def close(self) -> None:
        """Release the connections."""


def _redis(server: str = "") -> ModuleType:
    """redis-py, or a config error naming the fix where it is not installed."""
    try:
        return importlib.import_module("redis")
    except ImportError as missing:
        raise HybridKVConfigError(
            "remote_url",
            server,
            f"the remote tier needs the redis client, which does not import ({missing})",
            "install it: pip install 'hybridkv[remote]' (or pip install redis)",
        ) from missing


def fault_of(error: Exception) -> ClientFault:
    """The fault a redis or socket error stands for (see the module docstring)."""
    if isinstance(error, TimeoutError):
        return ClientFault.TIMEOUT
    if isinstance(error, _redis().exceptions.TimeoutError):
        return ClientFault.TIMEOUT
    return ClientFault.FAULT


class RedisClient:
    """:class:`ChunkClient` on a Redis or Valkey server (redis-py, RESP2, no retries)."""

    def __init__(self, config: RemoteConfig) -> None:
        """A client of ``config``'s server; connects lazily, on the first call.

        Errors: HybridKVConfigError (field ``remote_url``) when redis-py is not installed.
        """
        redis = _redis(f"redis://{config.host}:{config.port}")
        retry: Any = importlib.import_module("redis.retry").Retry(
            importlib.import_module("redis.backoff").NoBackoff(), 0
        )
        self._errors: tuple[type[Exception], ...] = (redis.exceptions.RedisError, OSError)
        self._redis = redis.Redis(
            host=config.host,
            port=config.port,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.deadline_s,
            retry=retry,
        )

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """One EXISTS per key, pipelined (one round trip, no MULTI)."""
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return tuple(bool(n) for n in pipe.execute())
        except self._errors as error:
            return fault_of(error)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """GET ``key``: the whole value or None (Redis reads one key atomically, TT-1)."""
        try:
            value = self._redis.get(key)
        except self._errors as error:
            return fault_of(error)
        return value if value is None else bytes(value)

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """SET ``key`` (with EX ``ttl_s`` when > 0): one command writes the whole chunk."""
        try:
            self._redis.set(key, value, ex=ttl_s or None)
        except self._errors as error:
            return fault_of(error)
        return None

    def close(self) -> None:
        """Close every pooled connection."""
        # Closing a dead connection changes nothing the caller needs.
        with contextlib.suppress(*self._errors):
            self._redis.close()
