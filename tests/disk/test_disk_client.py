"""DiskClient on a real directory: the ChunkClient contract, eviction by bytes, pins, roles,
rebuild, rescans, O_DIRECT and its fallback, and the remote tier driving it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _disk_worker import key_of, value_of

from hybridkv.disk import (
    ALIGN,
    DISK_COUNTER_NAMES,
    DirectIO,
    DiskClient,
    DiskConfig,
    DiskRole,
    padded_size,
)
from hybridkv.disk.fileformat import SliceCheck
from hybridkv.disk.names import HOST, chunk_path
from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    ClientFault,
    PromoteOutcome,
    RemoteConfig,
    RemoteTier,
    make_chunk,
)


def owner(directory: Path, capacity: int, **settings: Any) -> DiskClient:
    return DiskClient(DiskConfig(directory, capacity, rescan_s=0, **settings))


FILE = padded_size(32, 1000)
"""The size of a small file (a header block and one block of value): the tests' unit."""


def files(n: int) -> int:
    return n * FILE


def sized(i: int, n_files: int) -> bytes:
    """A value of chunk ``i`` whose file is exactly ``n_files`` small files' size."""
    return value_of(key_of(i), files(n_files) - ALIGN)


def one_block(i: int) -> tuple[bytes, bytes]:
    """Chunk ``i`` with a value whose file is one small file."""
    key = key_of(i)
    return key, value_of(key, 1000)


def nonzero(snapshot: dict[str, Any]) -> dict[str, int]:
    return {name: n for name, n in snapshot["counters"].items() if n and name != "rebuild_us"}


def test_set_get_exists_and_the_snapshot(tmp_path: Path) -> None:
    client = owner(tmp_path, files(4))
    key, value = one_block(0)
    assert client.exists([key]) == (False,)
    assert client.get(key) is None
    assert client.set(key, value, 0) is None
    assert client.exists([key, key_of(1)]) == (True, False)
    assert client.get(key) == value
    assert chunk_path(tmp_path, key).stat().st_size == padded_size(len(key), len(value))
    snap = client.snapshot()
    assert set(snap) == {"index", "bytes", "reserved", "pins", "counters"}
    assert tuple(snap["counters"]) == DISK_COUNTER_NAMES
    assert snap["index"] == (key.hex(),)
    assert (snap["bytes"], snap["reserved"], snap["pins"]) == (FILE, 0, ())
    assert nonzero(snap) == {
        "exists_calls": 2, "exists_keys": 3, "exists_found": 1, "gets": 2, "hits": 1,
        "misses": 1, "sets": 1, "written": 1, "bytes_written": FILE, "bytes_read": FILE,
    }  # fmt: skip
    client.close()
    assert client.get(key) is ClientFault.FAULT
    assert client.set(key, value, 0) is ClientFault.FAULT
    assert client.exists([key]) is ClientFault.FAULT
    assert client.snapshot()["counters"]["closed_calls"] == 3
    client.close()


def test_lru_evicts_by_bytes_least_recent_unpinned_first(tmp_path: Path) -> None:
    client = owner(tmp_path, files(4))
    chunks = [one_block(i) for i in range(4)]
    for key, value in chunks[:3]:
        assert client.set(key, value, 0) is None
    assert client.get(chunks[0][0]) == chunks[0][1]  # 0 becomes the most recent
    big = sized(9, 3)
    assert client.set(key_of(9), big, 0) is None  # evicts 1 and 2
    snap = client.snapshot()
    assert snap["index"] == (chunks[0][0].hex(), key_of(9).hex())
    assert snap["bytes"] == files(4)
    assert (snap["counters"]["evictions"], snap["counters"]["evicted_bytes"]) == (2, files(2))
    assert not chunk_path(tmp_path, chunks[1][0]).exists()
    assert client.get(chunks[1][0]) is None
    assert client.get(key_of(9)) == big
    client.check()
    client.close()


