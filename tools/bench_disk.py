"""The disk tier's write and read throughput against the device's, and its rebuild time.

Three measurements, in one run, in one directory on one filesystem (``--dir``, default the
system's temp directory; it should be the device the tier will use):

1. **The device, sequentially**: one file of ``--bytes`` written with O_DIRECT from an aligned
   buffer in ``--block`` pieces, then ``fdatasync``; then read back the same way. Where the
   filesystem refuses O_DIRECT (tmpfs, overlayfs) the file is written buffered and flushed, and
   its pages are dropped (``POSIX_FADV_DONTNEED``) before the read; the line says which.
2. **The tier** (:class:`hybridkv.disk.DiskClient`, an OWNER with the given ``--threads``, fsync
   FILE unless named, O_DIRECT AUTO): for 2 MB and 32 KB values, ``set`` of distinct keys until
   about ``--bytes`` (32 KB: an eighth of it) are written, then ``get`` of every key, each
   value compared with what was written (a mismatch fails the run). ``callers`` threads call
   the client at once (1: how the remote tier's single write-behind thread writes; 4: as its
   fetch pool reads). GB/s is value bytes over the pass's wall time; *x device* is that over
   the device's sequential figure of the same direction in this run. Before each read pass the
   directory's pages are dropped (``POSIX_FADV_DONTNEED`` on every file), so a read that did not
   use O_DIRECT still reaches the device. ``--digest`` runs every row twice in each round: with
   the file format's per-slice check (CRC-32, version 2) and with the one before it (SHA-256,
   version 1; :class:`hybridkv.disk.fileformat.SliceCheck`), one just after the other, which
   one first alternating from round to round; and prints each check's rate alone on one
   thread: the side by side of the two formats in one run.
3. **Rebuild**: ``--rebuild N`` chunks (tiny values: one 4 KiB file each) are written with fsync
   NEVER, the client is closed, and a new OWNER is built on the directory, timed: the start-up
   scan that rebuilds the index (DK-5). ``--cold`` then drops the kernel's dentry and inode
   caches (``/proc/sys/vm/drop_caches``, root only), as after a reboot, and times another
   start-up. The index must hold exactly the N chunks.

Usage: ``python tools/bench_disk.py [--quick] [--dir PATH] [--bytes N] [--threads N]
[--rebuild N] [--cold] [--digest]``. The figure for a million chunks is one run of
``--rebuild 1000000`` (about 4 GiB of files; see docs/benchmarks/disk.md). Exit 1 when a read
returns other bytes than were written or the rebuilt index is not the written set.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hybridkv, not another install's

MB = 1 << 20
ALIGN = 4096


@dataclass(frozen=True, slots=True)
class Sequential:
    """The device's sequential figures: bytes per second written and read, and how."""

    write: float
    read: float
    direct: bool
    nbytes: int


@dataclass(frozen=True, slots=True)
class TierPass:
    """One row of the tier's table."""

    label: str
    check: str
    value_bytes: int
    chunks: int
    callers: int
    write: float
    read: float
    wrong: int
    counters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Rebuild:
    """A start-up on ``chunks`` files: seconds with warm caches, and cold (caches dropped)."""

    chunks: int
    warm_seconds: float
    cold_seconds: float | None
    populate_seconds: float
    indexed: int
    counters: dict[str, Any]


# ------------------------------------------------------------------ the device


