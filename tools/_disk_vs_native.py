"""A disk tier under the host tier, hybridkv beside vLLM 0.33's native fs tier (issue 31).

Used by ``tools/bench_vs_native.py --disk``. Each layout's chat trace (the bench's own, 4-token
answers) is played on vLLM 0.33's real ``Scheduler`` in-process by fresh engines, every KV read
content-checked, with a host tier at 0.5x the trace's working set (equal bytes, the bench's
rule) and:

- ``native host``/``hybridkv host``: no tier below it (the reference);
- ``native host+fs``: vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` and its
  ``fs`` tier (:mod:`hybridkv.vllm.harness.native_tiering`) in a fresh directory on the real
  filesystem under ``--disk-root``. The tier has no byte limit and never evicts: it is given
  the directory, and a filesystem of 4x the working set would never fill on this trace;
- ``hybridkv host+disk``: ``HybridKVConnector`` with ``disk_dir`` in a fresh directory there and
  ``disk_bytes`` = 4x the working set;
- ``... small dir``: both again on a tmpfs mounted for the run at ``--small`` x the working set
  (default 0.5x, smaller than the working set; hybridkv's ``disk_bytes`` the same): what each
  does when its directory cannot hold the working set. Mounting needs root (or a user
  namespace: run the bench under ``unshare --user --map-root-user --mount``); without it these
  rows are skipped with the reason.

Per row: prefill computed and its ratio to the trace's floor (the bench's
:func:`bench_vs_native.floor_tokens`), tokens the connector loaded, GPU prefix hits, engine steps,
preemptions (a preempted request computes its prompt again); the tier's bytes written and read by
its own counters (native: the fs tier's finished jobs' ``transfer_bytes``, what vLLM's
``kv_offload`` write/read byte metrics count: whole chunk files, a store of a file already there
counted too; hybridkv: its tier's ``remote_written_bytes`` and ``remote_fetched_bytes``, the chunk
values handed to and read from its disk client, each file adding a header and padding to 4 KiB),
failed tier writes, the bytes and files left in the directory at the end (the filesystem's own
count), and the process's block-device bytes (``/proc/self/io`` ``write_bytes``/``read_bytes`` over
the run: what reached the device, page cache hits not counted; every row runs in this one process,
one at a time). The tier's threads make the step at which a lookup or a copy completes vary, so the
rows of one run are printed per row as the repeat whose prefill computed is the median, with the
range over the repeats (``--repeats``, default 3; ``--quick`` 1) beside it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

WORKING_FACTOR_HOST = 0.5
WORKING_FACTOR_DISK = 4.0


class Below(Enum):
    """What sits under the host tier in a row."""

    NOTHING = "nothing"
    DIR = "dir"  # a fresh directory on the real filesystem
    SMALL = "small"  # a tmpfs mounted at a size below the working set


@dataclass(frozen=True, slots=True)
class DiskVariant:
    """One row: ``kind`` none | native | hybridkv, host tier in native chunks, what is below."""

    kind: str
    host_chunks: int = 0
    below: Below = Below.NOTHING
    disk_bytes: int = 0  # hybridkv's disk_bytes; the tmpfs size for SMALL

    def name(self) -> str:
        if self.kind == "none":
            return "no connector"
        tier = {"native": "fs", "hybridkv": "disk"}[self.kind]
        return {
            Below.NOTHING: f"{self.kind} host",
            Below.DIR: f"{self.kind} host+{tier}",
            Below.SMALL: f"{self.kind} host+{tier} small dir",
        }[self.below]


@dataclass(frozen=True, slots=True)
class DiskRow:
    """What one row's run observed."""

    variant: DiskVariant
    report: Any = None
    tier_written: int = 0
    tier_read: int = 0
    tier_write_failures: int = 0
    dir_bytes: int = 0
    dir_files: int = 0
    device_written: int = 0
    device_read: int = 0
    error: str = ""
    notes: str = ""


def device_io() -> tuple[int, int]:
    """This process's block-device bytes so far: (written, read) from ``/proc/self/io``."""
    fields = dict(
        line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if ": " in line
    )
    return int(fields["write_bytes"]), int(fields["read_bytes"])


def directory_usage(root: Path) -> tuple[int, int]:
    """Bytes and number of regular files under ``root`` (temp files included)."""
    total = files = 0
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
                files += 1
    return total, files


def mount_refusal() -> str:
    """Why a tmpfs cannot be mounted here ("" when it can)."""
    if os.geteuid() != 0:
        return (
            "mounting a tmpfs needs root: run the bench under "
            "`unshare --user --map-root-user --mount`"
        )
    if shutil.which("mount") is None:
        return "no mount(8) on this machine"
    return ""


