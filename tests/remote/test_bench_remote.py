"""tools/bench_remote.py at a tiny size: its output's structure and the byte identities it claims.

The benchmark's figures are timings (no fixed value to assert); what it claims beyond them is
asserted here on a real server at a size where every term is non-zero: both sides moved the
same payload bytes, the promoted slots equal the written bytes, and a mismatch stops the run.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest
from _redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from _inprocess import load_tool

bench = load_tool("bench_remote")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@pytest.mark.remote
def test_tiny_run_prints_one_full_row_and_equal_byte_counts(shared_redis: RedisServer) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--tiny", "--repeats", "2", "--port", str(shared_redis.port)]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("server: redis-server ") or lines[0].startswith("server: valkey")
    table = [line for line in lines[: lines.index(bench.CODEC_HEADER)] if line.startswith("|")]
    assert table[0] == bench.HEADER
    assert len(table) == 3  # header, rule, the tiny layout
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert len(cells) == bench.HEADER.count("|") - 1
    assert cells[:3] == ["tiny (12 KB)", "3 x 4096", "5"]  # 5 = 64 KB // 12 KB chunks
    # GB/s and ratios, two decimals (a tiny run's GB/s may round to 0.00: the timings' signs
    # are checked on the unrounded row below).
    assert all(re.fullmatch(r"\d+\.\d\d", c) for c in cells[3:9]), cells
    assert all(re.fullmatch(r"\d+%", c) for c in cells[9:]), cells  # encode, verify shares
    (digests,) = [line for line in lines if line.startswith("digest alone")]
    assert re.fullmatch(
        r"digest alone, one thread: sha256 \d+\.\d\d GB/s, blake2b \d+\.\d\d GB/s "
        r"\(the codec uses sha256\)",
        digests,
    ), digests
    (check,) = [line for line in lines if line.startswith("tiny: payload ")]
    counts = {int(n) for n in _NUMBER.findall(check)}
    assert counts == {5 * 3 * 4096}, check  # payload = wrote = promoted = SET = GET
    # The codec table: one row per value format, side by side, the digest's ratio 1.00.
    codec = [line for line in lines[lines.index(bench.CODEC_HEADER) + 2 :] if line]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in codec]
    assert [row[:2] for row in cells] == [["tiny (12 KB)", m] for m in bench.VALUE_MODES]
    assert all(re.fullmatch(r"\d+\.\d\d", c) for row in cells for c in (row[2], row[3], row[5]))
    assert cells[0][5] == "1.00"


def test_codec_costs_decode_every_mode_back_to_the_source() -> None:
    layout = bench.Layout("two groups", 2, 4096)
    rows = bench.codec_costs(layout, 3, 1)
    assert [row.mode for row in rows] == list(bench.VALUE_MODES)  # cryptography installed
    for row in rows:
        assert row.payload_bytes == 3 * 2 * 4096
        assert row.encode_s > 0
        assert row.decode_s > 0
        assert row.s_per_gb == pytest.approx(
            (row.encode_s + row.decode_s) / (row.payload_bytes / 1e9)
        )


def test_encryption_without_cryptography_is_a_line_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    rows = bench.codec_costs(bench.Layout("one", 1, 4096), 3, 1)
    assert [getattr(row, "mode", None) for row in rows[:2]] == ["digest", "mac"]
    assert isinstance(rows[2], str)
    assert rows[2].startswith("one aes-gcm: skipped: encryption needs the cryptography package")
    assert bench.format_codec(rows)[2] == rows[2]


@pytest.mark.remote
def test_measure_moves_the_same_bytes_on_both_sides(shared_redis: RedisServer) -> None:
    layout = bench.Layout("two groups", 2, 8192)
    row = bench.measure(layout, 4, 1, shared_redis.port)
    assert row.payload_bytes == 4 * 2 * 8192
    assert (
        row.bytes_written
        == row.bytes_fetched
        == row.plain_bytes_set
        == row.plain_bytes_got
        == row.payload_bytes
    )
    timings = (row.write_s, row.plain_set_s, row.fetch_s, row.plain_get_s)
    assert all(t > 0 for t in (*timings, row.encode_s, row.verify_s))
    assert row.write_ratio == pytest.approx(row.plain_set_s / row.write_s)  # one repeat


@pytest.mark.remote
def test_promoted_bytes_that_differ_from_the_source_stop_the_run(
    shared_redis: RedisServer,
) -> None:
    layout = bench.Layout("one", 2, 4096)
    written = bench.SlotBuffer(bytearray(b"\x01" * layout.chunk_bytes * 3), 4096)
    other = bench.SlotBuffer(bytearray(b"\x02" * layout.chunk_bytes * 3), 4096)
    config = bench.RemoteConfig(port=shared_redis.port, max_pending=3, namespace=b"bench")
    chunks = bench._chunks(layout, 3, b"mismatch")
    _, nbytes = bench._write_behind(config, chunks, written, layout.members)
    assert nbytes == 3 * layout.chunk_bytes
    assert bench._promote(config, chunks, written, layout.members)[1] == nbytes
    with pytest.raises(AssertionError, match="chunk 0 member 0 differs"):
        bench._promote(config, chunks, other, layout.members)


@pytest.mark.remote
def test_own_server_starts_answers_and_stops(redis_binary: str) -> None:
    with bench.own_server() as port:
        assert bench._server_version(port).split()[0] in ("redis-server", "valkey-server")
    with pytest.raises(bench.redis.exceptions.ConnectionError):
        bench._server_version(port)


def test_no_server_binary_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.shutil, "which", lambda _name: None)
    with pytest.raises(SystemExit, match=r"apt-get install -y redis-server.*--port"):
        bench.find_binary()


def test_preset_layouts_come_from_the_planner() -> None:
    # gemma-3-1b at tp=1: 7 groups (sliding and full), a 16-token unit; the largest group's
    # unit is 4 layers x 16 tokens x 1 KV head x 256 dims x 2 (K, V) x 2 bytes = 65536 bytes.
    assert bench.preset_layout("gemma-3-1b") == bench.Layout("gemma-3-1b", 7, 65536)
    sizes = [layout.chunk_bytes for layout in bench.default_layouts()]
    assert sizes == sorted(sizes)
    assert sizes[0] == 128 * 1024
