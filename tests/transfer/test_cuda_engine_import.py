"""The CUDA engine imports and refuses cleanly on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from hybridkv.cache_layouts import all_layout_cases
from hybridkv.canonical import build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
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
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert resolve_batch_copier() is None
    else:
        pytest.skip("a CUDA driver library is installed here")