@contextlib.contextmanager
def aligned(size: int) -> Iterator[mmap.mmap]:
    """An anonymous mapping: page aligned, as O_DIRECT needs."""
    buffer = mmap.mmap(-1, size)
    try:
        yield buffer
    finally:
        buffer.close()


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """``path`` opened with O_DIRECT where the filesystem takes it, else buffered."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def drop_pages(path: Path) -> None:
    """Ask the kernel to forget ``path``'s cached pages (a later read goes to the device)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(directory: Path, nbytes: int, block: int) -> Sequential:
    """Write then read one file of ``nbytes`` in ``block`` pieces (module docstring, 1)."""
    path = directory / "sequential.bin"
    pieces = max(1, nbytes // block)
    with aligned(block) as buffer:
        buffer.write(os.urandom(block))
        fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            start = time.perf_counter()
            for i in range(pieces):
                os.pwrite(fd, buffer, i * block)
            os.fdatasync(fd)
            wrote = time.perf_counter() - start
        finally:
            os.close(fd)
        if not direct:
            drop_pages(path)
        fd, direct_read = _open_direct(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            for i in range(pieces):
                got = os.preadv(fd, [buffer], i * block)
                if got != block:
                    raise OSError(f"{path}: read {got} of {block} bytes at piece {i}")
            read = time.perf_counter() - start
        finally:
            os.close(fd)
    path.unlink()
    total = pieces * block
    return Sequential(total / wrote, total / read, direct and direct_read, total)


# ------------------------------------------------------------------ the tier


def _client(directory: Path, capacity: int, threads: int, fsync: str, check: str = "CRC32") -> Any:
    from hybridkv.disk import DiskClient, DiskConfig, FsyncPolicy
    from hybridkv.disk.fileformat import SliceCheck

    config = DiskConfig(
        directory=directory,
        capacity_bytes=capacity,
        threads=threads,
        fsync=FsyncPolicy(fsync),
        rescan_s=0,
    )
    return DiskClient(config, slice_check=SliceCheck[check])


def _value(base: bytes, i: int) -> bytes:
    """A distinct value per key: ``base`` with its first 8 bytes replaced by ``i``."""
    return i.to_bytes(8, "little") + base[8:]


def _key(i: int) -> bytes:
    """A chunk key as the tier's are (:func:`hybridkv.remote.codec.chunk_key`: 32 bytes of
    SHA-256), so the files spread over the 256 subdirectories as real chunks do."""
    return hashlib.sha256(b"bench-disk-" + i.to_bytes(8, "big")).digest()


def _in_parallel(callers: int, n: int, work: Callable[[int], int]) -> tuple[float, int]:
    """``work(i)`` for i in 0..n-1 on ``callers`` threads; wall seconds and the sum returned."""
    lock = threading.Lock()
    state = {"next": 0, "sum": 0}
    errors: list[BaseException] = []

    def loop() -> None:
        total = 0
        try:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] = i + 1
                if i >= n:
                    break
                total += work(i)
        except BaseException as error:  # re-raised on the caller's thread
            errors.append(error)
        with lock:
            state["sum"] += total

    threads = [threading.Thread(target=loop) for _ in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, state["sum"]


def tier_pass(
    directory: Path,
    value_bytes: int,
    nbytes: int,
    *,
    callers: int,
    threads: int,
    fsync: str,
    check: str = "CRC32",
) -> TierPass:
    """``set`` then ``get`` of about ``nbytes`` in values of ``value_bytes`` (module doc, 2)."""
    from hybridkv.remote import ClientFault

    chunks = max(1, nbytes // value_bytes)
    base = os.urandom(value_bytes)
    where = Path(tempfile.mkdtemp(prefix=f"tier-{value_bytes}-", dir=directory))
    client = _client(where, 2 * chunks * (value_bytes + 2 * ALIGN), threads, fsync, check)
    try:

        def put(i: int) -> int:
            fault = client.set(_key(i), _value(base, i), 0)
            if fault is not None:
                raise RuntimeError(f"set of chunk {i}: {fault}")
            return 0

        def take(i: int) -> int:
            got = client.get(_key(i))
            if isinstance(got, ClientFault) or got is None:
                raise RuntimeError(f"get of chunk {i}: {got}")
            return int(bytes(got) != _value(base, i))

        wrote, _ = _in_parallel(callers, chunks, put)
        for path in where.rglob("*"):
            if path.is_file():
                drop_pages(path)
        read, wrong = _in_parallel(callers, chunks, take)
        counters = dict(client.snapshot()["counters"])
    finally:
        client.close()
        shutil.rmtree(where, ignore_errors=True)
    total = chunks * value_bytes
    label = f"{_size(value_bytes)}, {callers} caller{'s' if callers > 1 else ''}, fsync {fsync}"
    return TierPass(
        label, check, value_bytes, chunks, callers, total / wrote, total / read, wrong, counters
    )


def rebuild(directory: Path, chunks: int, threads: int, cold: bool) -> Rebuild:
    """Write ``chunks`` tiny chunks, close, time a new OWNER's start-up (module docstring, 3):
    once with the caches the writes left, then (``cold``) again after dropping them."""
    # Left for the caller's cleanup of ``directory``: removing a million files takes longer
    # than the rebuild, and the figure is printed first.
    where = Path(tempfile.mkdtemp(prefix="rebuild-", dir=directory))
    from hybridkv.disk import padded_size

    capacity = 2 * chunks * padded_size(32, 16)  # room to spare: nothing is evicted
    client = _client(where, capacity, threads, "never")
    try:
        populate, _ = _in_parallel(
            threads, chunks, lambda i: 0 if client.set(_key(i), b"x" * 16, 0) is None else 1
        )
    finally:
        client.close()
    warm, snapshot = _start(where, capacity, threads)
    cold_seconds = None
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes
        cold_seconds, snapshot = _start(where, capacity, threads)
    indexed = len(snapshot["index"])
    return Rebuild(chunks, warm, cold_seconds, populate, indexed, dict(snapshot["counters"]))


def _start(where: Path, capacity: int, threads: int) -> tuple[float, dict[str, Any]]:
    """Seconds to build an OWNER on ``where`` (its rebuild), and its snapshot."""
    start = time.perf_counter()
    fresh = _client(where, capacity, threads, "never")
    seconds = time.perf_counter() - start
    try:
        return seconds, fresh.snapshot()
    finally:
        fresh.close()


def digest_rate(value_bytes: int, check: str = "CRC32", seconds: float = 0.5) -> float:
    """Bytes per second of a slice check on one thread, over a value of ``value_bytes`` checked
    slice by slice as the file format does (the tier's CPU floor per thread)."""
    from hybridkv.disk.fileformat import SLICE, SliceCheck

    of = SliceCheck[check].of
    value, done = memoryview(os.urandom(value_bytes)), 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for a in range(0, value_bytes, SLICE):
            of(value[a : a + SLICE])
        done += value_bytes
    return done / (time.perf_counter() - start)


def _nonzero(p: TierPass) -> dict[str, Any]:
    return {k: v for k, v in p.counters.items() if v}


# ------------------------------------------------------------------ printing and the command


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // 1024} KB"


_CHECKS = {"CRC32": "CRC-32 (v2)", "SHA256": "SHA-256 (v1)"}


def _gbs(x: float) -> str:
    return f"{x / 1e9:6.2f}"


def table(device: Sequential, passes: Sequence[TierPass]) -> list[str]:
    lines = [
        f"device, sequential ({'O_DIRECT' if device.direct else 'buffered + fdatasync'}, "
        f"{device.nbytes // MB} MiB): write {_gbs(device.write)} GB/s, read "
        f"{_gbs(device.read)} GB/s",
        "",
        "| values | slice check | chunks | write GB/s | x device | read GB/s | x device "
        "| wrong reads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in passes:
        lines.append(
            f"| {p.label} | {_CHECKS[p.check]} | {p.chunks} | {_gbs(p.write)} | "
            f"{p.write / device.write:.2f} | "
            f"{_gbs(p.read)} | {p.read / device.read:.2f} | {p.wrong} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB passes, 2,000 rebuilt")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--bytes", type=int, default=None, help="bytes per pass (default 512 MiB)")
    parser.add_argument("--block", type=int, default=4 * MB, help="the sequential piece")
    parser.add_argument("--threads", type=int, default=4, help="the tier's I/O pool")
    parser.add_argument("--rebuild", type=int, default=None, help="chunks (default 20,000)")
    parser.add_argument("--cold", action="store_true", help="drop dentries and inodes first")
    parser.add_argument("--repeats", type=int, default=None, help="passes; medians (default 3)")
    parser.add_argument(
        "--digest", action="store_true", help="each row also with SHA-256 slices (format v1)"
    )
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # lines as measured
    quick = args.quick
    nbytes = args.bytes or (32 * MB if quick else 512 * MB)
    repeats = args.repeats or (1 if quick else 3)
    chunks = args.rebuild if args.rebuild is not None else (2_000 if quick else 20_000)
    if args.block % ALIGN or args.block <= 0:
        parser.error(f"--block {args.block}: a positive multiple of {ALIGN}")
    if args.cold and os.geteuid() != 0:
        parser.error("--cold writes /proc/sys/vm/drop_caches: run as root")
    work = Path(tempfile.mkdtemp(prefix="hybridkv-bench-disk-", dir=args.dir))
    try:
        return _run(work, nbytes, args, repeats, chunks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(work: Path, nbytes: int, args: argparse.Namespace, repeats: int, chunks: int) -> int:
    print(f"directory {work} ({_filesystem(work)}); {repeats} repeat(s), medians")
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    shapes = [(2 * MB, 1, "file"), (2 * MB, 4, "file"), (32 * 1024, 1, "file")]
    shapes += [(32 * 1024, 4, "file"), (32 * 1024, 4, "never"), (2 * MB, 4, "never")]
    checks = ("CRC32", "SHA256") if args.digest else ("CRC32",)
    rows = [(*shape, check) for shape in shapes for check in checks]
    devices: list[Sequential] = []
    passes: list[list[TierPass]] = [[] for _ in rows]
    for round_ in range(repeats):  # in rounds: the device and the tier meet the same load
        devices.append(sequential(work, nbytes, args.block))
        # Each row's checks side by side, the first of them alternating from round to round,
        # so neither check always runs just after the device's pass or the other's files.
        flip = len(checks) if round_ % 2 else 1
        for i in range(len(rows)):
            at = i - i % flip + (flip - 1 - i % flip)
            value, callers, fsync, check = rows[at]
            share = nbytes if value >= MB else nbytes // 8
            passes[at].append(
                tier_pass(
                    work,
                    value,
                    share,
                    callers=callers,
                    threads=args.threads,
                    fsync=fsync,
                    check=check,
                )
            )
    device = Sequential(
        statistics.median(d.write for d in devices),
        statistics.median(d.read for d in devices),
        all(d.direct for d in devices),
        devices[0].nbytes,
    )
    merged = []
    for i in range(len(rows)):
        same = passes[i]
        merged.append(
            TierPass(
                same[0].label,
                same[0].check,
                same[0].value_bytes,
                same[0].chunks,
                same[0].callers,
                statistics.median(p.write for p in same),
                statistics.median(p.read for p in same),
                sum(p.wrong for p in same),
                same[-1].counters,
            )
        )
    print("\n".join(table(device, merged)))
    busy = merged[len(checks)]  # 2 MB, 4 callers, fsync file, the format's check
    print(f"tier counters (2 MB, 4 callers, fsync file; last repeat): {_nonzero(busy)}")
    for check in checks:
        rate = digest_rate(2 * MB, check)
        print(f"{_CHECKS[check]} slices alone, one thread, 2 MB values: {_gbs(rate)} GB/s")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    found = rebuild(work, chunks, args.threads, args.cold) if chunks else None
    bad = sum(p.wrong for p in merged)
    if found is not None:
        cold = (
            f", cold (dentries and inodes dropped) {found.cold_seconds:.2f} s"
            if found.cold_seconds is not None
            else ""
        )
        rebuilt = {k: v for k, v in found.counters.items() if k.startswith("rebuild")}
        print(
            f"rebuild: {found.chunks} chunks indexed {found.indexed}; start-up with warm caches "
            f"{found.warm_seconds:.2f} s ({found.chunks / found.warm_seconds:,.0f} chunks/s)"
            f"{cold}; writing them took {found.populate_seconds:.1f} s; counters of the last "
            f"start-up {rebuilt}"
        )
        bad += found.indexed != found.chunks
    return 1 if bad else 0


def _filesystem(path: Path) -> str:
    """The mount's type and device for ``path`` (longest mount point that contains it)."""
    best = ("?", "?", "")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, point, kind = line.split()[:3]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best[2]):
                best = (kind, device, point)
    return f"{best[0]} on {best[1]}"


if __name__ == "__main__":
    sys.exit(main())
