"""Host memory: exact sizes, slot views, refusals naming host_bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hybridkv import cuda_driver, hostmem
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode


def test_allocation_is_exactly_whole_slots() -> None:
    mem = HostMemory(10_000, 3_000, PinMode.OFF)
    assert (mem.num_slots, mem.slot_bytes, mem.nbytes) == (3, 3000, 9000)
    assert mem.tensor.numel() == 9000
    assert mem.tensor.dtype == torch.uint8
    assert not mem.pinned


def test_slots_are_disjoint_fixed_chunks() -> None:
    mem = HostMemory(4 * 64, 64, PinMode.OFF)
    mem.tensor.zero_()
    mem.slot(2).fill_(7)
    assert mem.tensor[128:192].eq(7).all()
    assert mem.tensor[:128].eq(0).all()
    assert mem.tensor[192:].eq(0).all()
    for bad in (-1, 4, True):
        with pytest.raises(HybridKVConfigError) as err:
            mem.slot(bad)
        assert err.value.field == "slot"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1GB"])
def test_impossible_host_bytes_are_refused(bad: object) -> None:
    with pytest.raises(HybridKVConfigError) as err:
        HostMemory(bad, 64, PinMode.OFF)  # type: ignore[arg-type]
    assert err.value.field == "host_bytes"


def test_host_bytes_below_one_slot_or_above_physical_memory_are_refused() -> None:
    with pytest.raises(HybridKVConfigError, match="smaller than one slot") as err:
        HostMemory(100, 128, PinMode.OFF)
    assert err.value.field == "host_bytes"
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(HybridKVConfigError, match="exceeds this machine's memory") as err:
        HostMemory(physical + 4096, 4096, PinMode.OFF)
    assert err.value.field == "host_bytes"


def test_bad_slot_bytes_are_refused() -> None:
    with pytest.raises(HybridKVConfigError) as err:
        HostMemory(1024, 0, PinMode.OFF)
    assert err.value.field == "slot_bytes"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_required_pinning_without_cuda_is_refused() -> None:
    with pytest.raises(HybridKVConfigError) as err:
        HostMemory(1024, 64, PinMode.REQUIRED)
    assert err.value.field == "pin"
    auto = HostMemory(1024, 64, PinMode.AUTO)  # AUTO falls back to plain memory
    assert not auto.pinned
    auto.close()


class _FakeDriver:
    """Records host (un)registrations; fails the registration at ``fail_at`` (a byte offset)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.base = 0
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def host_register(self, ptr: int, size: int, device: int) -> None:
        if ptr - self.base == self.fail_at:
            raise cuda_driver.CudaDriverError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        self.registered.append((ptr - self.base, size))

    def host_unregister(self, ptr: int, device: int) -> None:
        self.unregistered.append(ptr - self.base)


def _pin_with(monkeypatch: pytest.MonkeyPatch, fake: _FakeDriver) -> None:
    # A CPU machine playing a CUDA one: regions of whole slots, at most 1000 bytes each.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(hostmem, "_REGISTER_CHUNK", 1000)
    monkeypatch.setattr(cuda_driver, "host_register", fake.host_register)
    monkeypatch.setattr(cuda_driver, "host_unregister", fake.host_unregister)
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        fake.base = t.data_ptr()
        return t  # type: ignore[no-any-return]

    monkeypatch.setattr(torch, "empty", empty)


def test_pinning_goes_in_regions_of_whole_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDriver()
    _pin_with(monkeypatch, fake)
    mem = HostMemory(3000, 300, PinMode.AUTO)
    assert mem.pinned
    assert mem.region_bytes == 900
    assert fake.registered == [(0, 900), (900, 900), (1800, 900), (2700, 300)]
    mem.close()
    assert fake.unregistered == [0, 900, 1800, 2700]
    assert not mem.pinned


def test_a_failed_region_unpins_the_others_and_names_host_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The driver API reports the failure as a status: no runtime error is left behind for
    # torch's next call (the GPU test checks that on a device), and nothing stays pinned.
    fake = _FakeDriver(fail_at=1800)
    _pin_with(monkeypatch, fake)
    with pytest.raises(HybridKVConfigError, match="CUDA_ERROR_OUT_OF_MEMORY") as err:
        HostMemory(3000, 300, PinMode.AUTO)
    assert err.value.field == "host_bytes"
    assert err.value.problem.startswith("pinning failed at byte 1800")
    assert fake.registered == [(0, 900), (900, 900)]
    assert fake.unregistered == [0, 900]


def test_shared_host_memory_is_one_region_for_every_mapping(tmp_path: Path) -> None:
    # Replicated ranks map one file: a slot one writes, the other reads; each maps exactly
    # num_slots * slot_bytes; close unlinks the file and leaves the mapping readable.
    path = os.path.join(str(tmp_path), "shard0.kv")
    writer = HostMemory(10_000, 3_000, PinMode.OFF, shared_path=path)
    reader = HostMemory(10_000, 3_000, PinMode.OFF, shared_path=path)
    assert os.path.getsize(path) == writer.nbytes == reader.nbytes == 9000
    assert writer.tensor.data_ptr() != reader.tensor.data_ptr()  # two mappings, one file
    writer.slot(1).fill_(9)
    assert reader.slot(1).eq(9).all()
    writer.close()
    assert not os.path.exists(path)
    reader.close()  # the file is gone already: closing again is fine
    assert reader.slot(1).eq(9).all()


def test_a_shared_file_of_another_size_is_refused(tmp_path: Path) -> None:
    path = os.path.join(str(tmp_path), "other.kv")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(HybridKVConfigError) as caught:
        HostMemory(10_000, 3_000, PinMode.OFF, shared_path=path)
    assert caught.value.field == "shared_path"
    assert "4096" in str(caught.value)
    assert os.path.getsize(path) == 4096  # untouched


def test_a_shared_region_larger_than_the_free_space_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(str(tmp_path), "big.kv")
    monkeypatch.setattr(hostmem, "_free_bytes", lambda _: 8192)
    with pytest.raises(HybridKVConfigError) as caught:
        HostMemory(10_000, 3_000, PinMode.OFF, shared_path=path)
    assert caught.value.field == "host_bytes"
    assert "shm-size" in str(caught.value)
    assert not os.path.exists(path)  # nothing left behind
