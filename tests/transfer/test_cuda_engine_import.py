"""The CUDA engine imports and refuses cleanly on a machine without CUDA."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hybridkv.cache_layouts import all_layout_cases
from hybridkv.canonical import build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.transfer import cuda_batch
from hybridkv.transfer.cuda_batch import resolve_batch_copier
from hybridkv.transfer.cuda_engine import CudaTransferEngine


def test_cuda_engine_refuses_cpu_caches_naming_caches() -> None:
    case = all_layout_cases(4)[0]
    cc = build_canonical_caches(case.kv_caches, case.groups, 4)
    with pytest.raises(HybridKVConfigError) as err:
        CudaTransferEngine(cc, HostMemory(1 << 16, 1 << 12, PinMode.OFF))
    assert err.value.field == "caches"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver fallback")
def test_batch_copier_is_absent_without_a_driver() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert resolve_batch_copier() is None
    else:
        pytest.skip("a CUDA driver library is installed here")


def test_memcpy_attributes_struct_matches_cuda_h() -> None:
    # cuda.h (12.8+): CUmemcpyAttributes { CUmemcpySrcAccessOrder srcAccessOrder;
    # CUmemLocation srcLocHint; CUmemLocation dstLocHint; unsigned int flags; } with
    # CUmemLocation { CUmemLocationType type; int id; }: 4 + 8 + 8 + 4 bytes, 4-aligned.
    assert ctypes.sizeof(cuda_batch._MemcpyAttributes) == cuda_batch.ATTRIBUTES_SIZE == 24
    assert ctypes.alignment(cuda_batch._MemcpyAttributes) == 4
    offsets = {
        name: getattr(cuda_batch._MemcpyAttributes, name).offset
        for name in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")
    }
    assert offsets == {"srcAccessOrder": 0, "srcLocHint": 4, "dstLocHint": 12, "flags": 20}
    assert ctypes.sizeof(cuda_batch._MemLocation) == 8


def test_batch_copier_refuses_descriptors_it_cannot_hand_the_driver() -> None:
    # No driver call happens: the shape check comes first (the function pointer is never
    # called with a null address).
    copier = cuda_batch.BatchCopier(1)
    for bad in (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="descriptors"):
            copier.copy(bad, 0, cuda_batch.SRC_ORDER_ANY)
    assert copier.copy(torch.zeros(3, 0, dtype=torch.int64), 0, cuda_batch.SRC_ORDER_ANY) is None
