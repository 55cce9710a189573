"""The disk tier's client agrees with the reference model on every trace hypothesis draws.

Each trace opens :class:`hybridkv.disk.DiskClient` (OWNER; LRU, and again ARC) on a fresh
temporary directory and the model (:class:`spec.disk.tier.DiskTier` over a
:class:`spec.disk.directory.Directory` with the library's file layout) with the same capacity,
then applies the same steps to both: ``set``, ``get``, ``exists``, ``rescan``, a restart (the
client closed and opened again on the directory: the rebuild), and what others do to the
directory: another engine writes a file (a second client on the same directory), removes one,
leaves a torn temp (a dead writer's), or an outside hand corrupts, truncates or replaces a file
with another key's. After every step the two must agree on the answer, on the snapshot's
``index`` (eviction order), ``bytes``, ``reserved`` and ``pins``, on the policy's whole state
(ARC's four lists and its target: the library's snapshot exports none of it, so the test reads
its index's policy), on the counters both keep (:data:`COUNTERS`), and on the directory (its
final files and their sizes, its temps). The DK-* predicates run on the library's side: DK-2
and DK-3 on its snapshot (with ``capacity`` and the sizes the model's equal index recorded:
the library exports none), DK-4 and DK-5 on the real directory's listing after a restart, and
DK-1, DK-6 and DK-7 on every ``get`` it answers.

Time: the filesystem stamps mtimes from a coarse clock (a few ms), so files written in one tick
would tie, and a rebuild or a rescan orders by mtime. After each step the test checks that the
real mtimes never order two files against the model's logical clock, then sets each file's
mtime from that clock, so both sides see the same order.

Differences written down: the library pins every key a ``get`` reads and the model only
indexed keys (visible only while a read is in flight: never between the steps of this
sequential test).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from hybridkv.disk import ALIGN, DirectIO, DiskClient, DiskConfig, FsyncPolicy, padded_size
from hybridkv.disk.fileformat import HEADER
from hybridkv.disk.index import DiskIndex
from hybridkv.disk.names import HOST
from hybridkv.remote.values import ClientFault
from spec.disk import directory as model_dir
from spec.disk.directory import Crash, Damage, Directory, FileLayout, verify
from spec.disk.tier import DiskRefusal, DiskTier, ReadHandle
from spec.invariants import check_all

LAYOUT = FileLayout(alignment=ALIGN, header_bytes=HEADER, value_aligned=True)
KEYS = tuple(hashlib.sha256(f"chunk {i}".encode()).digest() for i in range(5))
# Values of 1, 2, 3, 1 and 8 blocks (files of 2, 3, 4, 2 and 9 blocks, against a capacity of
# 7): evictions free unequal room, and the last file never fits (refused, not adopted, removed
# by a rebuild).
VALUES = {
    key: hashlib.sha256(key).digest() * (n * ALIGN // 32)
    for key, n in zip(KEYS, (1, 2, 3, 1, 8), strict=True)
}
TRUTH = {key.hex(): value.hex() for key, value in VALUES.items()}

COUNTERS = {
    "written": ("written",),
    "write_faults": ("set_faults",),
    "present": ("set_present",),
    "adopted_on_set": ("set_adopted",),
    "refused": ("set_no_space", "set_too_large"),
    "evicted": ("evictions",),
    "hits": ("hits",),
    "damaged": ("damaged",),
    "misses": ("misses",),
    "vanished": ("vanished",),
    "adopted": ("adopted",),
    "adopt_refused": ("adopt_refused",),
    "rebuilt": ("rebuild_files",),
    "torn": ("rebuild_torn", "temps_removed"),
    "truncated": ("rebuild_truncated", "rescan_truncated"),
    "over_capacity": ("rebuild_over_capacity",),
}
"""Model counter -> the library counters that sum to it."""


def _dead_pid() -> int:
    """The pid of a process that has ended (a torn temp's writer)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


DEAD_PID = _dead_pid()


def _path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[:2] / name


def test_the_models_layout_is_the_librarys() -> None:
    for length in (0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 5 * ALIGN):
        assert LAYOUT.footprint(KEYS[0], b"v" * length) == padded_size(32, length)


class DiskAgreement(RuleBasedStateMachine):
    """One client and the model, stepped together on a real directory."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="hkv-disk-agree-"))
        self.capacity = 7 * ALIGN  # room for two or three files of the four
        self.lib = self._client()
        self.model_dir = Directory()
        self.model = self._model()
        # Another engine: a client with room for every file, which never rescans.
        self.peer = DiskClient(self._config(64 * ALIGN))
        self.base_ns = 1_600_000_000 * 10**9  # the logical clock's epoch (mtimes in the past)
        self.seen: set[str] = set()  # the model's counters that moved (hypothesis events)
        self.target: Any = (0, 1)  # ARC's target at the last step (events: it rose or fell)

    # --- set-up ---

    def _config(self, capacity: int) -> DiskConfig:
        return DiskConfig(
            self.root,
            capacity,
            threads=1,
            fsync=FsyncPolicy.NEVER,
            direct=DirectIO.OFF,
            rescan_s=0,
            policy=self.policy,
        )

    def _client(self) -> DiskClient:
        return DiskClient(self._config(self.capacity))

    def _model(self) -> DiskTier:
        return DiskTier(self.model_dir, self.capacity, policy=self.policy, layout=LAYOUT)

    def teardown(self) -> None:
        for name in sorted(self.seen):
            event(f"reached: {name}")
        self.lib.close()
        self.peer.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the owner's calls ---

    @rule(key=st.sampled_from(KEYS))
    def set(self, key: bytes) -> None:
        got = self.lib.set(key, VALUES[key], 0)
        started = self.model.write_begin(key, VALUES[key])
        if isinstance(started, DiskRefusal):
            expected = None if started in (DiskRefusal.PRESENT, DiskRefusal.IN_FLIGHT) else "fault"
        else:
            expected = None if self.model.write_finish(key, True) else "fault"
        assert ("fault" if isinstance(got, ClientFault) else None) == expected

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        path = _path(self.root, key)
        before = _inode(path)
        damaged = self.lib.snapshot()["counters"]["damaged"]
        opened = self._model_verdict(key)
        got = self.lib.get(key)
        handle = self.model.read_begin(key)
        expected = self.model.read_end(handle) if isinstance(handle, ReadHandle) else handle
        assert got == expected
        word = "miss" if got is None else "fault" if isinstance(got, ClientFault) else got.hex()
        linked = before is not None and _inode(path) == before
        grew = self.lib.snapshot()["counters"]["damaged"] - damaged
        obs = {"reads": ((key.hex(), opened, word, linked),), "truth": TRUTH, "damaged": grew}
        assert check_all("disk_content", obs) == {}

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def exists(self, keys: list[bytes]) -> None:
        assert self.lib.exists(keys) == self.model.exists(keys)

    @rule()
    def rescan(self) -> None:
        self.lib.rescan()
        self.model.rescan()

    @rule()
    def restart(self) -> None:
        self.lib.close()
        self.lib = self._client()
        self.model = self._model()
        self._restarted = True

    # --- what others do ---

    @rule(key=st.sampled_from(KEYS))
    def peer_writes(self, key: bytes) -> None:
        if key in self.model_dir.files:
            return  # the peer's client would find it there and write nothing
        assert self.peer.set(key, VALUES[key], 0) is None
        size = LAYOUT.footprint(key, VALUES[key])
        self.model_dir.rename(
            self.model_dir.create_temp(key, "peer", size), VALUES[key], durable=True
        )

    @rule(key=st.sampled_from(KEYS))
    def peer_removes(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(self.root, key))
        self.model_dir.unlink(key)

    @rule(key=st.sampled_from(KEYS))
    def writer_dies(self, key: bytes) -> None:
        """A writer on this host died mid-write: its temp stays, torn."""
        name = key.hex()
        (self.root / name[:2]).mkdir(exist_ok=True)
        temp = self.root / name[:2] / f".{name}.tmp.{HOST}.{DEAD_PID}.{os.urandom(4).hex()}"
        temp.write_bytes(b"\0" * ALIGN)
        self.model_dir.create_temp(key, "dead", ALIGN)
        self.model_dir.crash(Crash.KILL, "dead")

    @rule(key=st.sampled_from(KEYS), how=st.sampled_from(Damage))
    def damage(self, key: bytes, how: Damage) -> None:
        file = self.model_dir.files.get(key)
        if file is None or verify(file, key) is not model_dir.Verdict.WHOLE:
            return
        other = KEYS[(KEYS.index(key) + 1) % len(KEYS)]  # FOREIGN's donor
        path = _path(self.root, key)
        mtime = path.stat().st_mtime_ns
        if how is Damage.CORRUPT:
            with path.open("r+b") as f:
                f.seek(ALIGN)
                first = f.read(1)
                f.seek(ALIGN)
                f.write(bytes([first[0] ^ 0xFF]))
        elif how is Damage.TRUNCATE:
            os.truncate(path, file.size // 2)
        else:
            donor = self.root / "donor"
            _write_file_of(donor, other)
            os.replace(donor / other.hex()[:2] / other.hex(), path)
            shutil.rmtree(donor)
        os.utime(path, ns=(mtime, mtime))
        size = LAYOUT.footprint(other, VALUES[other])
        self.model_dir.damage(key, how, (other, VALUES[other], size))

    # --- agreement ---

    @invariant()
    def agree(self) -> None:
        snap = self.lib.snapshot()
        model = self.model.snapshot()
        for name in ("index", "bytes", "reserved", "pins"):
            assert snap[name] == model[name], name
        # The policy's state decides later victims (ARC's ghosts and target); the contract's
        # snapshot leaves it out, so it is read from the library's index directly.
        policy = self.model._policy.extra()
        assert self.lib._index.policy.extra() == policy, "policy"
        if "target" in policy:
            n, d = policy["target"]
            was_n, was_d = self.target
            if n * was_d != was_n * d:
                self.seen.add("arc target " + ("rose" if n * was_d > was_n * d else "fell"))
            if policy["t2"]:
                self.seen.add("arc t2")
            self.target = policy["target"]
        for name, parts in COUNTERS.items():
            assert sum(snap["counters"][p] for p in parts) == model["counters"][name], name
            if model["counters"][name]:
                self.seen.add(name)
        files, temps = self._listing()
        listing = self.model_dir.listing()
        assert files == {key: size for key, size, _ in listing["files"]}
        assert temps == sorted(key for key, _, _ in listing["temps"])
        self._check_predicates(snap, files, temps)
        self._sync_mtimes()

    def _check_predicates(
        self, snap: dict[str, Any], files: dict[str, int], temps: list[str]
    ) -> None:
        # The sizes the index recorded (the library exports none): the model's, whose index
        # was just found equal. A file's size now may differ (cut short, or removed).
        sizes = self.model.snapshot()["sizes"]
        full = dict(snap, capacity=self.capacity, sizes=sizes, writes=())
        full["counters"] = {"reads": 0, "reads_done": 0}  # no read in flight between steps
        assert check_all("disk", full) == {}
        view = {
            "disk": full,
            # Between steps no write is in flight: every file is renamed, every temp torn.
            "files": tuple((k, size, "whole") for k, size in sorted(files.items())),
            "temps": tuple((key, "dead", False) for key in temps),
            "restarted": getattr(self, "_restarted", False),
            "peer_writes": (),
        }
        self._restarted = False
        if view["restarted"]:
            assert check_all("disk_dir", view) == {}

    def _listing(self) -> tuple[dict[str, int], list[str]]:
        files: dict[str, int] = {}
        temps: list[str] = []
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for entry in sub.iterdir():
                if entry.name.startswith("."):
                    temps.append(entry.name.split(".")[1])
                else:
                    files[entry.name] = entry.stat().st_size
        return files, sorted(temps)

    def _sync_mtimes(self) -> None:
        """Check the real mtimes never order two files against the model's clock, then set
        them from it (module docstring)."""
        model_files = self.model_dir.files
        real = {key: _path(self.root, key).stat().st_mtime_ns for key in model_files}
        for a, real_a in real.items():
            for b, real_b in real.items():
                if model_files[a].mtime < model_files[b].mtime:
                    assert real_a <= real_b, "the library's mtimes disagree with the model's"
        for key, file in model_files.items():
            stamp = self.base_ns + file.mtime * 10**6
            os.utime(_path(self.root, key), ns=(stamp, stamp))

    def _model_verdict(self, key: bytes) -> str:
        file = self.model_dir.files.get(key)
        return "absent" if file is None else verify(file, key).value


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _write_file_of(root: Path, key: bytes) -> None:
    """A whole file of ``key`` in a scratch directory, written by a client of its own."""
    client = DiskClient(DiskConfig(root, 64 * ALIGN, threads=1, direct=DirectIO.OFF, rescan_s=0))
    try:
        assert client.set(key, VALUES[key], 0) is None
    finally:
        client.close()


DiskAgreement.TestCase.settings = settings(
    settings(), max_examples=settings().max_examples, stateful_step_count=50
)
TestDiskAgreement = DiskAgreement.TestCase


class DiskAgreementARC(DiskAgreement):
    """The same machine with ARC: ghost hits on writes, stores and reads refreshing apart."""

    policy = "arc"


DiskAgreementARC.TestCase.settings = DiskAgreement.TestCase.settings
TestDiskAgreementARC = DiskAgreementARC.TestCase


def test_the_comparison_catches_a_library_that_drifts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard: a library whose hits never refresh recency (the index keeps the write
    order) disagrees with the model on the snapshot's eviction order, and the machine says so."""
    monkeypatch.setattr(DiskIndex, "touch", lambda self, key: None)
    quick = settings(settings(), max_examples=100, phases=[Phase.generate], print_blob=False)
    with pytest.raises(AssertionError, match="index"):
        run_state_machine_as_test(DiskAgreement, settings=quick)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(("missed", lambda self, key: None), id="ghost-hits-ignored"),
        pytest.param(("restored", DiskIndex.touch), id="present-set-as-read"),
    ],
)
def test_the_arc_comparison_catches_each_fault_it_was_added_for(
    monkeypatch: pytest.MonkeyPatch, fault: tuple[str, Any]
) -> None:
    """The ARC machine's guards, the index's two former faults put back: a write of a ghost
    key that never moves ARC's target, and a ``set`` of a present key refreshed as a read (to
    T2). Each makes the library disagree with the model, and the machine says so."""
    name, broken = fault
    monkeypatch.setattr(DiskIndex, name, broken)
    quick = settings(settings(), max_examples=200, phases=[Phase.generate], print_blob=False)
    with pytest.raises(AssertionError, match=r"index|policy"):
        run_state_machine_as_test(DiskAgreementARC, settings=quick)
