"""``HybridKVConnector``'s worker side on CUDA caches and the CUDA transfer engine, inside
vLLM 0.33's real ``Scheduler``, against the same run on CPU caches (markers ``gpu``; needs vLLM).

The in-process engine (:mod:`hybridkv.vllm.harness.inprocess`) runs a multi-turn chat twice with the
same settings: once with the caches vLLM's own ``allocate_kv_cache`` builds on the CPU (the
connector's worker picks the CPU engine), once with the same call on ``cuda`` (it picks
:class:`~hybridkv.transfer.cuda_engine.CudaTransferEngine`, pinned host memory, CUDA streams). The
stand-in forward writes and checks content tags in the CUDA caches themselves, so every KV slot and
mamba state a request reads after a load is checked on the GPU. Reports complete in the same steps
on both (copies report through ``DelayedCompletion``), so the two runs must agree on every count and
end with byte-identical caches.

vLLM plans with its CPU platform (``VLLM_TARGET_DEVICE=cpu``, as in ``nox -s vllm``): the
``KVCacheConfig`` and the ``[B, H, N, C]`` cache layout are the ones vLLM resolves for its CPU
attention backend; the CUDA backends' layouts are covered byte for byte by
``test_cuda_engine.py``'s layout cases.

Skips (with the reason) without a CUDA device, or without vLLM 0.33: ``nox -s gpu`` installs it;
a GPU machine without network access and without vLLM skips this module.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device and CUDA torch", allow_module_level=True)

# vLLM reads these at its first import: plan with its CPU platform, offline (module docstring).
for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_key, _value)

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM 0.33 is not installed here (`nox -s gpu` installs it; it needs network access)",
)

from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.transfer.cuda_engine import CudaTransferEngine  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from spec.presets import tiny_config  # noqa: E402

HOST_BYTES = 64 << 20

# name -> (config.json, settings without device, trace, chunk): the chat runs of
# tests/vllm/test_hybridkv_inprocess.py (Qwen3-Next 4 layers: 3 GDN + full attention, block
# 640; gpt-oss-20b 2 layers: sliding window 128 + full attention, block 32).
CASES: dict[str, tuple[dict[str, Any], EngineSettings, ChatTrace, int]] = {
    "mamba+full": (
        tiny_config("qwen3-next-80b-a3b", 4),
        EngineSettings(
            num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
    ),
    "sliding+full": (
        tiny_config("gpt-oss-20b", 2),
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        32,
    ),
}

# Every count of a report; the timings differ between the runs.
COUNTS = (
    "requests",
    "finished",
    "steps",
    "prompt_tokens",
    "prefill_computed",
    "external_loaded",
    "gpu_prefix_hits",
    "external_hits",
    "preemptions",
    "slots_checked",
    "wrong_reads",
    "leaked_blocks",
    "transfers",
    "failed_loads",
)


def _transfer(chunk: int) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": HOST_BYTES, "chunk_size": chunk},
    )


def _run(name: str, device: str) -> tuple[InProcessEngine, InProcessReport]:
    config_json, settings, trace, chunk = CASES[name]
    settings = EngineSettings(
        **{f: getattr(settings, f) for f in EngineSettings.__slots__ if f != "device"},
        device=device,
    )
    engine = InProcessEngine(config_json, settings, _transfer(chunk), HybridKVOnCPU(delay=1))
    return engine, run_trace(engine, trace)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU. Caches are compared byte for byte, not value for value:
    the stand-in forward's content tags are bit patterns, some of which read as NaN in bf16,
    and ``torch.equal`` calls two NaNs unequal (the first GPU run failed on exactly that,
    with every count and every byte the same)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", list(CASES))
def test_the_worker_on_cuda_caches_moves_the_same_content_as_on_cpu(name: str) -> None:
    cpu_engine, cpu = _run(name, "cpu")
    cuda_engine, cuda = _run(name, "cuda")
    print(f"\n{name} CUDA: {cuda}\n{name} CPU:  {cpu}")
    engine = cuda_engine.worker._engine
    assert isinstance(getattr(engine, "inner", engine), CudaTransferEngine)
    # The kernel path's scratch, allocated at registration: the default gpu_scratch_bytes.
    assert getattr(engine, "inner", engine).scratch_bytes == 64 << 20
    assert next(iter(cuda_engine.kv_caches.values())).device.type == "cuda"
    # The CUDA run, content-checked on the GPU.
    assert cuda.finished == cuda.requests > 0
    assert cuda.slots_checked > 0
    assert cuda.wrong_reads == 0
    assert cuda.external_loaded > 0
    assert cuda.external_hits == cuda.external_loaded
    assert cuda.transfers["bytes_loaded"] > 0
    assert cuda.transfers["bytes_stored"] > 0
    assert cuda.leaked_blocks == 0
    assert cuda_engine.pending() == 0
    # ... and the CPU run of the same trace, count for count and byte for byte.
    for count in COUNTS:
        assert getattr(cuda, count) == getattr(cpu, count), count
    assert cuda_engine.kv_caches.keys() == cpu_engine.kv_caches.keys()
    for layer, tensor in cuda_engine.kv_caches.items():
        assert torch.equal(_bytes(tensor), _bytes(cpu_engine.kv_caches[layer])), layer
    for engine_ in (cpu_engine, cuda_engine):
        engine_.worker.shutdown()