@contextlib.contextmanager
def small_tmpfs(size: int, parent: Path) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes (rounded up to pages) mounted for the duration."""
    point = Path(tempfile.mkdtemp(prefix="small-", dir=parent))
    pages = -(-size // 4096) * 4096
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={pages}", "tmpfs", str(point)],
        check=True,
        capture_output=True,
    )
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            point.rmdir()


def _hybridkv_disk_counts(engine: Any) -> tuple[tuple[int, int, int], str]:
    """hybridkv's disk tier, from its own counters once its queued writes are on disk: value
    bytes written, value bytes promoted, failed writes; and the scheduler side's lookups."""
    remote = engine.worker.worker_remote
    if not remote.flush(60.0):
        raise RuntimeError("hybridkv's disk writes did not finish within 60 s")
    counters = remote.counters()
    asked = engine.scheduler.connector.remote.count
    notes = (
        f"chunks written {counters['remote_written']}; lookups {asked['remote_lookups']}, "
        f"chunks found {asked['remote_chunks_found']}, promoted {asked['promoted']}, "
        f"answers late (after the wait: no hit) {asked['remote_lookups_late']}"
    )
    found = (
        counters["remote_written_bytes"],
        counters["remote_fetched_bytes"],
        counters["remote_writes_failed"],
    )
    return found, notes


def _engine(case: Any, variant: DiskVariant, chunk_bytes: int, directory: Path | None) -> Any:
    """A fresh engine for ``variant`` (its directory already made); the native adapter too."""
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
    from hybridkv.vllm.harness.inprocess import InProcessEngine
    from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU
    from hybridkv.vllm.harness.native_tiering import NativeTieringOnCPU

    if variant.kind == "none":
        return InProcessEngine(case.config_json, case.settings), None
    if variant.kind == "native":
        adapter: Any = (
            NativeOffloadOnCPU(variant.host_chunks, 1)
            if directory is None
            else NativeTieringOnCPU(variant.host_chunks, directory, threads=4, delay=1)
        )
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"eviction_policy": "lru"},
        )
        engine = InProcessEngine(case.config_json, case.settings, transfer, adapter)
        if directory is not None:
            adapter.watch(engine.scheduler.connector)
        return engine, adapter
    extra: dict[str, Any] = {"eviction_policy": "lru"}
    if directory is not None:
        extra |= {"disk_dir": str(directory), "disk_bytes": variant.disk_bytes, "disk_threads": 4}
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    adapter = HybridKVOnCPU(host_bytes=variant.host_chunks * chunk_bytes, delay=1)
    return InProcessEngine(case.config_json, case.settings, transfer, adapter), adapter


def run_row(case: Any, trace: Any, variant: DiskVariant, chunk_bytes: int, root: Path) -> DiskRow:
    """One fresh run of ``variant``; its directory (if any) made for it and removed after."""
    from hybridkv.vllm.harness.chat import run_trace

    with contextlib.ExitStack() as stack:
        directory: Path | None = None
        if variant.below is Below.DIR:
            directory = Path(tempfile.mkdtemp(prefix=f"{variant.kind}-", dir=root))
            stack.callback(shutil.rmtree, directory, True)
        elif variant.below is Below.SMALL:
            directory = stack.enter_context(small_tmpfs(variant.disk_bytes, root))
        engine, adapter = _engine(case, variant, chunk_bytes, directory)
        written0, read0 = device_io()
        tier, notes = (0, 0, 0), ""
        try:
            report = run_trace(engine, trace)
            if directory is not None and variant.kind == "hybridkv":
                tier, notes = _hybridkv_disk_counts(engine)
        finally:
            engine.close()
            if hasattr(adapter, "close"):
                adapter.close()
        written1, read1 = device_io()
        if directory is not None and variant.kind == "native":
            counts = adapter.fs_counts()  # the tier's jobs all finished: the engine drained
            tier = (counts.stored, counts.loaded, counts.store_jobs_failed)
            notes = (
                f"store jobs {counts.store_jobs} ({counts.store_jobs_failed} failed), promotion "
                f"jobs {counts.load_jobs} ({counts.load_jobs_failed} failed)"
            )
        used, files = directory_usage(directory) if directory is not None else (0, 0)
        return DiskRow(
            variant,
            report,
            *tier,
            dir_bytes=used,
            dir_files=files,
            device_written=written1 - written0,
            device_read=read1 - read0,
            notes=notes,
        )
    raise AssertionError("unreachable")  # the with block returns or raises


