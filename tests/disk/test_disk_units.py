"""The disk tier's parts alone: settings, the file format, names and torn temporary files, and
the byte-bounded index with its pins."""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.disk import ALIGN, Damage, DirectIO, DiskConfig, DiskIndexError, FsyncPolicy
from hybridkv.disk.fileformat import (
    HEADER,
    SLICE,
    VERSION,
    SliceCheck,
    decode,
    encode_into,
    padded_size,
)
from hybridkv.disk.index import DiskIndex
from hybridkv.disk.io import Buffers
from hybridkv.disk.names import HOST, TempName, chunk_path, is_torn, key_of, parse_temp, temp_path
from hybridkv.errors import HybridKVConfigError

# --- settings ---


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"directory": ""}, "disk_dir"),
        ({"directory": 3}, "disk_dir"),
        ({"capacity_bytes": 0}, "disk_bytes"),
        ({"capacity_bytes": True}, "disk_bytes"),
        ({"capacity_bytes": 1.5}, "disk_bytes"),
        ({"policy": "fifo"}, "disk_policy"),
        ({"threads": 0}, "disk_threads"),
        ({"fsync": "always"}, "disk_fsync"),
        ({"direct": "maybe"}, "disk_direct"),
        ({"stale_temp_s": -1}, "disk_stale_temp_s"),
        ({"stale_temp_s": float("nan")}, "disk_stale_temp_s"),
        ({"rescan_s": "10"}, "disk_rescan_s"),
    ],
)
def test_each_bad_setting_names_its_key(changes: dict[str, Any], field: str) -> None:
    given_ = {"directory": "/tmp/x", "capacity_bytes": 1 << 20, **changes}
    with pytest.raises(HybridKVConfigError) as caught:
        DiskConfig(**given_)
    assert caught.value.field == field


def test_settings_take_enum_values_as_strings() -> None:
    config = DiskConfig(Path("/tmp/x"), 4096, fsync="never", direct="off")  # type: ignore[arg-type]
    assert config.fsync is FsyncPolicy.NEVER
    assert config.direct is DirectIO.OFF
    assert config.path == Path("/tmp/x")
    assert DiskConfig("/tmp/x", 1).fsync is FsyncPolicy.FILE


# --- the file format ---


def _image(key: bytes, value: bytes) -> bytearray:
    buffer = bytearray(b"\xff" * (padded_size(len(key), len(value)) + ALIGN))
    size = encode_into(memoryview(buffer), key, value)
    return buffer[:size]


@given(key=st.binary(min_size=1, max_size=96), value=st.binary(max_size=9000))
def test_a_file_image_decodes_to_its_value(key: bytes, value: bytes) -> None:
    image = _image(key, value)
    assert len(image) == padded_size(len(key), len(value))
    assert len(image) % ALIGN == 0
    assert image[HEADER + len(key) : ALIGN] == bytes(ALIGN - HEADER - len(key))
    assert image[ALIGN + len(value) :] == bytes(len(image) - ALIGN - len(value))
    assert decode(memoryview(image), key) == value


@given(
    key=st.binary(min_size=1, max_size=40),
    value=st.binary(min_size=1, max_size=5000),
    data=st.data(),
)
def test_any_flipped_byte_of_header_key_or_value_is_damage(
    key: bytes, value: bytes, data: st.DataObject
) -> None:
    image = _image(key, value)
    at = data.draw(
        st.one_of(st.integers(0, HEADER + len(key) - 1), st.integers(ALIGN, ALIGN + len(value) - 1))
    )
    image[at] ^= data.draw(st.integers(1, 255))
    assert isinstance(decode(memoryview(image), key), Damage)


@given(value=st.binary(min_size=1, max_size=20000), data=st.data())
def test_any_cut_is_damage(value: bytes, data: st.DataObject) -> None:
    image = _image(b"k" * 32, value)
    cut = data.draw(st.integers(0, len(image) - 1))
    assert isinstance(decode(memoryview(image)[:cut], b"k" * 32), Damage)


