"""One run of the chats through vLLM's ``LLM``, in this process, with or without a connector.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by the conftest) keeps vLLM's engine core in the
calling process, so the model runner, the scheduler and both sides of the connector run here,
on the CPU platform's real forward. Prompts go in as token ids (no tokenizer is loaded) and
come back greedy, EOS ignored, so every answer has the workload's length.

vLLM's own counters are read from its Prometheus registry (``LLM.get_metrics``) after the run:
``vllm:external_prefix_cache_hits`` (tokens vLLM took from the connector) beside the
connector's ``vllm:hybridkv_*`` counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from _models import TinyModel
from _workload import Transcript, run_chats


@dataclass(frozen=True, slots=True)
class Run:
    """A run's answers and the counters vLLM exported at its end."""

    transcript: Transcript
    counters: dict[str, float]


def engine_kwargs(model: TinyModel, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments: the model's shape, prefix caching on, eager, seeded."""
    shape = model.shape
    kwargs: dict[str, Any] = {
        "model": str(model.path),
        "skip_tokenizer_init": True,
        "dtype": shape.dtype,
        "block_size": shape.block_size,
        "num_gpu_blocks_override": shape.gpu_blocks,
        "max_model_len": shape.max_model_len,
        "max_num_seqs": 8,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,  # the Prometheus counters read after the run
        # The CPU worker reserves gpu_memory_utilization of the node's free memory up front
        # (and refuses to start without it): a small share beside the other engines here.
        "gpu_memory_utilization": 0.1,
        "kv_cache_memory_bytes": 256 * 2**20,
    }
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs


def _generate(llm: Any, params: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(model: TinyModel, kv_transfer_config: dict[str, Any] | None) -> Run:
    """The model's chats through one fresh ``LLM``, its engine shut down before returning."""
    from vllm import LLM, SamplingParams

    shape = model.shape
    params = SamplingParams(
        temperature=0.0, max_tokens=shape.workload.answer_tokens, ignore_eos=True
    )
    llm = LLM(**engine_kwargs(model, kv_transfer_config))
    try:
        transcript = run_chats(shape.workload, partial(_generate, llm, params))
        counters = {m.name: float(m.value) for m in llm.get_metrics() if hasattr(m, "value")}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return Run(transcript, counters)
