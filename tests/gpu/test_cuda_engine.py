"""The CUDA transfer engine against the CPU engine, byte for byte (marker ``gpu``).

Each layout is built twice with identical random bytes, once on the CPU and once on the GPU;
the same jobs run on the CPU engine and on the CUDA engine (batched and run-by-run); host
memories and caches must end equal byte for byte.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv.cache_layouts import LayoutCase, all_layout_cases
from hybridkv.canonical import CanonicalCaches, build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.transfer import CpuTransferEngine, Direction, FinishedJob, JobId, TransferPair
from hybridkv.transfer.cuda_engine import BatchMode, CudaTransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and CUDA torch"),
]

NUM_BLOCKS = 6
NAMES = [c.name for c in all_layout_cases(NUM_BLOCKS)]


def _storages(case: LayoutCase) -> list[torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for cache in case.kv_caches.values():
        t = cache[0] if isinstance(cache, tuple) else cache
        s = t.untyped_storage()
        out[s.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            s, 0, (s.nbytes(),), (1,)
        )
    return list(out.values())


def _pair_of_cases(name: str, seed: int) -> tuple[LayoutCase, LayoutCase]:
    cpu = next(c for c in all_layout_cases(NUM_BLOCKS, "cpu") if c.name == name)
    gpu = next(c for c in all_layout_cases(NUM_BLOCKS, "cuda") if c.name == name)
    gen = torch.Generator().manual_seed(seed)
    for a, b in zip(_storages(cpu), _storages(gpu), strict=True):
        a.copy_(torch.randint(0, 256, (a.numel(),), dtype=torch.uint8, generator=gen))
        b.copy_(a)
    return cpu, gpu


def _engines(
    cpu: LayoutCase, gpu: LayoutCase, batch: BatchMode
) -> tuple[CpuTransferEngine, CudaTransferEngine, HostMemory, HostMemory]:
    ccpu = build_canonical_caches(cpu.kv_caches, cpu.groups, NUM_BLOCKS)
    cgpu = build_canonical_caches(gpu.kv_caches, gpu.groups, NUM_BLOCKS)
    slot = max(ccpu.group_bytes(g) for g in range(len(cpu.groups)))
    hcpu = HostMemory(8 * slot, slot, PinMode.OFF)
    hgpu = HostMemory(8 * slot, slot, PinMode.AUTO)
    hcpu.tensor.zero_()
    hgpu.tensor.zero_()
    return CpuTransferEngine(ccpu, hcpu), CudaTransferEngine(cgpu, hgpu, batch), hcpu, hgpu


def _jobs(groups: int, seed: int) -> list[tuple[Direction, list[TransferPair]]]:
    rng = random.Random(seed)
    jobs: list[tuple[Direction, list[TransferPair]]] = []
    for g in range(groups):
        slots = rng.sample(range(8), NUM_BLOCKS)
        jobs.append((Direction.STORE, [TransferPair(g, b, slots[b]) for b in range(NUM_BLOCKS)]))
        blocks = rng.sample(range(NUM_BLOCKS), 4)
        jobs.append((Direction.LOAD, [TransferPair(g, blocks[i], slots[i]) for i in range(4)]))
    return jobs


@pytest.mark.parametrize("batch", [BatchMode.AUTO, BatchMode.OFF])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_engine_matches_cpu_engine(name: str, batch: BatchMode) -> None:
    cpu, gpu = _pair_of_cases(name, seed=11)
    ecpu, egpu, hcpu, hgpu = _engines(cpu, gpu, batch)
    with ecpu, egpu:
        for direction, pairs in _jobs(len(cpu.groups), seed=5):
            # a load reads slots a store wrote: wait for each job (the contract orders nothing
            # across directions)
            for engine in (ecpu, egpu):
                job = engine.submit(direction, pairs)
                engine.wait([job])
                assert engine.poll() == [FinishedJob(job, True)]
    assert torch.equal(hcpu.tensor, hgpu.tensor)
    for a, b in zip(_storages(cpu), _storages(gpu), strict=True):
        assert torch.equal(a, b.cpu())


def test_store_reads_its_source_after_queued_compute() -> None:
    # vLLM #39306: the store must see what compute queued before submit wrote.
    _, gpu = _pair_of_cases("block_first_nhd", seed=1)
    cgpu = build_canonical_caches(gpu.kv_caches, gpu.groups, NUM_BLOCKS)
    host = HostMemory(8 * cgpu.group_bytes(0), cgpu.group_bytes(0), PinMode.AUTO)
    with CudaTransferEngine(cgpu, host) as engine:
        torch.cuda._sleep(50_000_000)  # keep the compute stream busy (~tens of ms)
        for layer in gpu.groups[0].layer_names:
            cache = gpu.kv_caches[layer]
            assert isinstance(cache, torch.Tensor)
            cache[3].fill_(7.0)
        job = engine.submit(Direction.STORE, [TransferPair(0, 3, 2)])
        engine.wait([job])
        assert engine.poll() == [FinishedJob(job, True)]
    assert bool((host.slot(2).view(torch.float16) == 7.0).all())


def test_failure_injection_and_bad_input_on_cuda() -> None:
    _, gpu = _pair_of_cases("hybrid_overlay", seed=2)
    cgpu = build_canonical_caches(gpu.kv_caches, gpu.groups, NUM_BLOCKS)
    slot = max(cgpu.group_bytes(g) for g in range(2))
    host = HostMemory(8 * slot, slot, PinMode.AUTO)

    def hook(job: JobId, direction: Direction, index: int) -> None:
        if job == 2:
            raise OSError("injected")

    with CudaTransferEngine(cgpu, host, fault_hook=hook) as engine:
        jobs = [engine.submit(Direction.STORE, [TransferPair(0, b, b)]) for b in range(3)]
        engine.wait(jobs)
        assert sorted(engine.poll()) == [
            FinishedJob(jobs[0], True),
            FinishedJob(jobs[1], False),
            FinishedJob(jobs[2], True),
        ]
        with pytest.raises(HybridKVConfigError) as err:
            engine.submit(Direction.LOAD, [TransferPair(0, NUM_BLOCKS, 0)])
        assert err.value.field == "pairs[0].block"
        assert engine.poll() == []


def test_host_memory_is_pinned_by_registration_at_its_exact_size() -> None:
    mem = HostMemory(3 * 1_000_000 + 5, 1_000_000, PinMode.AUTO)
    assert mem.pinned
    assert mem.tensor.is_pinned()
    assert mem.nbytes == 3_000_000
    mem.close()
    assert not mem.pinned


def test_cuda_engine_refuses_cpu_caches() -> None:
    cpu, _ = _pair_of_cases("mla_latent", seed=0)
    cc: CanonicalCaches = build_canonical_caches(cpu.kv_caches, cpu.groups, NUM_BLOCKS)
    with pytest.raises(HybridKVConfigError) as err:
        CudaTransferEngine(cc, HostMemory(1 << 20, 1 << 16, PinMode.OFF))
    assert err.value.field == "caches"