def test_each_damage_is_named() -> None:
    key, value = b"a" * 32, b"v" * 5000  # 2 blocks of value
    image = _image(key, value)
    assert decode(memoryview(image)[: len(image) - ALIGN], key) is Damage.TRUNCATED
    assert decode(memoryview(image)[:100], key) is Damage.TRUNCATED
    bad = bytearray(image)
    bad[0:4] = b"XXXX"
    assert decode(memoryview(bad), key) is Damage.MAGIC
    bad = bytearray(image)
    bad[4] = 9
    assert decode(memoryview(bad), key) is Damage.VERSION
    assert decode(memoryview(image), b"b" * 32) is Damage.FOREIGN
    bad = bytearray(image)
    bad[-1] = 1  # the padding is not covered, the lengths are: the value is still whole
    assert decode(memoryview(bad), key) == value
    bad = bytearray(image)
    bad[8] ^= 1  # value length 5000 -> 5001: same padded size, another digest
    assert decode(memoryview(bad), key) is Damage.DIGEST
    bad = bytearray(image)
    bad[9] ^= 0x40  # value length +16 KiB: another padded size
    assert decode(memoryview(bad), key) is Damage.TRUNCATED
    bad = bytearray(image)
    bad[6] = 31  # key length 32 -> 31: another key
    assert decode(memoryview(bad), key) is Damage.FOREIGN
    small = _image(key, b"v")
    longer = small + bytes(ALIGN)
    assert decode(memoryview(longer), key) is Damage.LENGTHS