def test_refusals_change_nothing_but_counters(tmp_path: Path) -> None:
    client = owner(tmp_path, files(2))
    assert client.set(key_of(1), sized(1, 3), 0) is ClientFault.FAULT  # 3 files > 2
    key, value = one_block(0)
    assert client.set(key, value, 0) is None
    assert client.set(key, value, 0) is None  # indexed: not written again
    before = client.snapshot()
    assert before["counters"]["set_too_large"] == 1
    assert before["counters"]["set_present"] == 1
    assert before["counters"]["written"] == 1
    with pytest.raises(HybridKVConfigError):
        client.get(b"")
    with pytest.raises(HybridKVConfigError):
        client.set(bytes(97), b"", 0)
    client.close()


def _held_reads(client: DiskClient) -> tuple[threading.Event, threading.Event]:
    """Make the client's reads wait, after opening the file, until ``release`` is set."""
    opened, release = threading.Event(), threading.Event()
    read = client._io.read_chunk

    def held(fd: int, image: memoryview, key: bytes, size: int) -> object:
        opened.set()
        assert release.wait(10)
        return read(fd, image, key, size)

    client._io.read_chunk = held  # type: ignore[assignment]
    return opened, release


def test_a_read_pins_its_key_against_eviction(tmp_path: Path) -> None:
    """DK-3: while a get reads key 0, a set that needs its room is refused; after, it is not."""
    client = owner(tmp_path, files(1))
    key, value = one_block(0)
    assert client.set(key, value, 0) is None
    opened, release = _held_reads(client)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(client.get(key)))
    reader.start()
    assert opened.wait(10)
    assert client.snapshot()["pins"] == ((key.hex(), 1),)
    assert client.set(*one_block(1), 0) is ClientFault.FAULT
    assert client.snapshot()["counters"]["set_no_space"] == 1
    assert chunk_path(tmp_path, key).exists()
    release.set()
    reader.join()
    assert got == [value]
    assert client.snapshot()["pins"] == ()
    assert client.set(*one_block(1), 0) is None
    client.close()


def test_a_file_removed_while_a_read_holds_it_open_reads_whole(tmp_path: Path) -> None:
    """DK-7: another engine unlinks the file after our open: the read still verifies whole."""
    client = owner(tmp_path, files(2))
    key, value = one_block(0)
    client.set(key, value, 0)
    opened, release = _held_reads(client)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(client.get(key)))
    reader.start()
    assert opened.wait(10)
    os.unlink(chunk_path(tmp_path, key))
    release.set()
    reader.join()
    assert got == [value]
    assert client.get(key) is None  # removed before this open: a miss, forgotten
    snap = client.snapshot()
    assert snap["counters"]["vanished"] == 1
    assert snap["index"] == ()
    assert snap["bytes"] == 0
    client.close()


def test_a_write_in_flight_holds_its_reservation_and_is_invisible(tmp_path: Path) -> None:
    """DK-2 with writes in flight, DK-4: until its rename a key is neither seen nor counted."""
    client = owner(tmp_path, files(2))
    started, release = threading.Event(), threading.Event()
    write = client._io.write_chunk

    def held(fd: int, image: memoryview, key: bytes, value: bytes) -> None:
        started.set()
        assert release.wait(10)
        write(fd, image, key, value)

    client._io.write_chunk = held  # type: ignore[method-assign]
    key, value = one_block(0)
    writer = threading.Thread(target=client.set, args=(key, value, 0))
    writer.start()
    assert started.wait(10)
    snap = client.snapshot()
    assert (snap["bytes"], snap["reserved"], snap["index"]) == (0, FILE, ())
    assert client.exists([key]) == (False,)
    assert client.get(key) is None
    assert client.set(key, value, 0) is None  # the same key's write is in flight
    assert client.snapshot()["counters"]["set_pending"] == 1
    assert client.set(key_of(5), sized(5, 2), 0) is ClientFault.FAULT  # 1 file's room is free
    release.set()
    writer.join()
    assert client.get(key) == value
    snap = client.snapshot()
    assert (snap["bytes"], snap["reserved"]) == (FILE, 0)
    client.close()


