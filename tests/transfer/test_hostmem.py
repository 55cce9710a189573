"""Host memory: exact sizes, slot views, refusals naming host_bytes."""

from __future__ import annotations

import os

import pytest
import torch

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