def test_a_value_of_many_slices_checks_each_slice() -> None:
    key = b"k" * 32
    value = bytes(range(256)) * (3 * SLICE // 256 + 7)  # 4 slices, the last short
    image = _image(key, value)
    assert decode(memoryview(image), key) == value
    for at in (ALIGN, ALIGN + SLICE, ALIGN + 3 * SLICE + 1, ALIGN + len(value) - 1):
        bad = bytearray(image)
        bad[at] ^= 1
        assert decode(memoryview(bad), key) is Damage.DIGEST
    assert decode(memoryview(_image(key, b"")), key) == b""


# --- names ---


def test_the_header_digest_is_sha256_over_lengths_key_and_each_slices_crc32() -> None:
    # Computed here from the layout the module documents, not with the module's helpers.
    key = b"k" * 32
    value = os.urandom(2 * SLICE + 5000)  # 3 slices, the last short
    image = _image(key, value)
    assert struct.unpack_from("<4sHHQ", image, 0) == (b"HKVD", 2, 32, len(value))
    assert VERSION == SliceCheck.CRC32.value == 2
    top = hashlib.sha256(struct.pack("<HQ", 32, len(value)) + key)
    for a in range(0, len(value), SLICE):
        top.update(struct.pack("<I", zlib.crc32(value[a : a + SLICE])))
    assert image[16:48] == top.digest()


def test_a_file_of_the_format_before_is_a_version_miss() -> None:
    # Version 1 (SHA-256 per slice): what a file written before the change looks like.
    key = b"k" * 32
    value = os.urandom(SLICE + 100)
    top = hashlib.sha256(struct.pack("<HQ", 32, len(value)) + key)
    for a in range(0, len(value), SLICE):
        top.update(hashlib.sha256(value[a : a + SLICE]).digest())
    old = bytearray(padded_size(32, len(value)))
    struct.pack_into("<4sHHQ", old, 0, b"HKVD", 1, 32, len(value))
    old[16:48] = top.digest()
    old[HEADER : HEADER + 32] = key
    old[ALIGN : ALIGN + len(value)] = value
    assert decode(memoryview(old), key) is Damage.VERSION


def test_names_round_trip_and_fit_a_file_name(tmp_path: Path) -> None:
    key = bytes(range(96))
    final, temp = chunk_path(tmp_path, key), temp_path(tmp_path, key)
    assert final.parent == temp.parent == tmp_path / key.hex()[:2]
    assert key_of(final.parent.name, final.name) == key
    assert len(temp.name) <= 255
    assert parse_temp(temp.parent.name, temp.name) == TempName(key, HOST, os.getpid())
    assert key_of("ff", final.name) is None  # another subdirectory's name
    assert key_of(final.parent.name, final.name + "0") is None
    assert parse_temp("ab", ".abab.tmp") is None
    assert key_of("RE", "README") is None


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_torn_is_a_dead_writer_here_or_an_old_one_elsewhere() -> None:
    assert is_torn(TempName(b"k", HOST, _dead_pid()), 0.0, 300.0)
    assert not is_torn(TempName(b"k", HOST, os.getpid()), 1e9, 300.0)
    assert not is_torn(TempName(b"k", "elsewhere", os.getpid()), 299.0, 300.0)
    assert is_torn(TempName(b"k", "elsewhere", os.getpid()), 301.0, 300.0)


# --- the index ---


def test_index_takes_victims_by_bytes_in_policy_order_and_skips_pins() -> None:
    index = DiskIndex(5 * ALIGN, "lru")
    for name, blocks in ((b"a", 1), (b"b", 2), (b"c", 1), (b"d", 1)):
        index.insert(name, blocks * ALIGN)
    assert index.order() == (b"a", b"b", b"c", b"d")
    assert index.victims_for(ALIGN) == [(b"a", ALIGN)]
    assert index.victims_for(2 * ALIGN) == [(b"a", ALIGN), (b"b", 2 * ALIGN)]
    index.pin(b"a")
    index.pin(b"a")
    assert index.victims_for(ALIGN) == [(b"b", 2 * ALIGN)]
    index.unpin(b"a")
    assert index.victims_for(5 * ALIGN) is None  # a is pinned: 4 blocks at most
    index.unpin(b"a")
    assert index.victims_for(6 * ALIGN) is None  # more than the capacity
    victims = index.victims_for(3 * ALIGN)
    assert victims is not None
    index.evict(victims)
    index.reserve(b"e", 3 * ALIGN)
    index.check()
    assert index.bytes + index.reserved == 5 * ALIGN
    index.finish(b"e", complete=True)
    assert index.order() == (b"c", b"d", b"e")
    index.touch(b"c")
    assert index.order() == (b"d", b"e", b"c")
    index.remove(b"d")
    index.remove(b"d")  # forgetting twice changes nothing
    index.check()
    assert index.bytes == 4 * ALIGN


def test_index_check_names_the_broken_invariant() -> None:
    index = DiskIndex(2 * ALIGN, "arc")
    index.insert(b"a", ALIGN)
    index.check()
    index.bytes += 1
    with pytest.raises(DiskIndexError, match="DK-2"):
        index.check()
    index.bytes -= 1
    index.reserve(b"b", 2 * ALIGN)
    with pytest.raises(DiskIndexError, match="DK-2"):
        index.check()
    index.finish(b"b", complete=False)
    index.policy.on_insert(b"z")
    with pytest.raises(DiskIndexError, match="policy"):
        index.check()
    index.policy.on_remove(b"z")
    index.groups[ord("a")].add(b"a2")
    with pytest.raises(DiskIndexError, match="groups"):
        index.check()
    index.groups[ord("a")].discard(b"a2")
    index.pins[b"a"] = 0
    with pytest.raises(DiskIndexError, match="DK-3"):
        index.check()


def test_arc_index_orders_reused_keys_last() -> None:
    index = DiskIndex(8 * ALIGN, "arc")
    for name in (b"a", b"b", b"c"):
        index.insert(name, ALIGN)
    index.touch(b"a")  # T1 -> T2
    assert index.order() == (b"b", b"c", b"a")
    index.check()


def test_arc_index_refreshes_a_store_in_t1_and_a_read_in_t2() -> None:
    index = DiskIndex(8 * ALIGN, "arc")
    for name in (b"a", b"b"):
        index.insert(name, ALIGN)
    index.restored(b"a")  # stored again: T1's most recent
    assert index.policy.extra()["t1"] == (b"b".hex(), b"a".hex())
    index.touch(b"a")  # read: T2
    assert index.policy.extra()["t2"] == (b"a".hex(),)
    index.restored(b"z")  # not indexed: nothing
    index.check()


def test_arc_index_records_a_ghost_hit_before_the_eviction() -> None:
    index = DiskIndex(2 * ALIGN, "arc")  # two entries: each ghost list keeps two
    for name in (b"a", b"b"):
        index.insert(name, ALIGN)
    index.evict(index.victims_for(ALIGN) or [])  # a: B1
    index.insert(b"c", ALIGN)
    assert index.policy.ghosts() == (b"a",)
    victims = index.victims_for(ALIGN, b"a")
    assert victims == [(b"b", ALIGN)]
    index.missed(b"a")  # B1 ghost hit: the target rises by one
    index.evict(victims)
    assert index.policy.extra()["target"] == (1, 1)
    index.victims_for(ALIGN, b"zz")  # pure: a key no list knows moves nothing
    index.missed(b"zz")
    assert index.policy.extra()["target"] == (1, 1)


# --- aligned buffers ---


def test_buffers_are_aligned_reused_and_kept_within_their_bytes() -> None:
    buffers = Buffers(keep_bytes=1 << 16)
    with buffers.lease(5000) as first, buffers.lease(100) as second:
        assert len(first) == 5000
        assert len(second) == 100
        for view in (first, second):
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
            assert address % ALIGN == 0  # what O_DIRECT needs
        first[:4] = b"kept"
    # Both were 64 KiB buffers: one is kept (the bound), the other unmapped.
    with buffers.lease(10) as again:
        assert len(again) == 10
    assert buffers._kept == 1 << 16