def variants(working: int, chunk_bytes: int, small: float, mountable: bool) -> list[DiskVariant]:
    """The rows (module docstring); host tiers at 0.5x the working set, disk at 4x."""
    host = max(1, round(WORKING_FACTOR_HOST * working))
    disk = round(WORKING_FACTOR_DISK * working) * chunk_bytes
    rows = [DiskVariant("none")]
    for kind in ("native", "hybridkv"):
        rows.append(DiskVariant(kind, host))
        rows.append(DiskVariant(kind, host, Below.DIR, disk))
    if mountable:
        tight = max(1, round(small * working)) * chunk_bytes
        rows += [DiskVariant(kind, host, Below.SMALL, tight) for kind in ("native", "hybridkv")]
    return rows


HEADER = (
    f"{'variant':<30} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} {'steps':>5} "
    f"{'preempt':>7} "
    f"{'tier wrote':>11} {'tier read':>10} {'wr fail':>7} {'dir bytes':>10} {'files':>5} "
    f"{'dev wrote':>10} {'dev read':>9} {'wrong':>5}"
)


def format_row(row: DiskRow, floor: int) -> str:
    name = row.variant.name()
    r = row.report
    if r is None:
        return f"{name:<30} failed: {row.error}"
    return (
        f"{name:<30} {r.prefill_computed:8d} {r.prefill_computed / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {r.steps:5d} {r.preemptions:7d} "
        f"{row.tier_written:11d} "
        f"{row.tier_read:10d} {row.tier_write_failures:7d} {row.dir_bytes:10d} "
        f"{row.dir_files:5d} {row.device_written:10d} {row.device_read:9d} {r.wrong_reads:5d}"
    )


def median_row(done: list[DiskRow]) -> DiskRow:
    """The repeat whose prefill computed is the median (the lower one of an even count)."""
    if done[-1].report is None:
        return done[-1]
    ordered = sorted(done, key=lambda row: row.report.prefill_computed)
    return ordered[(len(ordered) - 1) // 2]


def computed_range(done: list[DiskRow]) -> str:
    values = [row.report.prefill_computed for row in done if row.report is not None]
    if not values:
        return "-"
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def bench_disk(
    case: Any, root: Path, small: float, repeats: int = 1
) -> tuple[list[str], list[str]]:
    """One layout's rows (the median repeat of each, and the range of prefill computed over
    the repeats): the printed lines and the problems (wrong reads, failed rows)."""
    import bench_vs_native as bench

    from hybridkv.vllm.harness.inprocess import InProcessEngine

    probe = InProcessEngine(case.config_json, case.settings)
    probe.close()
    floor, working, words = bench._figures(case.trace, probe)
    chunk_bytes = bench.native_chunk_bytes(probe)
    refusal = mount_refusal()
    runs: dict[DiskVariant, list[DiskRow]] = {
        v: [] for v in variants(working, chunk_bytes, small, not refusal)
    }
    for _ in range(repeats):  # in rounds: every variant meets the same load
        for variant, done in runs.items():
            if done and done[-1].report is None:
                continue  # failed once: printed as failed
            try:
                done.append(run_row(case, case.trace, variant, chunk_bytes, root))
            except Exception as error:  # a refused config is a row to print, not a crash
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:110]}"
                done.append(DiskRow(variant, error=reason))
    rows = [median_row(done) for done in runs.values()]
    spread = {row.variant: computed_range(runs[row.variant]) for row in rows}
    lines = [
        f"== {case.name}, {words}; GPU pool {case.settings.num_gpu_blocks} blocks; floor "
        f"{floor}; working set {working} native chunks of {chunk_bytes} B = "
        f"{working * chunk_bytes} B; host tiers {WORKING_FACTOR_HOST}x = "
        f"{max(1, round(WORKING_FACTOR_HOST * working))} chunks; hybridkv disk_bytes "
        f"{WORKING_FACTOR_DISK}x = {round(WORKING_FACTOR_DISK * working) * chunk_bytes} B; "
        + (
            f"small dir: a tmpfs of {small}x = {max(1, round(small * working)) * chunk_bytes} B"
            if not refusal
            else f"small dir rows skipped: {refusal}"
        ),
        f"{HEADER} {'computed, all':>11}",
    ]
    lines += [f"{format_row(row, floor)} {spread[row.variant]:>11}" for row in rows]
    lines += [f"  {row.variant.name()}: {row.notes}" for row in rows if row.notes]
    problems = [
        f"{row.variant.name()}: {row.error or f'{row.report.wrong_reads} wrong reads'}"
        for done in runs.values()
        for row in done
        if row.report is None or row.report.wrong_reads or row.report.leaked_blocks
    ]
    return lines, problems
