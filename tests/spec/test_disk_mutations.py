"""Mutation evidence for DK-*: each test breaks one part of the disk tier's model on purpose,
runs :func:`spec.explorer.explore` over :class:`spec.disk.model.DiskModel` (every DK-*
invariant checked in every state) and asserts the shortest trace that names the id.

tests/test_mutation_evidence.py reads this file beside test_explorer_mutations.py, and
docs/explanation/mutations.md tabulates the same depths and traces.
"""

from __future__ import annotations

import pytest
from disk_harness import CONTROLS, POWER, SHARED, caught

from spec.disk import directory, tier
from spec.disk.directory import Directory, DiskFile, Temp, Verdict
from spec.disk.model import DiskModel
from spec.disk.tier import DiskTier, ReadFault, ReadHandle
from spec.explorer import explore

_create_temp = Directory.create_temp
_read_begin = DiskTier.read_begin
_read_end = DiskTier.read_end
_rebuild = DiskTier._rebuild
K0 = b"k0".hex()


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_correct_model_breaks_nothing(name: str) -> None:
    scenario, depth = CONTROLS[name]
    result = explore(DiskModel(scenario), depth, stop_at_first=False)
    assert result.violations == ()
    assert result.states > 300


@pytest.mark.mutation("DK-1")
def test_dk1_reader_skips_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader trusts the header's lengths and key but never checks the digest: a flipped
    byte of the value is served."""

    def no_digest(file: DiskFile, key: bytes) -> Verdict:
        found = directory.verify(file, key)
        return Verdict.WHOLE if found is Verdict.CORRUPT else found

    monkeypatch.setattr(tier, "verify", no_digest)
    found = caught("DK-1", SHARED, 5)
    assert found.trace == "write k0 | write k0 lands | read k0 | corrupt k0 | read k0 ends"
    assert found.messages == (f"read of {K0} returned bytes from a corrupt file",)
    assert found.ids == ("DK-1", "DK-6")


def _room_without_reservations(self: DiskTier, size: int, incoming: bytes) -> object:
    shortfall = self.held_bytes + size - self.capacity  # writes in flight forgotten
    if shortfall <= 0:
        return ()
    victims = self._ranked(lambda key: key not in self._pins, incoming, shortfall)
    return victims if sum(self._index[k] for k in victims) >= shortfall else None


@pytest.mark.mutation("DK-2")
def test_dk2_room_ignores_writes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room is made for the complete files only: writes in flight reserve nothing, and three
    concurrent writes overrun the limit before any lands."""
    monkeypatch.setattr(DiskTier, "_room", _room_without_reservations)
    found = caught("DK-2", SHARED, 3)
    assert found.trace == "write k0 | write k1 | write k2"
    assert found.messages == ("bytes 0 + reserved 12 > 8",)


def _room_ignoring_pins(self: DiskTier, size: int, incoming: bytes) -> object:
    shortfall = self.held_bytes + self.reserved_bytes + size - self.capacity
    if shortfall <= 0:
        return ()
    victims = self._ranked(lambda key: True, incoming, shortfall)  # pins not looked at
    return victims if sum(self._index[k] for k in victims) >= shortfall else None


@pytest.mark.mutation("DK-3")
def test_dk3_eviction_ignores_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Victims are chosen by policy alone: a file a read holds open is evicted under it."""
    monkeypatch.setattr(DiskTier, "_room", _room_ignoring_pins)
    found = caught("DK-3", SHARED, 5)
    assert found.trace == "write k0 | write k0 lands | read k0 | write k1 | write k2"
    assert found.messages == (f"pinned key {K0} is not indexed",)


def _create_in_place(self: Directory, key: bytes, writer: str, size: int) -> int:
    number = _create_temp(self, key, writer, size)
    when = self.tick()
    # The writer fills the final name itself; the rename later only replaces it.
    self.files[key] = DiskFile(key, b"", b"", False, True, size, when, when, False)
    return number


@pytest.mark.mutation("DK-4")
def test_dk4_writes_under_the_final_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers fill the final name directly (no temp): the key is visible, half written."""
    monkeypatch.setattr(Directory, "create_temp", _create_in_place)
    found = caught("DK-4", SHARED, 1)
    assert found.trace == "write k0"
    assert found.messages == (f"final file {K0} is still being written",)


