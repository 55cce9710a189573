"""DiskClient's less travelled paths: I/O errors as FAULTs (never exceptions), files that
vanish or change under a write, start-up refusals, and rescans that cannot adopt."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
from _disk_worker import key_of, value_of

import hybridkv.disk.io as disk_io
from hybridkv.disk import DirectIO, DiskClient, DiskConfig, DiskRole, padded_size
from hybridkv.disk.names import chunk_path
from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import ClientFault

FILE = padded_size(32, 1000)


def owner(directory: Path, n_files: int, **settings: Any) -> DiskClient:
    return DiskClient(DiskConfig(directory, n_files * FILE, rescan_s=0, **settings))


def chunk(i: int) -> tuple[bytes, bytes]:
    return key_of(i), value_of(key_of(i), 1000)


def test_an_unreadable_subdirectory_is_a_fault_for_every_call(tmp_path: Path) -> None:
    """A symlink loop where a subdirectory should be (ELOOP, not ENOENT): stat, open and
    create fail with an I/O error, which each call returns as FAULT."""
    client = owner(tmp_path, 4, threads=2)
    key, value = chunk(0)
    loop = chunk_path(tmp_path, key).parent
    loop.symlink_to(loop.name)
    assert client.exists([key]) is ClientFault.FAULT
    assert client.get(key) is ClientFault.FAULT
    assert client.set(key, value, 0) is ClientFault.FAULT
    same_subdir = [k for k in (key_of(i) for i in range(2000)) if k[0] == key[0]][:3]
    others = [key_of(i) for i in range(30)]
    assert client.exists(others + same_subdir) is ClientFault.FAULT  # fanned out on the pool
    client.rescan()  # the looping subdirectory is skipped, counted
    counters = client.snapshot()["counters"]
    assert (counters["exists_faults"], counters["get_faults"], counters["set_faults"]) == (2, 1, 1)
    assert (counters["rescan_faults"], counters["rescans"]) == (1, 1)
    assert (counters["set_enospc"], client.snapshot()["reserved"]) == (0, 0)
    client.close()


@pytest.mark.parametrize(("call", "code"), [("pwrite", errno.ENOSPC), ("fdatasync", errno.EIO)])
def test_a_failed_write_is_a_fault_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int
) -> None:
    client = owner(tmp_path, 4)
    client.set(*chunk(0), 0)

    def failing(*args: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, call, failing)
    assert client.set(*chunk(1), 0) is ClientFault.FAULT
    monkeypatch.undo()
    snap = client.snapshot()
    assert (snap["reserved"], snap["bytes"], len(snap["index"])) == (0, FILE, 1)
    assert snap["counters"]["set_faults"] == 1
    assert snap["counters"]["set_enospc"] == (code == errno.ENOSPC)
    assert snap["counters"]["capacity_lowered"] == (code == errno.ENOSPC)
    assert [p.name for p in tmp_path.glob("*/.*")] == []
    assert client.get(key_of(0)) == chunk(0)[1]  # serving goes on
    assert client.set(*chunk(1), 0) is None  # the filesystem has room again: the limit regrows
    for i in range(2, 5):
        assert client.set(*chunk(i), 0) is None
    assert len(client.snapshot()["index"]) == 4  # the configured limit, 4 files, is back
    client.close()


def test_files_removed_or_cut_by_others_are_written_again(tmp_path: Path) -> None:
    client = owner(tmp_path, 2)
    for i in range(2):
        client.set(*chunk(i), 0)
    os.unlink(chunk_path(tmp_path, key_of(1)))
    assert client.exists([key_of(0), key_of(1)]) == (True, False)  # the directory, not the index
    assert client.set(*chunk(1), 0) is None  # indexed, but gone: written again
    os.unlink(chunk_path(tmp_path, key_of(0)))  # the next victim, gone already
    assert client.set(*chunk(2), 0) is None
    path = chunk_path(tmp_path, key_of(3))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"cut")  # a complete name of another size: not adopted, replaced
    assert client.set(*chunk(3), 0) is None
    assert client.get(key_of(3)) == chunk(3)[1]
    counters = client.snapshot()["counters"]
    assert (counters["vanished"], counters["written"], counters["set_adopted"]) == (2, 5, 0)
    client.check()
    client.close()


def test_start_up_refusals_name_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(HybridKVConfigError) as caught:
        owner(blocker / "below", 4)
    assert caught.value.field == "disk_dir"
    real_open = os.open

    def no_probe(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if ".probe." in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_probe)
    with pytest.raises(HybridKVConfigError) as caught:
        owner(tmp_path / "ro", 4)
    assert caught.value.field == "disk_dir"
    monkeypatch.undo()
    monkeypatch.setattr(disk_io, "_O_DIRECT", 0)  # a platform without O_DIRECT
    with pytest.raises(HybridKVConfigError) as caught:
        owner(tmp_path / "nodirect", 4, direct=DirectIO.ON)
    assert caught.value.field == "disk_direct"
    plain = owner(tmp_path / "nodirect", 4)
    assert plain.set(*chunk(0), 0) is None
    assert plain.get(key_of(0)) == chunk(0)[1]
    assert plain.snapshot()["counters"]["direct_fallbacks"] == 0  # nothing refused: none tried
    plain.close()


def test_a_rescan_leaves_what_it_has_no_room_for(tmp_path: Path) -> None:
    big = DiskClient(DiskConfig(tmp_path, 64 * FILE, rescan_s=0))
    small = owner(tmp_path, 1)
    assert big.set(key_of(7), value_of(key_of(7), 3 * FILE), 0) is None
    (chunk_path(tmp_path, key_of(8)).parent).mkdir(exist_ok=True)
    chunk_path(tmp_path, key_of(8)).write_bytes(b"x" * 100)  # truncated: removed by a rescan
    small.rescan()
    counters = small.snapshot()["counters"]
    assert (counters["adopt_refused"], counters["adopted"], counters["rescan_truncated"]) == (
        1,
        0,
        1,
    )
    assert small.snapshot()["index"] == ()
    reader = DiskClient(DiskConfig(tmp_path, FILE), role=DiskRole.READER)
    reader.rescan()  # a reader keeps no index: nothing to do
    assert reader.snapshot()["counters"]["rescans"] == 1
    reader.close()
    small.close()
    small.rescan()  # closed: nothing
    big.close()


def test_the_rescan_thread_counts_whole_passes(tmp_path: Path) -> None:
    client = DiskClient(DiskConfig(tmp_path, FILE, rescan_s=0.01))
    deadline = time.monotonic() + 20
    while client.snapshot()["counters"]["rescans"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.snapshot()["counters"]["rescans"] >= 2
    client.close()


def test_a_file_cut_short_during_a_read_is_truncated(tmp_path: Path) -> None:
    """The header says 3 slices; the file loses its tail between the header read and the
    slices' reads: TRUNCATED, a miss, removed."""
    client = owner(tmp_path, 200, threads=3)
    key = key_of(5)
    value = value_of(key, 3 * disk_io.SLICE)
    assert client.set(key, value, 0) is None
    path = chunk_path(tmp_path, key)
    read = disk_io._pread_all
    cut = []

    def cutting(fd: int, piece: memoryview, offset: int) -> int:
        if offset == 0 and not cut:
            got = read(fd, piece, offset)
            os.truncate(path, disk_io.ALIGN + disk_io.SLICE)
            cut.append(True)
            return got
        return read(fd, piece, offset)

    disk_io._pread_all = cutting  # type: ignore[assignment]
    try:
        assert client.get(key) is None
    finally:
        disk_io._pread_all = read
    counters = client.snapshot()["counters"]
    assert counters["damaged_truncated"] == 1
    assert not path.exists()
    client.close()
