"""Tiny random-weight checkpoints of the architectures the end-to-end tests serve.

Each model is a config from ``transformers`` at the smallest size vLLM's CPU kernels accept
(attention head dim >= 32, the CPU attention backend's smallest; GDN linear heads of 128 in
bfloat16, the only shape vLLM's CPU GDN kernel runs), saved with random weights to a folder
that vLLM loads like any checkpoint: no hub, no download. A seed fixes the weights, so the
run with and without the connector serve the same model.

A word-level tokenizer (``tokenizers``) is saved beside the weights for ``vllm serve``, which
cannot start without one; the in-process runs prompt with token ids and skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _workload import Workload

VOCAB = 512
MAX_LEN = 2048


@dataclass(frozen=True, slots=True)
class Shape:
    """How vLLM runs one architecture in these tests, and the chats it serves.

    ``gpu_blocks`` (vLLM's ``num_gpu_blocks_override``) is small enough that the GPU prefix
    cache cannot hold every chat's history between turns, so later turns find their prefix in
    the host tier. vLLM raises the attention block of a mamba/GDN hybrid to the state's page
    size (288 tokens here), so that model's chats are longer: a prefix loads in whole blocks.
    """

    dtype: str
    layout: str  # the KV cache groups vLLM builds, in words
    block_size: int
    gpu_blocks: int
    max_model_len: int
    workload: Workload
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    kv_cache_mib: int = 256  # what the CPU worker sets aside for the pool (it must fit)


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A saved checkpoint and how the tests run it."""

    name: str  # the test id: llama, gemma3, qwen3_5
    path: Path
    shape: Shape


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=MAX_LEN,
        architectures=["LlamaForCausalLM"],
    )


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=MAX_LEN,
        architectures=["Gemma3ForCausalLM"],
    )


def _qwen3_5() -> Any:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=MAX_LEN,
        architectures=["Qwen3_5ForCausalLM"],
        torch_dtype="bfloat16",
    )


def _gemma3_pool() -> Any:
    """Issue 29's model: Gemma-3-like, 10 sliding-window layers (window 512) then 2 full."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        query_pre_attn_scalar=128,
        sliding_window=512,
        layer_types=["sliding_attention"] * 10 + ["full_attention"] * 2,
        max_position_embeddings=4096,
        architectures=["Gemma3ForCausalLM"],
    )


_CHATS = Workload(chats=12, systems=3, turns=3, system_tokens=256, user_tokens=64)
_LONG_CHATS = Workload(chats=12, systems=3, turns=3, system_tokens=600, user_tokens=48)

ARCHITECTURES: dict[str, tuple[Callable[[], Any], Shape]] = {
    "llama": (_llama, Shape("float32", "full attention", 32, 48, 512, _CHATS)),
    "gemma3": (_gemma3, Shape("float32", "sliding window + full attention", 32, 64, 512, _CHATS)),
    "qwen3_5": (
        _qwen3_5,
        Shape(
            "bfloat16", "gated delta net (mamba align) + full attention", 288, 16, 1024, _LONG_CHATS
        ),
    ),
}


POOL_FILLING: dict[str, tuple[Callable[[], Any], Shape]] = {
    # Issue 29's run (tests/e2e/test_loads_fill_the_pool.py): 8 chats x 4 turns over one
    # 2,000-token system prompt, 4 requests at a time, on a pool of about three requests.
    "gemma3_pool": (
        _gemma3_pool,
        Shape(
            "float32",
            "5 sliding-window groups + 1 full-attention group",
            32,
            440,
            4096,
            Workload(
                chats=8, systems=1, turns=4, system_tokens=2000, user_tokens=100, answer_tokens=16
            ),
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            kv_cache_mib=512,
        ),
    ),
}


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over VOCAB words ``w0 .. w{VOCAB-1}``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="w1")
    fast.chat_template = None
    fast.save_pretrained(str(folder))


LOGIT_SCALE = 16.0
"""How much the bfloat16 model's output head is scaled up (``_sharpen``)."""


def _sharpen(model: Any) -> None:
    """Scale the output head by ``LOGIT_SCALE`` (its embeddings are not tied to the input's).

    At the default initialisation (std 0.02) a random model's logits over 512 words spread by
    about 0.2, so every answer token has a logprob near -5.5 whatever the KV it read: the
    chosen token's logprob, which the bfloat16 criterion measures (``_drift``), would hardly
    move even on corrupted loads. Scaled, the logits spread by about 3, as a trained model's
    are peaked, and a wrong load moves the chosen token's logprob by far more than a rounding.
    """
    import torch

    head = model.get_output_embeddings()
    if head is model.get_input_embeddings():
        raise AssertionError("the bfloat16 model ties its output head to its embeddings")
    with torch.no_grad():
        head.weight.mul_(LOGIT_SCALE)


def build(name: str, root: Path, seed: int = 0) -> TinyModel:
    """Save the named tiny model (weights seeded) and its tokenizer under ``root/name``."""
    import torch
    from transformers import AutoModelForCausalLM

    make_config, shape = {**ARCHITECTURES, **POOL_FILLING}[name]
    folder = root / name
    config = make_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype))
    if shape.dtype == "bfloat16":
        _sharpen(model)
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    # generation_config.json would set vLLM's default sampling; greedy comes from the tests.
    (folder / "generation_config.json").unlink(missing_ok=True)
    return TinyModel(name, folder, shape)
