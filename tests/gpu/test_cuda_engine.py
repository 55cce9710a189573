"""The CUDA transfer engine against the CPU engine, byte for byte (marker ``gpu``).

Each layout is built twice with identical random bytes, once on the CPU and once on the GPU;
the same jobs run on the CPU engine and on the CUDA engine (batched and run-by-run); host
memories and caches must end equal byte for byte.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from hybridkv import hostmem
from hybridkv.cache_layouts import LayoutCase, all_layout_cases
from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.transfer import (
    CpuTransferEngine,
    Direction,
    FinishedJob,
    JobId,
    TransferPair,
    cuda_batch,
)
from hybridkv.transfer.cuda_engine import BatchMode, CopyMethod, CudaTransferEngine

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
    cpu: LayoutCase, gpu: LayoutCase, batch: BatchMode, method: CopyMethod
) -> tuple[CpuTransferEngine, CudaTransferEngine, HostMemory, HostMemory]:
    ccpu = build_canonical_caches(cpu.kv_caches, cpu.groups, NUM_BLOCKS)
    cgpu = build_canonical_caches(gpu.kv_caches, gpu.groups, NUM_BLOCKS)
    slot = max(ccpu.group_bytes(g) for g in range(len(cpu.groups)))
    hcpu = HostMemory(8 * slot, slot, PinMode.OFF)
    hgpu = HostMemory(8 * slot, slot, PinMode.AUTO)
    hcpu.tensor.zero_()
    hgpu.tensor.zero_()
    egpu = CudaTransferEngine(cgpu, hgpu, batch, method=method)
    return CpuTransferEngine(ccpu, hcpu), egpu, hcpu, hgpu


def _jobs(groups: int, seed: int) -> list[tuple[Direction, list[TransferPair]]]:
    rng = random.Random(seed)
    jobs: list[tuple[Direction, list[TransferPair]]] = []
    for g in range(groups):
        slots = rng.sample(range(8), NUM_BLOCKS)
        jobs.append((Direction.STORE, [TransferPair(g, b, slots[b]) for b in range(NUM_BLOCKS)]))
        blocks = rng.sample(range(NUM_BLOCKS), 4)
        jobs.append((Direction.LOAD, [TransferPair(g, blocks[i], slots[i]) for i in range(4)]))
    return jobs


# The batched path is required where it runs (no silent fallback to run-by-run copies).
WAYS = [
    (BatchMode.REQUIRED, CopyMethod.DMA),
    (BatchMode.OFF, CopyMethod.DMA),
    (BatchMode.OFF, CopyMethod.KERNEL),
]


@pytest.mark.parametrize(("batch", "method"), WAYS, ids=["batched", "per-run", "kernel"])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_engine_matches_cpu_engine(name: str, batch: BatchMode, method: CopyMethod) -> None:
    cpu, gpu = _pair_of_cases(name, seed=11)
    ecpu, egpu, hcpu, hgpu = _engines(cpu, gpu, batch, method)
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


def _flat_cuda(blocks: int, block: int, seed: int) -> tuple[torch.Tensor, CanonicalCaches]:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(-128, 127, (blocks, block), dtype=torch.int8, generator=gen).cuda()
    spec = CacheGroupSpec(GroupKind.FULL, 16, block, block, ("flat",))
    return t, build_canonical_caches({"flat": t}, [spec], blocks)


@pytest.mark.parametrize("method", [CopyMethod.DMA, CopyMethod.KERNEL])
def test_concurrent_jobs_from_several_threads_all_land(method: CopyMethod) -> None:
    # Four threads each keep several store jobs in flight before waiting for any; then loads
    # of the slots into other blocks. The batched path is required (no silent fallback).
    blocks, block = 64, 4096
    cache, cc = _flat_cuda(blocks, block, seed=3)
    original = cache.clone()
    host = HostMemory(blocks * block, block, PinMode.REQUIRED)
    slots = random.Random(1).sample(range(blocks), blocks)
    errors: list[BaseException] = []
    with CudaTransferEngine(cc, host, BatchMode.REQUIRED, method=method) as engine:

        def worker(t: int) -> None:
            try:
                mine = range(t * 16, (t + 1) * 16)
                jobs = [
                    engine.submit(Direction.STORE, [TransferPair(0, b, slots[b]) for b in chunk])
                    for chunk in (mine[i : i + 4] for i in range(0, 16, 4))
                ]
                engine.wait(jobs)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        stored = engine.poll()
        assert len(stored) == 16
        assert all(f.success for f in stored)
        cache.zero_()
        loads = [
            engine.submit(Direction.LOAD, [TransferPair(0, (b + 1) % blocks, slots[b])])
            for b in range(blocks)
        ]
        engine.wait(loads)
        assert sorted(engine.poll()) == [FinishedJob(j, True) for j in loads]
    assert torch.equal(cache.roll(-1, 0), original)


@pytest.mark.parametrize("method", [CopyMethod.DMA, CopyMethod.KERNEL])
def test_load_waits_for_compute_still_reading_its_destination(method: CopyMethod) -> None:
    # Compute queued before submit still reads block 5 (behind a long sleep); the load that
    # overwrites block 5 must start only after that read.
    cache, cc = _flat_cuda(8, 1 << 20, seed=4)
    before = cache[5].clone()
    host = HostMemory(8 << 20, 1 << 20, PinMode.REQUIRED)
    host.slot(2).fill_(9)
    with CudaTransferEngine(cc, host, BatchMode.REQUIRED, method=method) as engine:
        torch.cuda._sleep(50_000_000)
        snapshot = cache[5].clone()  # queued on the compute stream, after the sleep
        job = engine.submit(Direction.LOAD, [TransferPair(0, 5, 2)])
        engine.wait([job])
        torch.cuda.synchronize()
        assert engine.poll() == [FinishedJob(job, True)]
    assert torch.equal(snapshot, before)
    assert bool((cache[5] == 9).all())


def test_a_driver_error_fails_the_job_and_the_engine_goes_on() -> None:
    cache, cc = _flat_cuda(8, 4096, seed=5)
    host = HostMemory(8 * 4096, 4096, PinMode.REQUIRED)
    host.tensor.zero_()
    with CudaTransferEngine(cc, host, BatchMode.REQUIRED, method=CopyMethod.DMA) as engine:
        # An invalid source access order: cuMemcpyBatchAsync refuses the whole batch.
        engine._orders[Direction.STORE] = 0
        bad = engine.submit(Direction.STORE, [TransferPair(0, 1, 1)])
        engine._orders[Direction.STORE] = cuda_batch.SRC_ORDER_STREAM
        good = engine.submit(Direction.STORE, [TransferPair(0, 2, 2)])
        engine.wait([bad, good])
        assert sorted(engine.poll()) == [FinishedJob(bad, False), FinishedJob(good, True)]
    assert torch.equal(host.slot(2).view(torch.int8), cache[2].cpu())
    assert bool((host.slot(1) == 0).all())  # the refused batch moved nothing
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0


def test_batch_copier_reports_the_cuda_result() -> None:
    copier = cuda_batch.resolve_batch_copier()
    assert copier is not None
    dev = torch.zeros(16, dtype=torch.int8, device="cuda")
    desc = torch.tensor([[dev.data_ptr()], [dev.data_ptr() + 8], [8]], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync failed: CUresult"):
        copier.copy(desc, torch.cuda.current_stream().cuda_stream, 0)
    torch.cuda.synchronize()


def test_a_failed_pin_leaves_no_error_for_torchs_next_call() -> None:
    mem = HostMemory(1 << 20, 1 << 16, PinMode.REQUIRED)
    with pytest.raises(HybridKVConfigError) as err:  # already registered: the driver refuses
        hostmem._register(mem.tensor.data_ptr(), mem.nbytes, mem.region_bytes, 0)
    assert err.value.field == "host_bytes"
    # cudaHostRegister would have left the runtime's last error set, and this kernel launch's
    # check would have raised it.
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0
    assert mem.tensor.is_pinned()
    mem.close()
    assert not mem.tensor.is_pinned()


def test_engine_streams_are_not_torchs_pooled_streams() -> None:
    _, cc = _flat_cuda(4, 4096, seed=6)
    host = HostMemory(4 * 4096, 4096, PinMode.REQUIRED)
    with CudaTransferEngine(cc, host) as engine:
        mine = {s.cuda_stream for s in engine._streams.values()}
        # torch hands out 32 pooled streams per priority round robin: 80 draws see them all.
        pooled = {torch.cuda.Stream().cuda_stream for _ in range(80)}
        pooled |= {torch.cuda.Stream(priority=-1).cuda_stream for _ in range(80)}
        assert len(mine) == 2
        assert not mine & pooled


def test_submit_from_a_fresh_thread_uses_the_engines_device() -> None:
    cache, cc = _flat_cuda(4, 4096, seed=7)
    host = HostMemory(4 * 4096, 4096, PinMode.REQUIRED)
    out: list[object] = []
    with CudaTransferEngine(cc, host, BatchMode.REQUIRED) as engine:

        def worker() -> None:
            job = engine.submit(Direction.STORE, [TransferPair(0, 3, 0)])
            engine.wait([job])
            out.extend(engine.poll())

        th = threading.Thread(target=worker)
        th.start()
        th.join()
    assert len(out) == 1
    assert out[0].success
    assert torch.equal(host.slot(0).view(torch.int8), cache[3].cpu())


def test_auto_picks_kernels_for_many_small_runs_and_dma_for_few_large_ones() -> None:
    # The cost model, observed through which path ran: kernel jobs never call the batch
    # copier, DMA jobs do.
    cache, cc = _flat_cuda(2048, 4096, seed=8)
    host = HostMemory(2048 * 4096, 4096, PinMode.REQUIRED)
    with CudaTransferEngine(cc, host, BatchMode.REQUIRED) as engine:
        calls: list[int] = []
        copier = engine._copier
        assert copier is not None
        real = copier.copy

        def counting(desc: torch.Tensor, *args: object) -> object:
            calls.append(int(desc.shape[1]))
            return real(desc, *args)  # type: ignore[arg-type]

        copier.copy = counting  # type: ignore[method-assign]
        slots = random.Random(2).sample(range(2048), 2048)
        many = engine.submit(Direction.STORE, [TransferPair(0, b, slots[b]) for b in range(2048)])
        few = engine.submit(Direction.STORE, [TransferPair(0, 7, slots[7])])
        engine.wait([many, few])
        assert sorted(engine.poll()) == [FinishedJob(many, True), FinishedJob(few, True)]
    assert calls == [1]
    host_rows = host.tensor.view(torch.int8).view(2048, 4096)
    assert torch.equal(host_rows[torch.tensor(slots)], cache.cpu())


def test_kernel_scratch_is_allocated_once_and_jobs_allocate_no_rows() -> None:
    # The index kernels gather into scratch the engine allocated when it was built
    # (scratch_bytes, half per direction); a kernel job larger than the scratch goes in chunks
    # and allocates nothing of its rows' size (only its ids: 16 bytes per pair).
    blocks, block = 256, 4096
    cache, cc = _flat_cuda(blocks, block, seed=9)
    host = HostMemory(blocks * block, block, PinMode.REQUIRED)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with CudaTransferEngine(cc, host, method=CopyMethod.KERNEL, scratch_bytes=16 * block) as e:
        assert e.scratch_bytes == 16 * block
        assert torch.cuda.memory_allocated() - before >= 16 * block
        built = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        slots = random.Random(4).sample(range(blocks), blocks)
        job = e.submit(Direction.STORE, [TransferPair(0, b, slots[b]) for b in range(blocks)])
        e.wait([job])
        assert e.poll() == [FinishedJob(job, True)]
        assert torch.cuda.max_memory_allocated() - built < 8 * block  # 32 chunks of 8 rows
    host_rows = host.tensor.view(torch.int8).view(blocks, block)
    assert torch.equal(host_rows[torch.tensor(slots)], cache.cpu())


def test_no_scratch_means_dma_only_and_kernel_copies_are_refused() -> None:
    _cache, cc = _flat_cuda(8, 4096, seed=10)
    host = HostMemory(8 * 4096, 4096, PinMode.REQUIRED)
    with CudaTransferEngine(cc, host, scratch_bytes=0) as engine:
        assert engine.scratch_bytes == 0
    with pytest.raises(HybridKVConfigError) as caught:
        CudaTransferEngine(cc, host, method=CopyMethod.KERNEL, scratch_bytes=0)
    assert caught.value.field == "scratch_bytes"
    with pytest.raises(HybridKVConfigError) as too_small:
        CudaTransferEngine(cc, host, method=CopyMethod.KERNEL, scratch_bytes=4096)
    assert too_small.value.field == "gpu_scratch_bytes"
