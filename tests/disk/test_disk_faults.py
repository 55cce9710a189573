"""The disk tier under faults on a real filesystem (issue 31, "Proof"): a writer killed with
SIGKILL mid-write and restarted, a full filesystem, files corrupted, cut short or deleted under
the client, and two owner processes on one directory.

Each scenario checks every read against the value its key stands for (``value_of``): a wrong
read is counted, and must be 0. The processes are ``_disk_worker.py``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _disk_worker import key_of, value_of

from hybridkv.disk import ALIGN, DiskClient, DiskConfig, DiskRole, padded_size
from hybridkv.disk.names import chunk_path
from hybridkv.remote import PromoteOutcome, RemoteConfig, RemoteTier, make_chunk

WORKER = Path(__file__).with_name("_disk_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _worker(mode: str, args: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    return [*prefix, sys.executable, str(WORKER), mode, json.dumps(args)]


def _env() -> dict[str, str]:
    # The worker imports the hybridkv this test imports (a checkout or the installed wheel).
    import hybridkv

    package_root = str(Path(hybridkv.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, str(WORKER.parent)])}


def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/.*.tmp.*"))


# --- kill -9 mid-write, then restart ---

CHUNK = (2 << 20) + 17  # 2 MiB chunks: two I/O segments each, on the writer's pool


def _kill_a_writer(directory: Path, round_: int, rng: random.Random) -> dict[str, int]:
    """Start a writer, read beside it as a READER, SIGKILL it; what the reader saw."""
    args = {
        "directory": str(directory),
        "capacity": 24 * CHUNK,
        "fsync": "file" if round_ % 2 else "never",
        "size": CHUNK,
        "first": round_ * 1000,
    }
    proc = subprocess.Popen(_worker("writer", args), stdout=subprocess.PIPE, env=_env(), text=True)
    seen = {"hits": 0, "wrong": 0}
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        reader = DiskClient(DiskConfig(directory, 24 * CHUNK), role=DiskRole.READER)
        stop = time.monotonic() + rng.uniform(0.2, 0.6)
        while time.monotonic() < stop:
            for i in range(round_ * 1000, round_ * 1000 + 40):
                got = reader.get(key_of(i))
                if isinstance(got, bytes):
                    seen["hits"] += 1
                    seen["wrong"] += got != value_of(key_of(i), CHUNK)
        reader.close()
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return seen


def test_kill_9_mid_write_then_restart_reads_nothing_wrong(tmp_path: Path) -> None:
    """DK-4 and DK-5: a reader beside the writer and the restarted owner read 0 wrong bytes;
    the restart finds every torn temporary file the killed writer left and removes it."""
    rng = random.Random(31)
    torn_total = restarts_read = reader_hits = 0
    for round_ in range(40):
        seen = _kill_a_writer(tmp_path, round_, rng)
        assert seen["wrong"] == 0
        reader_hits += seen["hits"]
        torn = _temps(tmp_path)
        owner = DiskClient(DiskConfig(tmp_path, 24 * CHUNK, rescan_s=0))
        snap = owner.snapshot()
        assert snap["counters"]["rebuild_torn"] == len(torn)
        assert _temps(tmp_path) == []
        for hexkey in snap["index"]:
            key = bytes.fromhex(hexkey)
            assert owner.get(key) == value_of(key, CHUNK)  # 0 wrong reads, 0 misses
            restarts_read += 1
        owner.check()
        owner.close()
        torn_total += len(torn)
        if round_ >= 5 and torn_total >= 2:
            break
    assert torn_total >= 2, "no kill landed mid-write in 40 rounds"
    assert restarts_read > 0
    print(
        f"kill -9: {round_ + 1} kills, {torn_total} torn temporary files found and removed, "
        f"{restarts_read} reads after restarts and {reader_hits} beside the writer, 0 wrong"
    )


# --- a full filesystem ---


def _mount_namespace(probe_dir: Path) -> tuple[str, ...] | None:
    """A command prefix that runs its command in a new mount namespace where it may mount a
    tmpfs (as root; else as root of a new user namespace), or None where neither is allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in (
        (unshare, "--mount", "--propagation", "private"),
        (unshare, "--user", "--map-root-user", "--mount", "--propagation", "private"),
    ):
        tried = subprocess.run(
            [*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe_dir)],
            capture_output=True,
            check=False,
        )
        if tried.returncode == 0:
            return prefix
    return None


