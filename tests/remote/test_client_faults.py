"""RedisClient's fault mapping without a Redis server: nothing listening, and a silent listener.

A refused connection is FAULT; a peer that accepts and never answers is TIMEOUT after the
deadline (not the redis-py default of 5 s, and without retries). No exception escapes.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest
import redis
from _redis_server import free_port

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import ClientFault, RedisClient, RemoteConfig, fault_of


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (redis.exceptions.TimeoutError("t"), ClientFault.TIMEOUT),
        (TimeoutError("socket"), ClientFault.TIMEOUT),
        (redis.exceptions.ConnectionError("reset"), ClientFault.FAULT),
        (redis.exceptions.ResponseError("OOM"), ClientFault.FAULT),
        (ConnectionResetError("peer"), ClientFault.FAULT),
        (OSError("unreachable"), ClientFault.FAULT),
    ],
)
def test_fault_of(error: Exception, fault: ClientFault) -> None:
    assert fault_of(error) is fault


def test_nothing_listening_is_a_fault_on_every_call() -> None:
    client = RedisClient(RemoteConfig(port=free_port(), connect_timeout_s=0.5))
    assert client.exists([b"a", b"b"]) is ClientFault.FAULT
    assert client.get(b"a") is ClientFault.FAULT
    assert client.set(b"a", b"v", 0) is ClientFault.FAULT
    client.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield int(listener.getsockname()[1])


def test_silent_server_is_a_timeout_within_the_deadline(silent_port: int) -> None:
    client = RedisClient(RemoteConfig(port=silent_port, deadline_s=0.1))
    for call in (
        lambda: client.exists([b"a"]),
        lambda: client.get(b"a"),
        lambda: client.set(b"a", b"v", 5),
    ):
        started = time.monotonic()
        assert call() is ClientFault.TIMEOUT
        assert time.monotonic() - started < 1.0  # one deadline, no retries
    client.close()


def test_without_redis_py_building_a_client_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connector imports hybridkv.remote with or without a tier configured; redis-py is an
    # optional dependency, so it is imported (and its absence reported) only by a client.
    monkeypatch.setitem(sys.modules, "redis", None)  # what an uninstalled module imports as
    with pytest.raises(HybridKVConfigError, match=r"remote_url.*hybridkv\[remote\]"):
        RedisClient(RemoteConfig(port=6390))
