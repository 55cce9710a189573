"""Real hybrid architectures as Hugging Face config.json dicts, from their published configs.

Each preset keeps the published fields that vLLM 0.33 reads to build the model and its KV cache
(layer pattern, attention and recurrent dims, dtype) and names the config.json it was taken from.
Weights-only fields that do not change geometry (e.g. gpt-oss's mxfp4 ``quantization_config``,
tokenizer ids) are left out, so vLLM builds the model in the checkpoint dtype.

:func:`tiny_config` keeps a preset's per-layer dims and layer pattern but fewer layers, so tests
can build the model with vLLM quickly; its geometry differs from the full model's only in group
membership (which layers, how many groups).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from spec.errors import ConfigError

__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "preset_config", "tiny_config"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A named config.json with a one-line description and the address it was taken from."""

    name: str
    description: str
    source: str
    config: Mapping[str, Any]


def _freeze(cfg: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(cfg)


_QWEN35_27B_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "dtype": "bfloat16",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x16, filled below
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "tie_word_embeddings": False,
}
_QWEN35_27B_TEXT["layer_types"] = _QWEN35_27B_TEXT["layer_types"] * 16

_QWEN35_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "dtype": "bfloat16",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": _QWEN35_27B_TEXT,
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 5120,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    },
}

_QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "torch_dtype": "bfloat16",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}

_NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attention_head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "hidden_act": "relu2",
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 8192,
    "vocab_size": 131072,
    "tie_word_embeddings": False,
}

_GRANITE_4_H_TINY: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "torch_dtype": "bfloat16",
    "hidden_size": 1536,
    "intermediate_size": 512,
    "shared_intermediate_size": 1024,
    "num_local_experts": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 40,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"])
    + (["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4),
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "position_embedding_type": "nope",
    "max_position_embeddings": 131072,
    "vocab_size": 100352,
    "tie_word_embeddings": True,
}

_JAMBA_MINI: dict[str, Any] = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "vocab_size": 65536,
    "tie_word_embeddings": False,
}

_GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "torch_dtype": "bfloat16",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "attention_bias": True,
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "rope_theta": 150000,
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 7.0,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
}

_GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "torch_dtype": "bfloat16",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    # transformers derives these from sliding_window_pattern; written out for clarity.
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
    ],
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "vocab_size": 262144,
}

_FALCON_H1_7B: dict[str, Any] = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "torch_dtype": "bfloat16",
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "num_hidden_layers": 44,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_d_ssm": 3072,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 128,
    "max_position_embeddings": 262144,
    "vocab_size": 130048,
    "tie_word_embeddings": False,
}

_HF = "https://huggingface.co/{}/blob/main/config.json"

#: The presets by name (read-only).
PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            Preset(
                "qwen3.5-27b",
                "Qwen3.5-27B: 48 gated-delta-net + 16 full-attention layers",
                _HF.format("Qwen/Qwen3.5-27B"),
                _freeze(_QWEN35_27B),
            ),
            Preset(
                "qwen3-next-80b-a3b",
                "Qwen3-Next-80B-A3B: 36 GDN + 12 full attention, MoE",
                _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct"),
                _freeze(_QWEN3_NEXT_80B),
            ),
            Preset(
                "nemotron-h-8b",
                "Nemotron-H-8B: 24 mamba-2 + 4 attention layers",
                _HF.format("nvidia/Nemotron-H-8B-Base-8K"),
                _freeze(_NEMOTRON_H_8B),
            ),
            Preset(
                "granite-4.0-h-tiny",
                "Granite-4.0-H-Tiny: 36 mamba-2 + 4 attention, MoE",
                _HF.format("ibm-granite/granite-4.0-h-tiny"),
                _freeze(_GRANITE_4_H_TINY),
            ),
            Preset(
                "jamba-mini-1.5",
                "Jamba-Mini-1.5: 28 mamba-1 + 4 attention layers, MoE",
                _HF.format("ai21labs/AI21-Jamba-Mini-1.5"),
                _freeze(_JAMBA_MINI),
            ),
            Preset(
                "falcon-h1-7b",
                "Falcon-H1-7B: 44 layers, attention and mamba-2 side by side in each",
                _HF.format("tiiuae/Falcon-H1-7B-Instruct"),
                _freeze(_FALCON_H1_7B),
            ),
            Preset(
                "gpt-oss-20b",
                "gpt-oss-20b: 12 sliding-window (128) + 12 full attention",
                _HF.format("openai/gpt-oss-20b"),
                _freeze(_GPT_OSS_20B),
            ),
            Preset(
                "gemma-3-1b",
                "Gemma-3-1B: 22 sliding-window (512) + 4 full attention",
                _HF.format("google/gemma-3-1b-it"),
                _freeze(_GEMMA3_1B),
            ),
        )
    }
)

#: The preset the CLI uses when none is named.
DEFAULT_PRESET = "qwen3.5-27b"


def _lookup(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError("preset", name, "unknown preset", f"use one of {sorted(PRESETS)}")
    return PRESETS[name]


def preset_config(name: str) -> dict[str, Any]:
    """A fresh, mutable copy of preset ``name``'s config.json dict.

    Pure: a deep copy, so mutating it never changes the preset. Refusal: :class:`ConfigError`
    (field ``preset``) for an unknown name.
    """
    return copy.deepcopy(dict(_lookup(name).config))


# Layers kept by tiny_config: one period of each preset's pattern (every kind present).
_TINY_LAYERS = {
    "qwen3.5-27b": 4,
    "qwen3-next-80b-a3b": 4,
    "nemotron-h-8b": 9,  # M-M-M-M*- : 4 mamba, 1 attention
    "granite-4.0-h-tiny": 8,  # 5 mamba, 1 attention, 2 mamba
    "jamba-mini-1.5": 8,
    "falcon-h1-7b": 2,  # every layer has both kinds
    "gpt-oss-20b": 4,
    "gemma-3-1b": 8,  # 5 sliding, 1 full, 2 sliding
}


def _truncate_text(cfg: dict[str, Any], n: int) -> None:
    cfg["num_hidden_layers"] = n
    for key in ("layer_types", "hybrid_override_pattern"):
        if key in cfg:
            cfg[key] = cfg[key][:n]


def tiny_config(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """Preset ``name`` cut to its first ``num_layers`` layers (default: one pattern period).

    Per-layer dims, dtype and the layer pattern's prefix are kept; MoE expert counts are cut to
    a few experts, which no KV cache depends on, and a vision tower to one block, so vLLM builds
    the model quickly. Pure: a fresh dict, the preset never changes. Refusal:
    :class:`ConfigError`, field ``preset`` (unknown name) or ``num_layers`` (not an int from 1
    to the preset's layer count).
    """
    cfg = preset_config(name)
    n = _TINY_LAYERS[name] if num_layers is None else num_layers
    full = cfg.get("text_config", cfg)["num_hidden_layers"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= full:
        raise ConfigError("num_layers", n, f"must be in 1..{full}", "give fewer layers")
    text = cfg.get("text_config", cfg)
    _truncate_text(text, n)
    for key in ("num_experts", "num_local_experts"):
        if key in text:
            text[key] = 4
    for key in ("num_experts_per_tok", "experts_per_token"):
        if key in text:
            text[key] = min(text[key], 2)
    if "vision_config" in cfg:
        cfg["vision_config"]["depth"] = 1
    return cfg
