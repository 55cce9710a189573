"""One run of the chats through vLLM's ``LLM``, in this process, with or without a connector.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by the conftest) keeps vLLM's engine core in the
calling process, so the model runner, the scheduler and both sides of the connector run here,
on the CPU platform's real forward. Prompts go in as token ids (no tokenizer is loaded) and
come back greedy, EOS ignored, so every answer has the workload's length, with the chosen
token's logprob at each position (``logprobs=0``: vLLM's raw logprob of the sampled token).

vLLM's own counters are read from its Prometheus registry (``LLM.get_metrics``) after the run:
``vllm:external_prefix_cache_hits`` (tokens vLLM took from the connector) beside the
connector's ``vllm:hybridkv_*`` counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from _models import TinyModel
from _workload import Reply, Transcript, replay, run_chats


@dataclass(frozen=True, slots=True)
class Run:
    """A run's answers and the counters vLLM exported at its end."""

    transcript: Transcript
    counters: dict[str, float]


def engine_kwargs(
    model: TinyModel, kv_transfer_config: dict[str, Any] | None, prefix_caching: bool = True
) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments: the model's shape, prefix caching on (unless the
    reference run turns it off), eager, seeded."""
    shape = model.shape
    kwargs: dict[str, Any] = {
        "model": str(model.path),
        "skip_tokenizer_init": True,
        "dtype": shape.dtype,
        "block_size": shape.block_size,
        "num_gpu_blocks_override": shape.gpu_blocks,
        "max_model_len": shape.max_model_len,
        "max_num_seqs": shape.max_num_seqs,
        "enable_prefix_caching": prefix_caching,
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,  # the Prometheus counters read after the run
        # The CPU worker reserves gpu_memory_utilization of the node's free memory up front
        # (and refuses to start without it): a small share beside the other engines here.
        "gpu_memory_utilization": 0.1,
        "kv_cache_memory_bytes": shape.kv_cache_mib * 2**20,
    }
    if shape.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = shape.max_num_batched_tokens
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs


def reply(completion: Any) -> Reply:
    """A ``CompletionOutput`` as a reply: its tokens, and each one's logprob from the dict vLLM
    returns per position (the sampled token is always in it)."""
    tokens = tuple(completion.token_ids)
    if completion.logprobs is None:
        raise AssertionError("vLLM returned no logprobs (SamplingParams.logprobs=0 was set)")
    scores = zip(tokens, completion.logprobs, strict=True)
    return Reply(tokens, tuple(float(d[t].logprob) for t, d in scores))


def sampling_params(model: TinyModel) -> Any:
    """Greedy, EOS ignored, the workload's answer length, the chosen token's logprob."""
    from vllm import SamplingParams

    tokens = model.shape.workload.answer_tokens
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)


def _generate(llm: Any, params: Any, prompts: list[list[int]]) -> list[Reply]:
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [reply(o.outputs[0]) for o in outputs]


@contextmanager
def engine(
    model: TinyModel, kv_transfer_config: dict[str, Any] | None, prefix_caching: bool = True
) -> Iterator[Any]:
    """One fresh ``LLM`` for the model, its engine shut down on exit."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(model, kv_transfer_config, prefix_caching))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def counters(llm: Any) -> dict[str, float]:
    """The counters vLLM exported so far (``LLM.get_metrics``), by name."""
    return {m.name: float(m.value) for m in llm.get_metrics() if hasattr(m, "value")}


def run(
    model: TinyModel,
    kv_transfer_config: dict[str, Any] | None,
    base: Transcript | None = None,
    prefix_caching: bool = True,
) -> Run:
    """The model's chats through one fresh ``LLM``: the chats themselves, or with ``base`` the
    baseline's prompts again (``_workload.replay``)."""
    with engine(model, kv_transfer_config, prefix_caching) as llm:
        generate = partial(_generate, llm, sampling_params(model))
        if base is None:
            transcript = run_chats(model.shape.workload, generate)
        else:
            transcript = replay(model.shape.workload, base, generate)
        return Run(transcript, counters(llm))