def test_many_threads_read_and_write_within_the_bound(tmp_path: Path) -> None:
    client = owner(tmp_path, files(6), threads=3)
    wrong: list[int] = []
    faults: list[object] = []
    stop = time.monotonic() + 2.0

    def work(seed: int) -> None:
        i = seed
        while time.monotonic() < stop:
            i = (i * 7 + 3) % 11
            key = key_of(i)
            value = value_of(key, 300 + 900 * (i % 3))
            if i % 2:
                fault = client.set(key, value, 0)
                if fault is not None:
                    faults.append(fault)
            else:
                got = client.get(key)
                if got is not None and got != value:
                    wrong.append(i)
            client.check()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    snap = client.snapshot()
    assert snap["bytes"] <= files(6)
    assert snap["reserved"] == 0
    assert snap["counters"]["set_no_space"] == len(faults)  # pins only, never an I/O fault
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/*"))
    assert on_disk == snap["bytes"]
    client.close()


def test_arc_policy_runs_the_same_contract(tmp_path: Path) -> None:
    client = owner(tmp_path, files(3), policy="arc")
    for i in range(6):
        client.set(*one_block(i), 0)
        client.get(key_of(i))
        client.get(key_of(0))
    snap = client.snapshot()
    assert len(snap["index"]) == 3
    assert key_of(0).hex() in snap["index"]
    for hexkey in snap["index"]:
        assert (
            client.get(bytes.fromhex(hexkey))
            == one_block(next(i for i in range(6) if key_of(i).hex() == hexkey))[1]
        )
    client.check()
    client.close()


def test_arc_adapts_its_target_on_a_write_of_a_ghost_key(tmp_path: Path) -> None:
    """A write of a key ARC evicted from T1 is a ghost hit: the target rises, so T1 keeps more
    and T2's key becomes an earlier victim. (The index once never told the policy of the
    miss: the target stayed 0 and the order was T1 first, ``(b, c, a)``.)"""
    a, b, c, d = (one_block(i) for i in range(4))
    client = owner(tmp_path, files(3), policy="arc")
    for chunk in (a, b, c):
        assert client.set(*chunk, 0) is None
    assert client.get(a[0]) == a[1]  # a: T1 -> T2
    assert client.set(*d, 0) is None  # evicts b (T1's oldest): a ghost in B1
    assert client.set(*b, 0) is None  # B1 ghost hit: target 0 -> 1, evicts c (to B1)
    assert client.set(*c, 0) is None  # B1 ghost hit: target 1 -> 2, evicts d
    # Target 2 with T1 = [b, c]: b, then T2's a (T1 is below the target), then c.
    assert client.snapshot()["index"] == tuple(k.hex() for k in (b[0], a[0], c[0]))
    assert nonzero(client.snapshot())["evictions"] == 3
    client.check()
    client.close()


def test_arc_refreshes_a_set_of_a_present_key_as_a_store(tmp_path: Path) -> None:
    """A ``set`` of a key whose file is there is a store, not a read: ARC keeps the key in
    T1 (most recent there), as the host store does. (The index once promoted it to T2 as a
    read: the order was ``(c, b, a)``.)"""
    a, b, c = (one_block(i) for i in range(3))
    client = owner(tmp_path, files(3), policy="arc")
    for chunk in (a, b, c):
        assert client.set(*chunk, 0) is None
    assert client.get(b[0]) == b[1]  # b: T1 -> T2
    assert client.set(*a, 0) is None  # present: refreshed in T1, nothing written
    assert client.snapshot()["index"] == tuple(k.hex() for k in (c[0], a[0], b[0]))
    assert nonzero(client.snapshot())["set_present"] == 1
    client.close()


def test_big_values_go_in_segments_and_back(tmp_path: Path) -> None:
    for threads in (1, 4):
        client = owner(tmp_path / str(threads), 64 << 20, threads=threads)
        key = key_of(threads)
        value = value_of(key, (5 << 20) + 123)
        assert client.set(key, value, 0) is None
        assert client.get(key) == value
        client.close()


def test_files_of_the_other_format_version_are_misses_removed(tmp_path: Path) -> None:
    # A client asked for version 1's SHA-256 slices (the benchmark's comparison) reads its own
    # files; the format's client finds them a version miss, counts and removes them (DK-6).
    key = key_of(7)
    value = value_of(key, (1 << 20) + 5)
    old = DiskClient(DiskConfig(tmp_path, 8 << 20, rescan_s=0), slice_check=SliceCheck.SHA256)
    assert old.set(key, value, 0) is None
    assert old.get(key) == value
    old.close()
    client = owner(tmp_path, 8 << 20)
    assert client.snapshot()["index"] == (key.hex(),)
    assert client.get(key) is None
    counters = client.snapshot()["counters"]
    assert (counters["damaged_version"], counters["removed_damaged"]) == (1, 1)
    assert not chunk_path(tmp_path, key).exists()
    assert client.set(key, value, 0) is None
    assert client.get(key) == value
    client.close()


def test_a_large_lookup_is_statted_on_the_pool(tmp_path: Path) -> None:
    writer = owner(tmp_path, files(100))
    for i in range(0, 60, 3):
        writer.set(*one_block(i), 0)
    reader = DiskClient(DiskConfig(tmp_path, files(100)), role=DiskRole.READER)
    keys = [key_of(i) for i in range(60)]
    assert reader.exists(keys) == tuple(i % 3 == 0 for i in range(60))
    assert writer.exists(keys) == reader.exists(keys)
    reader.close()
    writer.close()


def test_a_reader_never_writes_or_removes(tmp_path: Path) -> None:
    reader = DiskClient(DiskConfig(tmp_path / "none", files(4)), role=DiskRole.READER)
    assert not (tmp_path / "none").exists()  # a reader does not create the directory
    assert reader.exists([key_of(0)]) == (False,)
    reader.close()
    writer = owner(tmp_path, files(4))
    key, value = one_block(0)
    writer.set(key, value, 0)
    reader = DiskClient(DiskConfig(tmp_path, files(4)), role=DiskRole.READER)
    assert reader.get(key) == value
    assert reader.set(key_of(1), b"x", 0) is ClientFault.FAULT
    path = chunk_path(tmp_path, key)
    data = bytearray(path.read_bytes())
    data[ALIGN + 200] ^= 1
    path.write_bytes(data)
    assert reader.get(key) is None
    assert path.exists()  # the owner removes damaged files, not a reader
    counters = reader.snapshot()["counters"]
    assert (counters["set_refused_reader"], counters["damaged_digest"]) == (1, 1)
    assert writer.get(key) is None
    assert not path.exists()
    reader.close()
    writer.close()


def test_rebuild_indexes_complete_files_by_mtime_and_removes_what_a_crash_left(
    tmp_path: Path,
) -> None:
    """DK-5 on a directory laid out by hand."""
    first = owner(tmp_path, files(10))
    for i in range(4):
        first.set(*one_block(i), 0)
    first.close()
    for age, i in enumerate((2, 0, 3, 1)):  # oldest first: 1, 3, 0, 2
        stamp = time.time() - 100 * (age + 1)
        os.utime(chunk_path(tmp_path, key_of(i)), (stamp, stamp))
    sub = chunk_path(tmp_path, key_of(5)).parent
    sub.mkdir(exist_ok=True)
    name = key_of(5).hex()
    dead = _dead_pid()
    (sub / f".{name}.tmp.{HOST}.{dead}.ab12").write_bytes(b"half")  # dead writer: torn
    (sub / f".{name}.tmp.{HOST}.{os.getpid()}.cd34").write_bytes(b"live")  # live: kept
    old_elsewhere = sub / f".{name}.tmp.otherhost.{dead}.ef56"
    old_elsewhere.write_bytes(b"old")
    os.utime(old_elsewhere, (time.time() - 1000, time.time() - 1000))
    (sub / f".{name}.tmp.otherhost.{dead}.0000").write_bytes(b"young")  # kept
    (sub / name).write_bytes(b"x" * 100)  # a complete name, truncated
    (sub / "notes.txt").write_bytes(b"not ours")  # left alone
    second = DiskClient(DiskConfig(tmp_path, files(3), rescan_s=0, stale_temp_s=300))
    snap = second.snapshot()
    # Over capacity: the oldest (1) removed; the rest in mtime order, oldest first.
    assert snap["index"] == tuple(key_of(i).hex() for i in (3, 0, 2))
    assert nonzero(snap) == {
        "rebuild_files": 3, "rebuild_bytes": files(3), "rebuild_torn": 2,
        "rebuild_truncated": 1, "rebuild_over_capacity": 1,
    }  # fmt: skip
    assert sorted(p.name.rsplit(".", 1)[1] for p in sub.glob(".*")) == ["0000", "cd34"]
    assert (sub / "notes.txt").exists()
    assert not chunk_path(tmp_path, key_of(1)).exists()
    assert second.get(key_of(3)) == one_block(3)[1]
    second.close()


def _dead_pid() -> int:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_a_rescan_adopts_what_others_wrote_and_forgets_what_they_removed(tmp_path: Path) -> None:
    a, b = owner(tmp_path, files(3)), owner(tmp_path, files(3))
    for i in range(2):
        a.set(*one_block(i), 0)
    assert b.snapshot()["index"] == ()
    assert b.exists([key_of(0)]) == (True,)  # statted: written by another engine
    assert b.get(key_of(0)) == one_block(0)[1]
    b.rescan()
    assert set(b.snapshot()["index"]) == {key_of(0).hex(), key_of(1).hex()}
    assert b.set(*one_block(1), 0) is None
    assert b.snapshot()["counters"]["set_present"] == 1
    a.set(*one_block(2), 0)
    assert b.set(*one_block(2), 0) is None  # complete on disk: indexed, not written
    assert b.snapshot()["counters"]["set_adopted"] == 1
    b.set(*one_block(3), 0)  # b is full: evicts its least recent, 0, under a's feet
    assert a.get(key_of(0)) is None  # DK-7: a miss for a
    assert a.snapshot()["counters"]["vanished"] == 1
    os.unlink(chunk_path(tmp_path, key_of(1)))
    b.rescan()
    counters = b.snapshot()["counters"]
    assert (counters["rescans"], counters["adopted"], counters["vanished"]) == (2, 2, 1)
    a.close()
    b.close()


def test_the_rescan_thread_runs_every_rescan_s(tmp_path: Path) -> None:
    a = owner(tmp_path, files(3))
    b = DiskClient(DiskConfig(tmp_path, files(3), rescan_s=0.05))
    a.set(*one_block(0), 0)
    deadline = time.monotonic() + 10
    while b.snapshot()["counters"]["adopted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.snapshot()["index"] == (key_of(0).hex(),)
    b.close()
    a.close()


class _Refusing:
    """os.open/pwrite/preadv that refuse O_DIRECT with EINVAL, as tmpfs before Linux 6.6 and
    some network filesystems do: at open (``at="open"``) or at each transfer on a file whose
    O_DIRECT flag is set (the start-up probe's aside, so the refusal comes at a transfer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: str) -> None:
        self.probes: set[int] = set()
        real_open, real_pwrite, real_preadv = os.open, os.pwrite, os.preadv

        def fake_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
            if flags & os.O_DIRECT and at == "open":
                raise OSError(errno.EINVAL, "Invalid argument")
            fd = real_open(path, flags, mode, **kw)
            self.probes.discard(fd)  # a number reused after a close
            if ".probe." in str(path):
                self.probes.add(fd)
            return fd

        def refuse(real: Any) -> Any:
            def transfer(fd: int, *args: Any) -> Any:
                if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and fd not in self.probes:
                    raise OSError(errno.EINVAL, "Invalid argument")
                return real(fd, *args)

            return transfer

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "pwrite", refuse(real_pwrite))
        monkeypatch.setattr(os, "preadv", refuse(real_preadv))


def _fallback_logs(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if "O_DIRECT refused" in r.getMessage()])


@pytest.mark.parametrize("at", ["open", "transfer"])
def test_o_direct_refused_falls_back_to_buffered_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    _Refusing(monkeypatch, at)
    if at == "open":
        with pytest.raises(HybridKVConfigError) as caught:
            owner(tmp_path, files(4), direct=DirectIO.ON)
        assert caught.value.field == "disk_direct"
    with caplog.at_level(logging.WARNING, logger="hybridkv.disk"):
        client = owner(tmp_path, files(4))
        for i in range(3):
            assert client.set(*one_block(i), 0) is None
            assert client.get(key_of(i)) == one_block(i)[1]
        reader = DiskClient(DiskConfig(tmp_path, files(4)), role=DiskRole.READER)
        assert reader.get(key_of(0)) == one_block(0)[1]
        assert reader.get(key_of(1)) == one_block(1)[1]
    assert client.snapshot()["counters"]["direct_fallbacks"] == 1
    assert reader.snapshot()["counters"]["direct_fallbacks"] == 1
    assert _fallback_logs(caplog) == 2  # once per client
    client.close()
    reader.close()


def test_o_direct_on_refuses_every_transfer_instead_of_falling_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Refusing(monkeypatch, "transfer")
    client = owner(tmp_path, files(4), direct=DirectIO.ON)
    assert client.set(*one_block(0), 0) is ClientFault.FAULT
    assert list(tmp_path.glob("*/.*")) == []  # the temporary file removed
    monkeypatch.undo()
    assert client.set(*one_block(0), 0) is None
    _Refusing(monkeypatch, "transfer")
    assert client.get(key_of(0)) is ClientFault.FAULT
    counters = client.snapshot()["counters"]
    assert (counters["set_faults"], counters["get_faults"], counters["direct_fallbacks"]) == (
        1,
        1,
        0,
    )
    client.close()


