"""The disk tier inside vLLM 0.33 (issue 31, :mod:`hybridkv.vllm.disk`): in-process engines
(vLLM's real ``Scheduler``, the scheduler-role and worker-role ``HybridKVConnector``, every KV
slot and mamba state the forward reads content-checked) with ``disk_dir`` on a real temporary
directory.

- Restart: engine A serves a chat trace and writes its chunks to disk; A closes; engine B, a
  new engine (new host tier, new scheduler) on the same directory, serves the same prompts and
  promotes A's files from its first requests: 0 wrong reads, every chunk B promoted is one A
  wrote, and B computes fewer prompt tokens than the same engine without the tier.
- Identity: another model of the same geometry on the same ``disk_dir`` gets its own
  directory and finds none of A's chunks.
- Corruption: every file A wrote damaged on disk (bytes flipped, or truncated) before B
  starts: a truncated file is removed by B's start-up scan (DK-5), a flipped one is a miss at
  the fetch that reads it (DK-6) and removed; B loads none, recomputes exactly what is
  missing and serves exactly what an engine without the tier serves.
- Tensor parallel 2: each rank its own directory and half of ``disk_bytes``; a restart hits.
- The byte limit holds on each directory (DK-2, from the client's own snapshot).

Every test runs under both engine loops (``HYBRIDKV_ENGINE_LOOP``: nox runs tests/vllm twice).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
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
)
from diffharness.layouts import Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.disk import DiskClient, DiskConfig  # noqa: E402
from hybridkv.remote import Admission, RemoteTier, make_chunk, redis_key  # noqa: E402
from hybridkv.vllm.config import DiskSettings, parse_extra_config  # noqa: E402
from hybridkv.vllm.disk import DISK_NAMESPACE, disk_remote_config  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402

DISK_BYTES = 256 << 20


def _transfer(shape: Shape, disk: Path | None, disk_bytes: int) -> KVTransferConfig:
    extra: dict[str, Any] = {"host_memory_bytes": HOST_BYTES, "chunk_size": shape.chunk}
    if disk is not None:
        extra |= {"disk_dir": str(disk), "disk_bytes": disk_bytes, "disk_direct": "auto"}
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )


def _build(
    shape: Shape,
    disk: Path | None,
    *,
    model: str = "model",
    tp: int = 1,
    disk_bytes: int = DISK_BYTES,
) -> InProcessEngine:
    """One engine on ``disk`` (None: no disk tier) serving ``model`` on ``tp`` ranks simulated
    in process; its lookups answered before each step (a stat is well under a step)."""
    settings = dataclasses.replace(shape.settings, model_name=model, tensor_parallel_size=tp)
    adapters = [HybridKVOnCPU(delay=1 + rank % 2) for rank in range(tp)]
    engine = InProcessEngine(
        config_json(shape, tp),
        settings,
        _transfer(shape, disk, disk_bytes),
        adapters if tp > 1 else adapters[0],
    )
    remote = engine.scheduler.connector.remote
    if remote is not None:
        remote.record = True
        answer_within_a_step(engine)
    return engine


def _disk_clients(engine: InProcessEngine) -> list[Any]:
    """Each rank's disk client (the worker side's, OWNER where the rank writes its shard)."""
    return [rank.worker.worker_remote.tier._client for rank in engine.ranks]


def _chunk_files(root: Path) -> list[Path]:
    """Every complete chunk file under ``root`` (temps are dot files)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _every_token_once(report: InProcessReport) -> None:
    assert report.preemptions == 0
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens, report