def _rebuild_removing_every_temp(self: DiskTier) -> None:
    temps = self.directory.temps
    for number in list(temps):  # the writer's liveness never asked
        temps[number] = Temp(temps[number].key, temps[number].writer, False, temps[number].size)
    _rebuild(self)


@pytest.mark.mutation("DK-5")
def test_dk5_rebuild_removes_a_live_writers_temp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild removes every temp it finds, another engine's write in flight too."""
    monkeypatch.setattr(DiskTier, "_rebuild", _rebuild_removing_every_temp)
    found = caught("DK-5", SHARED, 3)
    assert found.trace == "kill | peer writes k0 | restart"
    assert found.messages == (f"another engine's temp of {K0} was removed mid-write",)


def _rebuild_keeping_temps(self: DiskTier) -> None:
    temps = dict(self.directory.temps)
    _rebuild(self)
    self.directory.temps.update(temps)  # torn temps never cleaned


@pytest.mark.mutation("DK-5")
def test_dk5_rebuild_keeps_torn_temps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild leaves the temps of the dead writer behind."""
    monkeypatch.setattr(DiskTier, "_rebuild", _rebuild_keeping_temps)
    found = caught("DK-5", POWER, 3)
    assert found.trace == "write k0 | kill | restart"
    assert found.messages == (f"torn temp of {K0} (self) left",)


@pytest.mark.mutation("DK-6")
def test_dk6_damaged_file_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that finds a damaged file misses but never removes it."""
    unlink = Directory.unlink

    def keep_checked(self: Directory, key: bytes, inode: int | None = None) -> bool:
        return False if inode is not None else unlink(self, key)

    monkeypatch.setattr(Directory, "unlink", keep_checked)
    found = caught("DK-6", SHARED, 5)
    assert found.trace == "write k0 | write k0 lands | read k0 | corrupt k0 | read k0 ends"
    assert found.messages == (f"the corrupt file {K0} a read found is still there",)


def _read_begin_faulting(self: DiskTier, key: bytes) -> ReadHandle | ReadFault | None:
    if key in self._index and key not in self.directory.files:
        return ReadFault.FAULT  # ENOENT passed on as an I/O error
    return _read_begin(self, key)


@pytest.mark.mutation("DK-7")
def test_dk7_removed_file_is_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get whose file another engine removed returns an I/O fault: the remote tier's breaker
    counts it, and another engine's evictions open it."""
    monkeypatch.setattr(DiskTier, "read_begin", _read_begin_faulting)
    found = caught("DK-7", SHARED, 4)
    assert found.trace == "write k0 | write k0 lands | k0 removed | read k0"
    assert found.messages == (f"read of the removed file {K0} returned fault",)


def _read_end_by_name(self: DiskTier, handle: ReadHandle) -> bytes | ReadFault | None:
    if handle.key not in self.directory.files:  # reopened by name, not the inode opened
        if handle.pinned:
            self._unpin(handle.key)
            self._counters["reads_done"] += 1
        return None
    return _read_end(self, handle)


@pytest.mark.mutation("DK-7")
def test_dk7_read_reopens_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read goes back to the name instead of the inode it opened: a file another engine
    evicts while the read holds it is lost, though its bytes were still there."""
    monkeypatch.setattr(DiskTier, "read_end", _read_end_by_name)
    found = caught("DK-7", SHARED, 5)
    assert found.trace == "write k0 | write k0 lands | read k0 | k0 removed | read k0 ends"
    assert found.messages == (f"read of the whole file {K0} it opened returned miss",)
