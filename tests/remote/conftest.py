"""Fixtures for the remote tier's tests: a real Redis/Valkey server, started and stopped here.

Tests that need the server take ``redis_server`` (a fresh server per test, which the test may
kill) or ``shared_redis`` (one server per module, flushed before each test) and carry the
``remote`` marker. Without ``redis-server`` or ``valkey-server`` on PATH they skip, saying so,
unless ``HYBRIDKV_REQUIRE_REDIS=1`` (``nox -s remote``): then they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _redis_server import BINARIES, RedisServer, find_binary


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The server binary on PATH; skip (or fail under HYBRIDKV_REQUIRE_REDIS=1) without one."""
    binary = find_binary()
    if binary is None:
        reason = (
            f"none of {', '.join(BINARIES)} is on PATH: the remote-tier tests need a real "
            "server (`nox -s remote` installs redis-server, or apt-get install redis-server)"
        )
        if os.environ.get("HYBRIDKV_REQUIRE_REDIS") == "1":
            pytest.fail(f"HYBRIDKV_REQUIRE_REDIS=1 but {reason}")
        pytest.skip(reason)
    return binary


def _started(binary: str, workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(binary, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh server for this test alone (it may kill or pause it)."""
    yield from _started(redis_binary, tmp_path)


@pytest.fixture(scope="module")
def module_redis(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    yield from _started(redis_binary, tmp_path_factory.mktemp("redis"))


@pytest.fixture
def shared_redis(module_redis: RedisServer) -> RedisServer:
    """The module's server, emptied and with default limits, for a test that does not kill it."""
    admin = module_redis.admin()
    admin.flushall()
    admin.config_set("maxmemory", 0)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.close()
    return module_redis