def _serve_and_close(shape: Shape, disk: Path, **kw: Any) -> tuple[set[Any], InProcessReport]:
    """Engine A: serve the trace, wait for its writes, close (the process would exit here);
    what it wrote (chunk, salt) and its report."""
    a = _build(shape, disk, **kw)
    report = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    written = set(a.scheduler.connector.remote.written_log)
    counts = [rank.worker.worker_remote.counters() for rank in a.ranks]
    assert written
    assert all(c["remote_written"] == c["remote_writes_enqueued"] > 0 for c in counts), counts
    a.close()
    return written, report


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_a_restart_on_the_same_directory_serves_hits_from_disk(
    tmp_path: Path, layout: Layout
) -> None:
    shape = SHAPES[layout]
    disk = tmp_path / "disk"
    written, ra = _serve_and_close(shape, disk)
    files = _chunk_files(disk)
    assert len(files) == len(written)
    assert len({p.parent.parent for p in files}) == 1  # one identity directory at TP 1

    b = _build(shape, disk)  # a new engine: its index rebuilt from the files
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    alone = _build(shape, None)
    rc = run_prompts(alone, chat_prompts(shape.trace, "c-"))
    b_remote = b.scheduler.connector.remote
    saved = rc.prefill_computed - rb.prefill_computed
    print(
        f"\n{layout.value}: A wrote {len(files)} files; after the restart B promoted "
        f"{b_remote.count['promoted']} of {b_remote.count['promotions_started']}, external "
        f"hits {rb.external_hits}, prefill computed {rb.prefill_computed} vs "
        f"{rc.prefill_computed} alone: saved {saved} of {rb.prompt_tokens} prompt tokens"
    )
    for report in (ra, rb, rc):
        assert report.finished == report.requests > 0
        assert report.slots_checked > 0
        assert report.wrong_reads == 0
        _every_token_once(report)
    assert b_remote.count["promoted"] > 0
    assert b_remote.count["promoted"] == b_remote.count["promotions_started"]
    assert rb.external_hits > rc.external_hits
    assert saved > 0
    assert set(b_remote.promoted_log) <= written  # every promotion is a chunk A wrote
    # The hits came from the files: B's index was rebuilt from them, and each promotion is a
    # verified read of one.
    counters = _disk_clients(b)[0].snapshot()["counters"]
    assert counters["rebuild_files"] == len(files)
    assert counters["hits"] == b_remote.count["promoted"]
    assert counters["damaged"] == 0
    b.close()
    alone.close()


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_another_model_on_the_same_disk_dir_finds_none(tmp_path: Path, layout: Layout) -> None:
    shape = SHAPES[layout]
    disk = tmp_path / "disk"
    _serve_and_close(shape, disk)
    b = _build(shape, disk, model="other-model")
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    b_remote = b.scheduler.connector.remote
    assert b_remote.count["remote_lookups"] > 0
    assert b_remote.count["remote_chunks_found"] == 0
    assert b_remote.count["promotions_started"] == 0
    assert rb.wrong_reads == 0
    assert flush_writes(b)
    b.close()
    # Each model its own directory under disk_dir.
    assert len({p.parent.parent for p in _chunk_files(disk)}) == 2


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2  # inside the value: the digest no longer verifies
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


DAMAGE: dict[str, Callable[[Path], None]] = {"flipped": _flip, "truncated": _truncate}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_a_miss_removed_and_recomputed(tmp_path: Path, damage: str) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    disk = tmp_path / "disk"
    _serve_and_close(shape, disk)
    files = _chunk_files(disk)
    for path in files:
        DAMAGE[damage](path)
    damaged = {path: path.read_bytes() for path in files}

    b = _build(shape, disk)
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    alone = _build(shape, None)
    rc = run_prompts(alone, chat_prompts(shape.trace, "c-"))
    b_remote = b.scheduler.connector.remote
    assert b_remote.count["promoted"] == 0
    failed = sum(b_remote.count[k] for k in ("missing", "corrupt"))
    assert failed == b_remote.count["promotions_started"]
    assert rb.wrong_reads == 0
    _every_token_once(rb)
    # Recomputed: B serves exactly what an engine without the tier serves.
    assert (rb.external_hits, rb.prefill_computed) == (rc.external_hits, rc.prefill_computed)
    # Each damaged file is a miss, counted and removed: a file cut short by B's start-up scan
    # (DK-5, its size gives it away), a flipped one by the read that found it (DK-6). None is
    # left in place (B's own stores may write a chunk anew).
    counters = _disk_clients(b)[0].snapshot()["counters"]
    assert counters["hits"] == 0
    assert counters["damaged"] == counters["removed_damaged"] == failed
    assert counters["rebuild_truncated"] + counters["damaged"] == len(files)
    if damage == "flipped":
        assert counters["damaged_digest"] == failed == len(files)  # every stat saw a file
    assert flush_writes(b)
    for path, bad in damaged.items():
        assert not path.exists() or path.read_bytes() != bad
    b.close()
    alone.close()


