"""The disk tier stacked over the shared server (issue 31: host -> disk -> server), in-process
vLLM 0.33 engines on a real ``redis-server`` and real temporary directories
(:class:`hybridkv.remote.StackedClient`, :mod:`hybridkv.vllm.disk`).

- Engine A (its own disk) writes every chunk to its disk and to the server.
- Engine B, on an empty disk of its own, promotes A's chunks from the server, and each one it
  read from the server is written to its disk (the fill).
- The server killed, engine C, restarted on B's disk, promotes those chunks from the disk: the
  disk is never behind the server's breaker.

0 wrong reads on every engine; every prompt position computed or hit exactly once. Passes
under both engine loops (``HYBRIDKV_ENGINE_LOOP``); ``nox -s remote`` runs it under the
harness's default (async).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.remote]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _two_engines import (  # noqa: E402
    HOST_BYTES,
    SHAPES,
    Shape,
    answer_within_a_step,
    chat_prompts,
    config_json,
    flush_writes,
    run_prompts,
    started_server,
)
from diffharness.layouts import Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    yield from started_server(tmp_path)


def _build(shape: Shape, port: int, disk: Path) -> InProcessEngine:
    extra = {
        "host_memory_bytes": HOST_BYTES,
        "chunk_size": shape.chunk,
        "remote_url": f"redis://127.0.0.1:{port}/0",
        "remote_timeout_ms": 500,
        "disk_dir": str(disk),
        "disk_bytes": 256 << 20,
    }
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    settings = dataclasses.replace(shape.settings, model_name="model")
    engine = InProcessEngine(config_json(shape, 1), settings, transfer, HybridKVOnCPU(delay=1))
    engine.scheduler.connector.remote.record = True
    answer_within_a_step(engine)
    return engine


def _stack_counts(engine: InProcessEngine) -> dict[str, int]:
    stack = engine.ranks[0].worker.worker_remote.stack
    assert stack is not None
    return dict(stack.counts())


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _sound(report: InProcessReport) -> None:
    assert report.wrong_reads == 0
    assert report.preemptions == 0
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens, report


def test_the_disk_stacked_over_the_server_fills_and_serves_without_it(
    server: Any, tmp_path: Path
) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    a = _build(shape, server.port, tmp_path / "disk-a")
    ra = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    written = set(a.scheduler.connector.remote.written_log)
    on_server = len(server.admin().keys("hybridkv:chunk:*"))
    assert on_server == len(written) == _files(tmp_path / "disk-a") > 0
    a.close()

    b = _build(shape, server.port, tmp_path / "disk-b")
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    assert flush_writes(b)
    b_remote, b_stack = b.scheduler.connector.remote, _stack_counts(b)
    assert b_remote.count["promoted"] > 0
    assert set(b_remote.promoted_log) <= written
    assert b_stack["far_hits"] == b_stack["fills"] == b_remote.count["promoted"]
    assert b_stack["near_hits"] == 0  # B's disk started empty
    assert _files(tmp_path / "disk-b") >= b_stack["fills"]
    b.close()

    server.kill()
    c = _build(shape, server.port, tmp_path / "disk-b")
    rc = run_prompts(c, chat_prompts(shape.trace, "c-"))
    c_remote, c_stack = c.scheduler.connector.remote, _stack_counts(c)
    print(
        f"\nA wrote {len(written)} chunks to its disk and the server; B promoted "
        f"{b_remote.count['promoted']} from the server (filled {b_stack['fills']} to its disk); "
        f"C, the server dead, promoted {c_remote.count['promoted']} from B's disk"
    )
    assert c_remote.count["promoted"] >= b_remote.count["promoted"]
    assert c_stack["near_hits"] == c_remote.count["promoted"]
    assert c_stack["far_hits"] == 0
    for report in (ra, rb, rc):
        _sound(report)
    c.close()
