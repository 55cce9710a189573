"""Issue 31's restart run in vLLM's real model runner: the disk tier is warm after a restart.

The server runs docs/howto/serve.md's command (``_recipe``) with the page's JSON plus the disk
tier of docs/howto/disk-tier.md (``disk_dir`` on this test's temporary directory, ``disk_bytes``
well above what the chats write). It serves the multi-turn chats, stops (SIGTERM, as an
operator's restart does), starts again on the same directory and serves the same chats again:
a new engine process, a new host tier, nothing kept in memory between the two.

Checks, per run: every answer passes the e2e criterion against the no-connector run
(``_verdict``: equal in float32, within vLLM's own variation in bfloat16), and the connector's
counters agree with vLLM's (``_counters.disagreement``). The first run writes chunks to disk
(``vllm:hybridkv_remote_written``); the second run's external hits come from disk: its host
tier starts empty, and it promotes chunks from the files the first run left
(``vllm:hybridkv_promoted``, verified bytes fetched into host slots), with no fetch failing.
"""

from __future__ import annotations

from pathlib import Path

import _counters
import _recipe
import _server
import _verdict
import pytest
from _models import ARCHITECTURES

pytestmark = pytest.mark.e2e

DISK_BYTES = 1 << 30
WRITTEN = "vllm:hybridkv_remote_written"
PROMOTED = "vllm:hybridkv_promoted"
FETCHED_BYTES = "vllm:hybridkv_remote_fetched_bytes"
FAILED = ("vllm:hybridkv_missing", "vllm:hybridkv_corrupt", "vllm:hybridkv_fault")


def _disk_flags(disk: Path) -> list[str]:
    config = _recipe.kv_transfer_config()
    extra = {**config["kv_connector_extra_config"], "disk_dir": str(disk)}
    extra["disk_bytes"] = DISK_BYTES
    return _recipe.serve_flags({**config, "kv_connector_extra_config": extra})


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_restarted_server_serves_hits_from_disk(
    name: str, model_root: Path, tmp_path: Path, e2e_report: list[str]
) -> None:
    disk = tmp_path / "disk"
    flags = _disk_flags(disk)
    first = _server.served_run(name, model_root, flags, tmp_path / "first.log")
    held_first = _verdict.answers_hold(name, model_root, first)
    assert _counters.disagreement(first.counters) is None, _counters.disagreement(first.counters)
    written = first.counters.get(WRITTEN, 0.0)
    assert written > 0, f"{name}: the first run wrote nothing to disk"
    files = [p for p in disk.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert files, f"{name}: no chunk file under {disk}"

    second = _server.served_run(name, model_root, flags, tmp_path / "second.log")
    held_second = _verdict.answers_hold(name, model_root, second)
    counters = second.counters
    assert _counters.disagreement(counters) is None, _counters.disagreement(counters)
    promoted = counters.get(PROMOTED, 0.0)
    assert promoted > 0, f"{name}: the restarted server promoted nothing from disk"
    assert counters.get(FETCHED_BYTES, 0.0) > 0
    assert counters[_counters.EXTERNAL_HITS] > 0
    failed = {k: counters.get(k, 0.0) for k in FAILED if counters.get(k, 0.0)}
    assert not failed, f"{name}: fetches from disk failed: {failed}"
    e2e_report.append(
        f"disk       {name:8} first run wrote {written:.0f} chunks ({len(files)} files), "
        f"{held_first}; after the restart {promoted:.0f} chunks promoted from disk, "
        f"{counters[_counters.EXTERNAL_HITS]:.0f} external hit tokens "
        f"(first run {first.counters[_counters.EXTERNAL_HITS]:.0f}), {held_second}"
    )