def test_tensor_parallel_ranks_each_keep_a_directory_and_a_share(tmp_path: Path) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    disk = tmp_path / "disk"
    written, _ = _serve_and_close(shape, disk, tp=2)
    dirs = {p.parent.parent for p in _chunk_files(disk)}
    assert len(dirs) == 2  # one per rank's shard
    b = _build(shape, disk, tp=2)
    shares = {c.config.capacity_bytes for c in _disk_clients(b)}
    assert shares == {DISK_BYTES // 2}
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    b_remote = b.scheduler.connector.remote
    assert b_remote.count["promoted"] > 0
    assert set(b_remote.promoted_log) <= written
    assert rb.wrong_reads == 0
    _every_token_once(rb)
    b.close()


def test_the_byte_limit_holds_on_a_disk_smaller_than_the_trace(tmp_path: Path) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    disk = tmp_path / "disk"
    probe = _build(shape, disk)
    slot = probe.ranks[0].worker.worker_remote.host.slot_bytes
    probe.close()
    limit = 6 * (slot * 2 + 8192)  # a few chunks' files of two members
    a = _build(shape, disk, disk_bytes=limit)
    report = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    snapshot = _disk_clients(a)[0].snapshot()
    assert 0 < snapshot["bytes"] + snapshot["reserved"] <= limit
    assert snapshot["counters"]["evictions"] > 0  # the trace wrote more than the limit
    assert sum(p.stat().st_size for p in _chunk_files(disk)) <= limit
    assert report.wrong_reads == 0
    a.close()


HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto" / "disk-tier.md"


def test_the_howto_config_parses_to_the_disk_tier_it_describes() -> None:
    line = next(x for x in HOWTO.read_text().splitlines() if "--kv-transfer-config" in x)
    config = json.loads(line.split("--kv-transfer-config '")[1].rstrip("'"))
    parsed = parse_extra_config(config["kv_connector_extra_config"])
    assert parsed.disk == DiskSettings("/mnt/nvme/hybridkv", 100 << 30, "lru", 4, "file", "auto")
    assert parsed.remote is None


@pytest.mark.parametrize("remembers", [False, True], ids=["disk-config", "server-default"])
def test_a_chunk_the_disk_evicted_is_written_again_when_stored_again(
    tmp_path: Path, remembers: bool
) -> None:
    """The write-behind with a disk below trusts no memory of having written a chunk
    (:data:`hybridkv.vllm.disk.DISK_INDEX_ENTRIES`): a chunk is stored again when the disk
    lost it, and must go back. The server's default (remember 65,536 writes) is the guard: it
    skips the write, and the chunk stays off the disk."""
    payload = bytes(range(256)) * 64  # one 16 KiB member
    chunks = [make_chunk(DISK_NAMESPACE, (bytes([i]) * 16,)) for i in range(3)]
    probe = DiskClient(DiskConfig(tmp_path / "probe", capacity_bytes=1 << 30, rescan_s=0))
    probe_tier = RemoteTier(disk_remote_config(), probe, background=False)
    probe_tier.write_behind(chunks[0], [payload])
    probe_tier.write_pending()
    one_file = probe.snapshot()["bytes"]
    probe_tier.close()

    disk = DiskClient(DiskConfig(tmp_path / "disk", capacity_bytes=2 * one_file, rescan_s=0))
    config = disk_remote_config()
    if remembers:
        config = dataclasses.replace(config, index_entries=1 << 16)
    tier = RemoteTier(config, disk, background=False)
    for chunk in chunks:  # the third write evicts the first file (room for two)
        assert tier.write_behind(chunk, [payload]) is Admission.ENQUEUED
        tier.write_pending()
    first = chunks[0].key
    assert disk.exists([redis_key(c.key) for c in chunks]) == (False, True, True)
    again = tier.write_behind(chunks[0], [payload])  # stored again: the disk lost it
    tier.write_pending()
    held = disk.exists([redis_key(first)])
    if remembers:
        assert again is Admission.KNOWN
        assert held == (False,)
    else:
        assert again is Admission.ENQUEUED
        assert held == (True,)
    tier.close()
