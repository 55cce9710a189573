"""The disk tier's model (spec.disk): the file layout and the reader's check, the directory
under crashes and outside hands, the OWNER's operations with each outcome, the rebuild, the
DK-* predicates on hand-made defects, and the exhaustive exploration, counted."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spec.disk.directory import (
    Crash,
    Damage,
    Directory,
    FileLayout,
    FsyncPolicy,
    Verdict,
    verify,
)
from spec.disk.model import DiskModel, DiskScenario
from spec.disk.tier import DiskRefusal, DiskTier, ReadHandle, WriteStarted, reader_exists
from spec.errors import ConfigError
from spec.explorer import explore
from spec.invariants import check_all, invariants_for

LAYOUT = FileLayout(alignment=4, header_bytes=0)
A, B, C = b"ka", b"kb", b"kc"
VALUE = {A: b"aa", B: b"b", C: b"cc"}  # each file 4 bytes under LAYOUT


def tier(capacity: int = 8, directory: Directory | None = None, **kw: Any) -> DiskTier:
    return DiskTier(directory or Directory(), capacity, layout=LAYOUT, **kw)


def written(t: DiskTier, *keys: bytes) -> None:
    for key in keys:
        assert isinstance(t.write_begin(key, VALUE[key]), WriteStarted)
        assert t.write_finish(key, True)


def get(t: DiskTier, key: bytes) -> object:
    handle = t.read_begin(key)
    return t.read_end(handle) if isinstance(handle, ReadHandle) else handle


def sound(t: DiskTier) -> None:
    assert check_all("disk", t.snapshot()) == {}


# ----------------------------------------------------------------- layout and the reader


def test_footprint_pads_header_key_and_value_to_the_alignment() -> None:
    layout = FileLayout(alignment=4096, header_bytes=64)
    assert layout.footprint(b"k" * 32, b"v" * 4000) == 4096
    assert layout.footprint(b"k" * 32, b"v" * 4001) == 8192
    assert LAYOUT.footprint(A, b"") == 4


@pytest.mark.parametrize(
    ("field", "kw"), [("alignment", {"alignment": 0}), ("header_bytes", {"header_bytes": -1})]
)
def test_layout_refuses_bad_sizes(field: str, kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError) as info:
        FileLayout(**kw)
    assert info.value.field == field


def test_the_reader_checks_length_key_and_digest() -> None:
    d = Directory()
    d.rename(d.create_temp(A, "self", 4), VALUE[A], durable=True)
    assert verify(d.files[A], A) is Verdict.WHOLE
    assert verify(d.files[A], B) is Verdict.FOREIGN  # the header names another key
    for how, verdict in (
        (Damage.CORRUPT, Verdict.CORRUPT),
        (Damage.TRUNCATE, Verdict.TRUNCATED),
        (Damage.FOREIGN, Verdict.FOREIGN),
    ):
        twin = d.copy()
        twin.damage(A, how, (B, VALUE[B], 4))
        assert verify(twin.files[A], A) is verdict


def test_a_temp_is_never_visible_and_a_rename_publishes_whole() -> None:
    d = Directory()
    number = d.create_temp(A, "self", 4)
    assert reader_exists(d, [A]) == (False,)
    assert d.rename(number, VALUE[A], durable=False)
    assert reader_exists(d, [A]) == (True,)
    assert not d.rename(number, VALUE[A], durable=False)  # the temp is gone: nothing changes


def test_kill_leaves_torn_temps_and_whole_files_power_empties_unsynced_files() -> None:
    d = Directory()
    d.rename(d.create_temp(A, "self", 4), VALUE[A], durable=False)
    d.rename(d.create_temp(B, "self", 4), VALUE[B], durable=True)
    d.create_temp(C, "self", 4)
    d.create_temp(C, "peer", 4)
    killed = d.copy()
    killed.crash(Crash.KILL, "self")
    assert killed.listing()["temps"] == ((C.hex(), "peer", True), (C.hex(), "self", False))
    assert {verify(f, k) for k, f in killed.files.items()} == {Verdict.WHOLE}
    d.crash(Crash.POWER, "self")
    assert verify(d.files[A], A) is Verdict.TRUNCATED  # renamed without fsync
    assert verify(d.files[B], B) is Verdict.WHOLE


# ----------------------------------------------------------------- writes


def test_a_write_reserves_then_lands_as_bytes() -> None:
    t = tier()
    started = t.write_begin(A, VALUE[A])
    assert started == WriteStarted(A, 4, ())
    snap = t.snapshot()
    assert (snap["bytes"], snap["reserved"], snap["index"]) == (0, 4, ())
    assert t.exists([A]) == (False,)  # visible only after the rename (DK-4)
    assert t.write_finish(A, True)
    snap = t.snapshot()
    assert (snap["bytes"], snap["reserved"], snap["index"]) == (4, 0, (A.hex(),))
    assert t.exists([A]) == (True,)
    sound(t)


def test_a_failed_write_removes_its_temp_and_releases_its_reservation() -> None:
    t = tier()
    t.write_begin(A, VALUE[A])
    assert not t.write_finish(A, False)
    snap = t.snapshot()
    assert (snap["bytes"], snap["reserved"], snap["counters"]["write_faults"]) == (0, 0, 1)
    assert t.directory.temps == {}
    with pytest.raises(ConfigError) as info:
        t.write_finish(A, True)
    assert info.value.field == "key"


def test_refusals_change_nothing_but_their_count() -> None:
    t = tier()
    written(t, A)
    before = t.snapshot()
    assert t.write_begin(A, VALUE[A]) is DiskRefusal.PRESENT
    t.write_begin(B, VALUE[B])
    assert t.write_begin(B, VALUE[B]) is DiskRefusal.IN_FLIGHT
    assert t.write_begin(C, b"c" * 9) is DiskRefusal.TOO_LARGE
    handle = t.read_begin(A)
    assert t.write_begin(C, VALUE[C]) is DiskRefusal.NO_SPACE  # A pinned, B in flight
    assert isinstance(handle, ReadHandle)
    t.read_end(handle)
    after = t.snapshot()
    assert after["counters"]["refused"] == 2
    assert after["counters"]["present"] == 1
    assert after["sizes"] == (*before["sizes"],)
    sound(t)


def test_eviction_takes_the_least_recent_unpinned_files_until_the_bytes_fit() -> None:
    t = tier(capacity=12)
    written(t, A, B, C)
    assert get(t, A) == VALUE[A]  # A now most recent: B is the next victim
    started = t.write_begin(b"kd", b"dd")
    assert isinstance(started, WriteStarted)
    assert started.evicted == (B,)
    assert B not in t.directory.files
    assert t.snapshot()["index"] == (C.hex(), A.hex())
    sound(t)


def test_bad_arguments_name_their_field() -> None:
    for kw, field in (
        ({"capacity": 0}, "disk_bytes"),
        ({"policy": "fifo"}, "disk_policy"),
        ({"fsync": "file"}, "disk_fsync"),
    ):
        args: dict[str, Any] = {"capacity": 8, **kw}
        capacity = args.pop("capacity")
        with pytest.raises(ConfigError) as info:
            DiskTier(Directory(), capacity, **args)
        assert info.value.field == field
    with pytest.raises(ConfigError) as info:
        tier().write_begin(b"", b"v")
    assert info.value.field == "key"
    with pytest.raises(ConfigError) as info:
        tier().write_begin(A, "v")  # type: ignore[arg-type]
    assert info.value.field == "value"


# ----------------------------------------------------------------- reads


def test_a_damaged_file_is_a_miss_counted_and_removed() -> None:
    for how in Damage:
        t = tier()
        written(t, A)
        t.directory.damage(A, how, (B, VALUE[B], 4))
        assert get(t, A) is None
        snap = t.snapshot()
        assert (snap["counters"]["damaged"], snap["index"]) == (1, ())
        assert A not in t.directory.files
        sound(t)


def test_a_file_removed_before_the_open_is_a_miss_after_it_reads_whole() -> None:
    t = tier()
    written(t, A, B)
    t.directory.unlink(A)
    assert get(t, A) is None
    assert t.snapshot()["counters"]["vanished"] == 1
    handle = t.read_begin(B)
    t.directory.unlink(B)  # another engine evicts while the read holds it
    assert isinstance(handle, ReadHandle)
    assert t.read_end(handle) == VALUE[B]
    with pytest.raises(ConfigError) as info:
        t.read_end(handle)
    assert info.value.field == "handle"


def test_a_damaged_read_never_removes_a_newer_file_of_the_name() -> None:
    t = tier()
    written(t, A)
    handle = t.read_begin(A)
    t.directory.damage(A, Damage.FOREIGN, (B, VALUE[B], 4))  # a new inode under the name
    assert isinstance(handle, ReadHandle)
    assert t.read_end(handle) == VALUE[A]  # the inode it opened is whole
    assert verify(t.directory.files[A], A) is Verdict.FOREIGN


# ----------------------------------------------------------------- restart and rescan


def test_the_rebuild_indexes_the_final_files_and_removes_dead_writers_temps() -> None:
    t = tier(capacity=12)
    written(t, A, B)
    t.write_begin(C, VALUE[C])
    t.directory.create_temp(C, "peer", 4)
    t.directory.crash(Crash.KILL, "self")
    fresh = tier(capacity=12, directory=t.directory)
    snap = fresh.snapshot()
    assert snap["index"] == (A.hex(), B.hex())  # mtime order, oldest first
    assert (snap["counters"]["rebuilt"], snap["counters"]["torn"]) == (2, 1)
    assert fresh.directory.listing()["temps"] == ((C.hex(), "peer", True),)


def test_the_rebuild_evicts_the_oldest_files_down_to_a_smaller_capacity() -> None:
    t = tier(capacity=12)
    written(t, A, B, C)
    fresh = tier(capacity=8, directory=t.directory)
    assert fresh.snapshot()["index"] == (B.hex(), C.hex())
    assert A not in fresh.directory.files


def test_rescan_adopts_what_fits_and_forgets_what_is_gone() -> None:
    t = tier(capacity=8)
    written(t, A)
    d = t.directory
    d.rename(d.create_temp(B, "peer", 4), VALUE[B], durable=True)
    d.rename(d.create_temp(C, "peer", 4), VALUE[C], durable=True)
    d.unlink(A)
    assert t.rescan() == (B, C)
    snap = t.snapshot()
    assert snap["index"] == (B.hex(), C.hex())
    assert (snap["counters"]["vanished"], snap["counters"]["adopted"]) == (1, 2)
    sound(t)


# ----------------------------------------------------------------- the predicates


def test_each_subject_lists_its_ids() -> None:
    assert [i.id for i in invariants_for("disk")] == ["DK-2", "DK-3"]
    assert [i.id for i in invariants_for("disk_dir")] == ["DK-4", "DK-5"]
    assert [i.id for i in invariants_for("disk_content")] == ["DK-1", "DK-6", "DK-7"]


def test_the_snapshot_predicates_recount() -> None:
    t = tier()
    written(t, A)
    snap = t.snapshot()
    assert "DK-2" in check_all("disk", dict(snap, bytes=3))
    assert "DK-2" in check_all("disk", dict(snap, capacity=3))
    assert "DK-3" in check_all("disk", dict(snap, pins=((B.hex(), 1),)))
    assert "DK-3" in check_all("disk", dict(snap, pins=((A.hex(), 0),)))


def test_the_content_predicates_read_each_resolved_read() -> None:
    truth = {A.hex(): VALUE[A].hex()}
    ok = {"reads": ((A.hex(), "whole", VALUE[A].hex(), True),), "truth": truth, "damaged": 0}
    assert check_all("disk_content", ok) == {}
    wrong = dict(ok, reads=((A.hex(), "whole", "00", True),))
    assert "DK-1" in check_all("disk_content", wrong)
    uncounted = dict(ok, reads=((A.hex(), "corrupt", "miss", False),))
    assert "DK-6" in check_all("disk_content", uncounted)
    fault = dict(ok, reads=((A.hex(), "absent", "fault", False),))
    assert "DK-7" in check_all("disk_content", fault)


# ----------------------------------------------------------------- the exploration


EXHAUSTIVE = [
    # Three keys, room for two; damage and kill -9; no other engine.
    (DiskScenario(peer=False), 5403, 30720, 18),
    # Two keys, room for one; another engine; no fsync, kill -9 or power loss; no damage.
    (
        DiskScenario(
            lengths=(2, 1),
            capacity=4,
            fsync=FsyncPolicy.NEVER,
            crashes=(Crash.KILL, Crash.POWER),
            damage=False,
        ),
        1624,
        14488,
        14,
    ),
]


@pytest.mark.parametrize(("scenario", "states", "transitions", "depth"), EXHAUSTIVE)
def test_every_reachable_state_is_explored_and_sound(
    scenario: DiskScenario, states: int, transitions: int, depth: int
) -> None:
    """No depth bound: the search ends when no new state is reachable, so these are every
    state of the scenario, each checked against every DK-* invariant."""
    result = explore(DiskModel(scenario), 1000, stop_at_first=False)
    assert result.violations == ()
    assert result.exhaustive
    assert (result.states, result.transitions, result.depth_reached) == (states, transitions, depth)


def test_three_keys_explored_to_the_ci_bound() -> None:
    """Three keys, room for two, every hand: bounded (the whole space is far larger)."""
    result = explore(DiskModel(DiskScenario()), 6, stop_at_first=False)
    assert result.violations == ()
    assert result.checked_depth == 6
    assert (result.states, result.transitions) == (5472, 19513)
    for label in (
        "read:corrupt",
        "read:foreign",
        "read:truncated",
        "read:absent",
        "restart:torn",
        "rescan:adopted",
        "write:no_space",
        "write:evicted",
        "write:present",
        "write:failed",
    ):
        assert result.coverage.get(label, 0) > 0, label


def test_arc_explored_to_the_ci_bound() -> None:
    """ARC's ghosts and target multiply the states: two keys, bounded at 7 actions."""
    scenario = DiskScenario(lengths=(2, 1), capacity=4, policy="arc")
    result = explore(DiskModel(scenario), 7, stop_at_first=False)
    assert result.violations == ()
    assert (result.states, result.transitions, result.checked_depth) == (3206, 12468, 7)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") != "nightly",
    reason="about 140,000 states, two minutes: runs under HYPOTHESIS_PROFILE=nightly",
)
def test_two_keys_every_hand_every_state() -> None:
    """Two keys, room for one, another engine, damage, kill -9: every state."""
    result = explore(DiskModel(DiskScenario(lengths=(2, 1), capacity=4)), 1000, stop_at_first=False)
    assert result.violations == ()
    assert result.exhaustive
    assert (result.states, result.transitions, result.depth_reached) == (139720, 1337948, 23)