def test_a_full_filesystem_refuses_a_store_cleanly_then_the_tier_fits_it(tmp_path: Path) -> None:
    """A 1 MiB tmpfs under a tier allowed 8 MiB: the write that finds the filesystem full is a
    FAULT (ENOSPC), counted, its temporary file removed, its reservation released, and it
    lowers the tier's limit to what it holds; every later write evicts to make room and
    succeeds. Nothing read is wrong: what the tier holds reads back whole, the rest misses."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    prefix = _mount_namespace(mount_point)
    if prefix is None:
        reason = "neither root nor an unprivileged user namespace may mount a tmpfs here"
        if os.environ.get("HYBRIDKV_REQUIRE_DISKFULL") == "1":
            pytest.fail(f"HYBRIDKV_REQUIRE_DISKFULL=1 but {reason}")
        pytest.skip(reason)
    size, chunks = 100_000, 30
    args = {
        "directory": str(mount_point),
        "fs_bytes": 1 << 20,
        "capacity": 8 << 20,
        "size": size,
        "chunks": chunks,
    }
    done = subprocess.run(
        _worker("diskfull", args, prefix),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    snap = seen["snapshot"]
    counters = snap["counters"]
    assert seen["fs_bytes"] == 1 << 20  # the tmpfs, not the disk under it
    refused, written = seen["refused"], seen["written"]
    assert 1 <= len(refused) <= 2, seen  # the filesystem's end, found once (twice at most)
    assert written[-1] == chunks - 1  # writes go on after it
    assert counters["set_enospc"] == counters["set_faults"] == counters["capacity_lowered"]
    assert counters["set_enospc"] == len(refused)
    assert counters["evictions"] > 0
    assert seen["temps"] == []
    assert snap["reserved"] == 0
    assert snap["bytes"] <= 1 << 20
    assert seen["wrong"] == 0
    held = sorted(i for i in range(chunks) if key_of(i).hex() in snap["index"])
    assert seen["hits"] == held  # what the tier holds reads back whole
    assert held[-1] == chunks - 1  # the most recent writes
    assert seen["found"] == [i in held for i in range(chunks)]
    assert snap["bytes"] == padded_size(32, size) * len(held)
    assert list(mount_point.iterdir()) == []  # the mount ended with its namespace
    print(
        f"disk full: {len(refused)} of {chunks} writes refused (ENOSPC), {len(written)} written, "
        f"{counters['evictions']} evicted to fit the 1 MiB tmpfs, {len(held)} held and read "
        "back whole, 0 wrong"
    )


# --- corrupted, cut short, deleted under the client ---


def _damage(path: Path, how: str, donor: bytes) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip_value":
        data[ALIGN + 100] ^= 0x10
    elif how == "flip_header":
        data[20] ^= 0x01  # inside the digest
    elif how == "cut_half":
        del data[len(data) // 2 + 1 :]
    elif how == "cut_block":
        del data[ALIGN:]
    elif how == "zeros":  # what a power loss under fsync=never may leave
        data[:] = bytes(len(data))
    elif how == "foreign":
        data[:] = donor  # another chunk's whole file
    if how == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data))


HOWS = (
    "intact",
    "flip_value",
    "flip_header",
    "cut_half",
    "cut_block",
    "zeros",
    "foreign",
    "delete",
)


def test_files_damaged_under_the_tier_are_misses_never_wrong_kv(tmp_path: Path) -> None:
    """DK-1, DK-6, DK-7 through the remote tier: every chunk promotes its own payloads or is
    MISSING; each damaged file is counted by kind and removed; the index keeps the intact."""
    client = DiskClient(DiskConfig(tmp_path, 64 << 20, rescan_s=0))
    tier = RemoteTier(RemoteConfig(), client, background=False)
    chunks, payloads = [], []
    for i in range(3 * len(HOWS)):
        members = (key_of(2 * i), key_of(2 * i + 1))
        chunks.append(make_chunk(b"hybridkv", members))
        payloads.append(tuple(value_of(m, 6000) for m in members))
        tier.write_behind(chunks[-1], payloads[-1])
    assert tier.write_pending() == len(chunks)
    files = sorted(tmp_path.glob("*/*"))
    assert len(files) == len(chunks)
    by_file = {path.name: path for path in files}
    pristine = [path.read_bytes() for path in files]
    hows = {}
    for n, chunk in enumerate(chunks):
        path = by_file[chunk_path(tmp_path, _disk_key(chunk.key)).name]
        hows[chunk.key] = HOWS[n % len(HOWS)]
        _damage(path, hows[chunk.key], donor=pristine[(n + 1) % len(files)])
    outcomes: dict[str, list[PromoteOutcome]] = {}
    for chunk, expected in zip(chunks, payloads, strict=True):
        assert tier.begin_promotion(chunk)
        fetched = tier.fetch(chunk)
        outcomes.setdefault(hows[chunk.key], []).append(fetched.outcome)
        if fetched.outcome is PromoteOutcome.PROMOTED:
            assert fetched.payloads == expected
    assert outcomes.pop("intact") == [PromoteOutcome.PROMOTED] * 3
    assert all(o == [PromoteOutcome.MISSING] * 3 for o in outcomes.values()), outcomes
    counters = client.snapshot()["counters"]
    damaged = {name: counters[f"damaged_{name}"] for name in ("digest", "truncated", "foreign")}
    # flip_value, flip_header, zeros: digest (zeros: magic); cut_*: truncated; foreign.
    assert damaged == {"digest": 6, "truncated": 6, "foreign": 3}
    assert counters["damaged_magic"] == 3
    assert counters["removed_damaged"] == counters["damaged"] == 18
    assert counters["vanished"] == 3
    remaining = sorted(path.name for path in tmp_path.glob("*/*"))
    intact = sorted(
        chunk_path(tmp_path, _disk_key(c.key)).name for c in chunks if hows[c.key] == "intact"
    )
    assert remaining == intact
    assert sorted(client.snapshot()["index"]) == intact
    client.check()
    tier.close()


def _disk_key(chunk_key: bytes) -> bytes:
    from hybridkv.remote import redis_key

    return redis_key(chunk_key)


# --- two owner processes on one directory ---


def test_two_owner_processes_share_one_directory(tmp_path: Path) -> None:
    """Two engines write overlapping chunks (equal bytes: content addressing) into one
    directory, each bounded by its own capacity, each evicting under the other's feet, each
    reading the other's chunks: 0 wrong reads, 0 exceptions, hits on the other's chunks."""
    shared = list(range(10))
    size = 10_000
    capacity = 20 * padded_size(32, size)  # 20 files; the two write 40 distinct chunks
    procs = []
    for side in (0, 1):
        mine = shared + list(range(100 + 100 * side, 115 + 100 * side))
        theirs = list(range(100 + 100 * (1 - side), 115 + 100 * (1 - side)))
        args = {
            "directory": str(tmp_path),
            "capacity": capacity,
            "rescan_s": 0.1,
            "mine": mine,
            "theirs": theirs,
            "size": size,
            "seconds": 3.0,
        }
        procs.append(
            subprocess.Popen(
                _worker("owner", args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=_env(), text=True,
            )
        )  # fmt: skip
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        seen, snap = result["seen"], result["snapshot"]
        assert (seen["wrong"], seen["errors"], seen["faults"]) == (0, 0, 0), seen
        assert seen["other_hits"] > 0, seen
        assert snap["bytes"] <= capacity
        assert snap["reserved"] == 0
    assert sum(r["snapshot"]["counters"]["vanished"] for r in results) > 0
    assert sum(r["snapshot"]["counters"]["adopted"] for r in results) > 0
    assert _temps(tmp_path) == []
    on_disk = sum(path.stat().st_size for path in tmp_path.glob("*/*"))
    assert on_disk <= 2 * capacity
    # Whatever both left verifies whole for a third engine.
    third = DiskClient(DiskConfig(tmp_path, 2 * capacity, rescan_s=0))
    for hexkey in third.snapshot()["index"]:
        key = bytes.fromhex(hexkey)
        assert third.get(key) == value_of(key, size)
    third.close()
