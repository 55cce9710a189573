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

Start-up check: building a :class:`RedisClient` asks the server one harmless question (EXISTS
of a key no chunk uses) at once. A refusal that will not go away by itself (a password or ACL
user the server rejects, a user without the commands the tier runs, a TLS handshake that
fails) is a :class:`~hybridkv.errors.HybridKVConfigError` naming the setting to fix, so a
misconfigured engine stops at start-up with one line instead of counting faults for ever. A
server that is down or slow is not refused (it may come back; every call then counts a
fault): it is logged once. A cluster client runs the same probe and reads its failure the same
way (:mod:`hybridkv.remote.cluster`, "Start-up check").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import ssl
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.config import RemoteConfig
from hybridkv.remote.values import ClientFault

__all__ = ["ChunkClient", "RedisClient", "connection_kwargs", "fault_of"]

logger = logging.getLogger("hybridkv.remote")
# A key name no chunk uses (chunk names are the prefix then 64 hex digits): the start-up probe.
_PROBE = b"hybridkv:chunk:probe"
_GRANT = "ACL SETUSER {user} ~hybridkv:chunk:* -@all +get +set +exists +ping"
"""The ACL rule a start-up refusal names: the commands the tier runs, on chunk keys only."""


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


def _refused_credentials(
    config: RemoteConfig, server: str, error: BaseException
) -> HybridKVConfigError:
    """The config error of the server's AUTH refusal (the password itself is never shown)."""
    given = config.credentials
    if given.password is None:
        problem = f"{server} requires a password ({error})"
    elif given.username is None:
        problem = f"{server} refused the password ({error})"
    else:
        problem = f"{server} refused ACL user {given.username!r} with its password ({error})"
    return HybridKVConfigError(
        "remote_password",
        "<hidden>" if given.password else None,
        problem,
        "give the password the server expects (with an ACL user, remote_username too) through "
        "remote_password_env or remote_password_file",
    )


def _refused_handshake(
    config: RemoteConfig, server: str, error: ssl.SSLError
) -> HybridKVConfigError:
    """The config error of a failed TLS handshake: this client refused the server's certificate
    (verification failed: the CA), or the server ended the handshake (an alert or a cut: it
    refused this client's certificate, or it speaks no TLS)."""
    problem = f"the TLS handshake with {server} failed ({error})"
    if isinstance(error, ssl.SSLCertVerificationError):
        return HybridKVConfigError(
            "remote_tls_ca_file",
            config.tls.ca_file if config.tls else None,
            problem,
            "give the CA that signed the server's certificate",
        )
    return HybridKVConfigError(
        "remote_tls_cert_file",
        config.tls.cert_file if config.tls else None,
        problem,
        "give a client certificate and key the server's CA signed (remote_tls_cert_file, "
        "remote_tls_key_file); for a server without TLS write redis://",
    )


def _startup_refusal(
    config: RemoteConfig, server: str, error: Exception, grant: str = _GRANT
) -> HybridKVConfigError | None:
    """The config error of a start-up probe's failure (module docstring, "Start-up check"), or
    None where the server is only down or slow. The refusal is looked for along ``error``'s
    causes: redis-py wraps a TLS error in a ConnectionError, and a cluster client wraps what a
    seed answered in a RedisClusterException. ``grant``: the ACL rule the fix names."""
    exceptions = _redis().exceptions
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, exceptions.AuthenticationError):
            return _refused_credentials(config, server, seen)
        if isinstance(seen, exceptions.NoPermissionError):
            user = config.credentials.username or "default"
            return HybridKVConfigError(
                "remote_username",
                user,
                f"may not run the tier's commands on {server} ({seen})",
                f"grant them: {grant.format(user=user)}",
            )
        if isinstance(seen, ssl.SSLError):
            return _refused_handshake(config, server, seen)
        seen = seen.__cause__ or seen.__context__
    return None


def _unanswered(server: str, error: BaseException) -> None:
    """Log (once per client) that the start-up probe got no answer: not a refusal."""
    logger.warning(
        "hybridkv remote tier: %s did not answer at start-up (%s: %s); the tier "
        "runs, counting every failed call, and uses the server once it answers",
        server,
        type(error).__name__,
        error,
    )


def fault_of(error: Exception) -> ClientFault:
    """The fault a redis or socket error stands for (see the module docstring)."""
    if isinstance(error, TimeoutError):
        return ClientFault.TIMEOUT
    if isinstance(error, _redis().exceptions.TimeoutError):
        return ClientFault.TIMEOUT
    return ClientFault.FAULT


def connection_kwargs(config: RemoteConfig) -> dict[str, Any]:
    """redis-py's connection keywords for ``config``, all but the address: the deadlines, no
    retries (TT-4), the credentials and TLS. Built here once, so that every client of the tier
    (:class:`RedisClient`, a cluster client on the same config) connects the same way.

    Errors: HybridKVConfigError (field ``remote_url``) when redis-py is not installed.
    """
    _redis(f"{config.host}:{config.port}")
    retry: Any = importlib.import_module("redis.retry").Retry(
        importlib.import_module("redis.backoff").NoBackoff(), 0
    )
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": config.deadline_s,
        "retry": retry,
    }
    if config.credentials.password is not None:
        kwargs["username"] = config.credentials.username
        kwargs["password"] = config.credentials.password
    if config.tls is not None:
        kwargs.update(
            ssl=True,
            ssl_cert_reqs="required",
            ssl_check_hostname=True,
            ssl_ca_certs=config.tls.ca_file,
            ssl_certfile=config.tls.cert_file,
            ssl_keyfile=config.tls.key_file,
        )
    return kwargs


class RedisClient:
    """:class:`ChunkClient` on a Redis or Valkey server (redis-py, RESP2, no retries)."""

    def __init__(self, config: RemoteConfig) -> None:
        """A client of ``config``'s server, checked at once (module docstring, "Start-up").

        Errors: HybridKVConfigError when redis-py is not installed (field ``remote_url``), or
        when the server refuses the credentials (``remote_password``), the ACL user's rights
        (``remote_username``) or the TLS handshake (``remote_tls_ca_file``, or
        ``remote_tls_cert_file`` where the server refuses this client's certificate).
        """
        redis = _redis(f"{config.host}:{config.port}")
        self._errors: tuple[type[Exception], ...] = (redis.exceptions.RedisError, OSError)
        self._redis = redis.Redis(host=config.host, port=config.port, **connection_kwargs(config))
        self._check(config)

    def _check(self, config: RemoteConfig) -> None:
        """The start-up probe: refusals that are configuration raise, the rest are logged."""
        server = f"{'rediss' if config.tls else 'redis'}://{config.host}:{config.port}"
        try:
            self._redis.exists(_PROBE)
        except self._errors as error:
            refused = _startup_refusal(config, server, error)
            if refused is None:
                _unanswered(server, error)
                return
            self.close()
            raise refused from None

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