def test_o_direct_where_the_filesystem_takes_it(tmp_path: Path) -> None:
    try:
        client = owner(tmp_path, files(4), direct=DirectIO.ON)
    except HybridKVConfigError as refused:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: {refused}")
    key, value = one_block(0)
    assert client.set(key, value, 0) is None
    assert client.get(key) == value
    assert client.snapshot()["counters"]["direct_fallbacks"] == 0
    client.close()
    plain = owner(tmp_path, files(4), direct=DirectIO.OFF)
    assert plain.get(key) == value
    plain.close()


def test_the_remote_tier_writes_and_promotes_through_the_disk(tmp_path: Path) -> None:
    client = owner(tmp_path, 1 << 20)
    tier = RemoteTier(RemoteConfig(), client, background=False)
    members = (b"m" * 32, b"n" * 32)
    payloads = (b"p" * 3000, b"q" * 3000)
    chunk = make_chunk(b"hybridkv", members)
    tier.write_behind(chunk, payloads)
    assert tier.write_pending() == 1
    assert tier.lookup([chunk]) == 1
    assert tier.begin_promotion(chunk)
    fetched = tier.fetch(chunk)
    assert fetched.outcome is PromoteOutcome.PROMOTED
    assert fetched.payloads == payloads
    for path in tmp_path.glob("*/*"):
        path.write_bytes(path.read_bytes()[:ALIGN])  # cut every file short
    assert tier.begin_promotion(chunk)
    assert tier.fetch(chunk).outcome is PromoteOutcome.MISSING  # a damaged file is a miss
    assert list(tmp_path.glob("*/*")) == []
    assert client.snapshot()["counters"]["damaged_truncated"] == 1
    tier.close()
