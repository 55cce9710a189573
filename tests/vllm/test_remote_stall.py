"""A paused or dead shared tier never blocks vLLM's scheduler (issue 30), on vLLM 0.33's real
``Scheduler`` in-process with two engines and a real ``redis-server``.

Engine A serves a chat trace and writes its chunks; the server is then stopped with SIGSTOP
(connections still accepted by the kernel, nothing answers) or killed; engine B serves the same
prompts with lookups answered as they come (no settling between steps). Every request
finishes, nothing wrong is read, each prompt token is computed or hit exactly once, and not
one server call runs on the scheduler's thread: every EXISTS runs on a lookup thread, so no
``schedule()`` waits on the server. A dead server opens the breakers, after which the server is
not asked at all. How long ``schedule()`` takes is measured, not asserted, by
tools/bench_remote_stall.py (docs/benchmarks/remote-stall.md).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.remote]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _two_engines import (  # noqa: E402
    SHAPES,
    build,
    chat_prompts,
    flush_writes,
    run_prompts,
    started_server,
)
from diffharness.layouts import Layout  # noqa: E402

from hybridkv.remote import ClientFault, RedisClient  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    yield from started_server(tmp_path)


@pytest.fixture
def exists_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of every EXISTS any RedisClient sends."""
    threads: list[int] = []
    exists = RedisClient.exists

    def recorded(self: RedisClient, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        threads.append(threading.get_ident())
        return exists(self, keys)

    monkeypatch.setattr(RedisClient, "exists", recorded)
    return threads


@pytest.mark.parametrize("state", ["paused", "dead"])
def test_a_paused_or_dead_server_never_blocks_the_scheduler(
    server: Any, exists_threads: list[int], state: str
) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    a = build(shape, server.port)
    run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    a.close()
    exists_threads.clear()
    b = build(shape, server.port, timeout_ms=100, settled=False)
    process = server._process
    if state == "paused":
        os.kill(process.pid, signal.SIGSTOP)
    else:
        server.kill()
    try:
        rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    finally:
        if state == "paused":
            os.kill(process.pid, signal.SIGCONT)
    count = b.scheduler.connector.remote.count
    print(f"\n{state}: {dict(count)}; {rb}")
    assert rb.finished == rb.requests > 0
    assert rb.wrong_reads == 0
    assert rb.preemptions == 0
    assert rb.prefill_computed + rb.gpu_prefix_hits + rb.external_hits == rb.prompt_tokens
    assert count["promoted"] == 0
    assert exists_threads  # lookups were asked ...
    assert threading.get_ident() not in exists_threads  # ... never on the scheduler's thread
    if state == "paused":
        # Every lookup was unanswered past the wait, or answered TIMEOUT: no remote hit.
        assert count["remote_lookups_late"] + count["remote_lookup_faults"] > 0
    else:
        assert count["remote_lookup_breaker_trips"] >= 1
        assert count["remote_lookup_breaker_skips"] >= 1
    assert b.scheduler.connector.remote.in_flight() == 0
    assert b.pending() == 0
    b.close()
