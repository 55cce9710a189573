"""A hybrid model's KV-relevant description, read from its Hugging Face ``config.json``.

Only the fields that decide KV-cache geometry are read, under the names each architecture's
config.json uses and with the meaning vLLM 0.33's model code gives them (``models/<arch>.py``).
A missing field raises :class:`~spec.errors.ConfigError` naming ``config.json:<field>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.mamba_state import DTYPE_BYTES, GdnDims, Mamba1Dims, Mamba2Dims, MambaDims

__all__ = [
    "MAX_LAYERS",
    "SUPPORTED_ARCHITECTURES",
    "KVLayer",
    "ModelDescription",
    "model_from_config",
]


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer that keeps KV cache or recurrent state.

    ``sliding_window`` is the window in tokens of a ``SLIDING`` layer and ``None`` for the other
    kinds (they have no window).
    """

    index: int
    kind: GroupKind
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What geometry needs to know about a model.

    Attributes:
        architecture: the config.json architecture name vLLM resolves.
        layers: the layers with a KV cache or state, in the order of vLLM's layer index (the
            integer in the layer's name; MLP-only layers are absent). A parallel hybrid
            (Falcon-H1) has two per decoder layer, each under its own index.
        num_attention_heads / num_kv_heads / head_dim: attention dims (all attention layers
            share them in the supported architectures).
        mamba: the recurrent dims, or ``None`` for a model without mamba layers.
        dtype: the checkpoint dtype (``torch_dtype`` / ``dtype``).
        ssm_dtype: the temporal-state dtype vLLM resolves ``--mamba-ssm-cache-dtype auto`` to for
            this architecture: ``"auto"`` (same as the conv state) or a dtype name.
    """

    architecture: str
    layers: tuple[KVLayer, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    mamba: MambaDims | None
    dtype: str
    ssm_dtype: str

    @property
    def is_hybrid(self) -> bool:
        """vLLM's ``is_hybrid``: attention and mamba layers together."""
        return self.mamba is not None


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(
            f"config.json:{key}",
            None,
            "the field is missing",
            "give the model's published config.json, which has it",
        )
    return cfg[key]


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"config.json:{key}",
            value,
            "must be a positive integer",
            f"set {key} to the integer of the model's published config.json",
        )
    return value


def _dtype(cfg: Mapping[str, Any]) -> str:
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if not isinstance(value, str) or value not in DTYPE_BYTES:
        raise ConfigError(
            "config.json:torch_dtype", value, "unsupported dtype", f"use one of {list(DTYPE_BYTES)}"
        )
    return str(value)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    for key in ("head_dim", "attention_head_dim"):
        if cfg.get(key) is not None:
            return _int(cfg, key)
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            "config.json:num_attention_heads",
            heads,
            f"does not divide hidden_size {hidden}, so there is no head_dim",
            "give head_dim explicitly or fix num_attention_heads",
        )
    return hidden // heads


def _ssm_dtype(cfg: Mapping[str, Any], key: str, default: str) -> str:
    """The SSM state dtype field ``key`` (``default`` when absent): ``auto`` or a known dtype."""
    value = cfg.get(key) or default
    if not isinstance(value, str) or (value != "auto" and value not in DTYPE_BYTES):
        raise ConfigError(
            f"config.json:{key}",
            value,
            "unsupported dtype",
            f"use auto or one of {list(DTYPE_BYTES)}",
        )
    return value


def _types(cfg: Mapping[str, Any], key: str, n: int, known: Sequence[str]) -> Sequence[str]:
    """``key``'s per-layer type names; each must be one of ``known`` (vLLM refuses the rest)."""
    types = _get(cfg, key)
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigError(
            f"config.json:{key}",
            types,
            f"must list one type per layer ({n}, num_hidden_layers)",
            f"give {n} names, each one of {', '.join(known)}",
        )
    for i, name in enumerate(types):
        if not isinstance(name, str) or name not in known:
            raise ConfigError(
                f"config.json:{key}[{i}]",
                name,
                "is not a layer type this architecture has",
                f"use one of {', '.join(known)}",
            )
    return list(types)


def _layers(kinds: Sequence[GroupKind | None], window: int | None = None) -> tuple[KVLayer, ...]:
    return tuple(
        KVLayer(i, k, window if k is GroupKind.SLIDING else None)
        for i, k in enumerate(kinds)
        if k is not None
    )


def _describe(
    arch: str,
    cfg: Mapping[str, Any],
    layers: tuple[KVLayer, ...],
    mamba: MambaDims | None,
    *,
    ssm_dtype: str = "auto",
    dtype_cfg: Mapping[str, Any] | None = None,
) -> ModelDescription:
    return ModelDescription(
        architecture=arch,
        layers=layers,
        num_attention_heads=_int(cfg, "num_attention_heads"),
        num_kv_heads=_int(cfg, "num_key_value_heads"),
        head_dim=_head_dim(cfg),
        mamba=mamba,
        dtype=_dtype(cfg if dtype_cfg is None else dtype_cfg),
        ssm_dtype=ssm_dtype,
    )


def _qwen_gdn(arch: str, cfg: Mapping[str, Any], top: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    if cfg.get("layer_types") is not None:
        types = _types(cfg, "layer_types", n, ("linear_attention", "full_attention"))
    else:
        interval = _int(cfg, "full_attention_interval")
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    kinds = [GroupKind.MAMBA if t == "linear_attention" else GroupKind.FULL for t in types]
    mamba = GdnDims(
        num_k_heads=_int(cfg, "linear_num_key_heads"),
        num_v_heads=_int(cfg, "linear_num_value_heads"),
        head_k_dim=_int(cfg, "linear_key_head_dim"),
        head_v_dim=_int(cfg, "linear_value_head_dim"),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim"),
    )
    # Qwen3.5 resolves an `auto` SSM dtype to the text config's mamba_ssm_dtype
    # (models/config.py Qwen3_5ForConditionalGenerationConfig); Qwen3-Next keeps `auto`.
    ssm = _ssm_dtype(cfg, "mamba_ssm_dtype", "auto") if arch.startswith("Qwen3_5") else "auto"
    # A multimodal wrapper's top-level dtype wins over its text config's, as in vLLM.
    has_top_dtype = top.get("dtype") or top.get("torch_dtype")
    return _describe(
        arch, cfg, _layers(kinds), mamba, ssm_dtype=ssm, dtype_cfg=top if has_top_dtype else cfg
    )


def _qwen3_next(cfg: Mapping[str, Any]) -> ModelDescription:
    return _qwen_gdn("Qwen3NextForCausalLM", cfg, cfg)


def _qwen3_5(arch: str) -> Callable[[Mapping[str, Any]], ModelDescription]:
    def parse(cfg: Mapping[str, Any]) -> ModelDescription:
        text = _get(cfg, "text_config") if "ConditionalGeneration" in arch else cfg
        if not isinstance(text, Mapping):
            raise ConfigError(
                "config.json:text_config",
                text,
                "must be an object",
                "give the model's published config.json, which has it",
            )
        return _qwen_gdn(arch, text, cfg)

    return parse


def _nemotron_h(cfg: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    pattern = _get(cfg, "hybrid_override_pattern")
    # M: mamba-2 mixer, *: attention, - and E: MLP / MoE only (no cache).
    table = {"M": GroupKind.MAMBA, "*": GroupKind.FULL, "-": None, "E": None}
    if not isinstance(pattern, str) or len(pattern) != n or not set(pattern) <= set(table):
        raise ConfigError(
            "config.json:hybrid_override_pattern",
            pattern,
            f"must be a string of {n} characters (num_hidden_layers), each M, *, - or E",
            "write one character per layer: M mamba, * attention, - MLP, E MoE",
        )
    if not set(pattern) & {"M", "*"}:
        raise ConfigError(
            "config.json:hybrid_override_pattern",
            pattern,
            "has no mamba (M) or attention (*) layer, so the model keeps no KV cache",
            "give the model's published pattern, with its M and * layers",
        )
    heads, head_dim = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim")
    mamba = Mamba2Dims(
        intermediate_size=heads * head_dim,
        n_groups=_int(cfg, "n_groups"),
        num_heads=heads,
        head_dim=head_dim,
        state_size=_int(cfg, "ssm_state_size"),
        conv_kernel=_int(cfg, "conv_kernel"),
    )
    # NemotronHForCausalLMConfig: `auto` becomes the config's mamba_ssm_cache_dtype or float32.
    ssm = _ssm_dtype(cfg, "mamba_ssm_cache_dtype", "float32")
    return _describe(
        "NemotronHForCausalLM", cfg, _layers([table.get(c) for c in pattern]), mamba, ssm_dtype=ssm
    )


def _granite_h(cfg: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    types = _types(cfg, "layer_types", n, ("mamba", "attention"))
    kinds = [GroupKind.MAMBA if t == "mamba" else GroupKind.FULL for t in types]
    mamba = Mamba2Dims(
        intermediate_size=_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"),
        n_groups=_int(cfg, "mamba_n_groups"),
        num_heads=_int(cfg, "mamba_n_heads"),
        head_dim=_int(cfg, "mamba_d_head"),
        state_size=_int(cfg, "mamba_d_state"),
        conv_kernel=_int(cfg, "mamba_d_conv"),
    )
    return _describe("GraniteMoeHybridForCausalLM", cfg, _layers(kinds), mamba)


def _jamba(cfg: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    period, offset = _int(cfg, "attn_layer_period"), _get(cfg, "attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        # A bare int() accepted "2" and crashed on "" or [] with a plain ValueError.
        raise ConfigError(
            "config.json:attn_layer_offset",
            offset,
            f"must be an integer in [0, attn_layer_period={period})",
            "give the model's published config.json, which has it",
        )
    kinds = [GroupKind.FULL if i % period == offset else GroupKind.MAMBA for i in range(n)]
    mamba = Mamba1Dims(
        intermediate_size=_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"),
        state_size=_int(cfg, "mamba_d_state"),
        conv_kernel=_int(cfg, "mamba_d_conv"),
    )
    return _describe("JambaForCausalLM", cfg, _layers(kinds), mamba)


def _falcon_h1_inner(cfg: Mapping[str, Any]) -> int:
    # An explicit null means mamba_expand * hidden_size (models/falcon_h1.py); a missing key
    # would take transformers' class default (1024), which no published config relies on.
    if "mamba_d_ssm" in cfg and cfg["mamba_d_ssm"] is None:
        return _int(cfg, "mamba_expand") * _int(cfg, "hidden_size")
    return _int(cfg, "mamba_d_ssm")


def _falcon_h1(cfg: Mapping[str, Any]) -> ModelDescription:
    """Falcon-H1: a parallel hybrid, attention and a mamba-2 mixer side by side in every layer.

    vLLM registers the mamba branch of decoder layer ``i`` under index ``num_hidden_layers + i``
    (``FalconH1ParallelHybrid``: every attention and SSM layer needs its own index), so the
    description has the attention layers ``0..n-1`` and the mamba layers ``n..2n-1``.
    """
    n = _int(cfg, "num_hidden_layers")
    inner, heads = _falcon_h1_inner(cfg), _int(cfg, "mamba_n_heads")
    head_dim = cfg.get("mamba_d_head")
    # transformers' FalconH1Config resolves "auto" to the inner width over the heads.
    head_dim = inner // heads if head_dim == "auto" else _int(cfg, "mamba_d_head")
    if head_dim * heads != inner:
        raise ConfigError(
            "config.json:mamba_d_head",
            cfg.get("mamba_d_head"),
            f"times mamba_n_heads {heads} must equal mamba_d_ssm {inner}",
            "give the model's published config.json, whose mamba dims agree",
        )
    mamba = Mamba2Dims(
        intermediate_size=inner,
        n_groups=_int(cfg, "mamba_n_groups"),
        num_heads=heads,
        head_dim=head_dim,
        state_size=_int(cfg, "mamba_d_state"),
        conv_kernel=_int(cfg, "mamba_d_conv"),
    )
    layers = tuple(KVLayer(i, GroupKind.FULL) for i in range(n)) + tuple(
        KVLayer(n + i, GroupKind.MAMBA) for i in range(n)
    )
    return _describe("FalconH1ForCausalLM", cfg, layers, mamba)


def _gpt_oss(cfg: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    # models/gpt_oss.py: even layers slide, odd layers attend fully (layer_types agrees).
    kinds = [GroupKind.SLIDING if i % 2 == 0 else GroupKind.FULL for i in range(n)]
    return _describe("GptOssForCausalLM", cfg, _layers(kinds, _int(cfg, "sliding_window")), None)


def _gemma3(cfg: Mapping[str, Any]) -> ModelDescription:
    n = _int(cfg, "num_hidden_layers")
    if cfg.get("layer_types") is not None:
        types = _types(cfg, "layer_types", n, ("sliding_attention", "full_attention"))
    else:
        # transformers' Gemma3TextConfig derives the types from the pattern this way.
        pattern = _int(cfg, "sliding_window_pattern")
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    kinds = [GroupKind.SLIDING if t == "sliding_attention" else GroupKind.FULL for t in types]
    return _describe("Gemma3ForCausalLM", cfg, _layers(kinds, _int(cfg, "sliding_window")), None)


_PARSERS: dict[str, Callable[[Mapping[str, Any]], ModelDescription]] = {
    "Qwen3NextForCausalLM": _qwen3_next,
    "Qwen3_5ForConditionalGeneration": _qwen3_5("Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5("Qwen3_5MoeForConditionalGeneration"),
    "Qwen3_5ForCausalLM": _qwen3_5("Qwen3_5ForCausalLM"),
    "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_h,
    "JambaForCausalLM": _jamba,
    "FalconH1ForCausalLM": _falcon_h1,
    "GptOssForCausalLM": _gpt_oss,
    "Gemma3ForCausalLM": _gemma3,
}

#: The config.json architectures :func:`model_from_config` reads.
SUPPORTED_ARCHITECTURES = tuple(sorted(_PARSERS))


#: More layers than any published model has by two orders of magnitude; a count above it is a
#: typo, and reading it would build one entry per layer before any other check.
MAX_LAYERS = 10_000


def _check_layer_count(config: Mapping[str, Any]) -> None:
    text = config.get("text_config")
    for cfg in (text, config) if isinstance(text, Mapping) else (config,):
        n = cfg.get("num_hidden_layers")
        if isinstance(n, int) and n > MAX_LAYERS:
            raise ConfigError(
                "config.json:num_hidden_layers",
                n,
                f"is more than {MAX_LAYERS} layers",
                "give the model's published config.json, which has its real layer count",
            )


def model_from_config(config: Mapping[str, Any]) -> ModelDescription:
    """Read a model description from a Hugging Face config.json mapping.

    Pre: ``config`` is the parsed config.json of a supported architecture.
    Post: the description vLLM 0.33 would build its KV cache specs from.
    Raises ConfigError (nothing else changes) naming ``config.json:<field>`` for a missing or
    malformed field, or ``config.json:architectures`` listing the supported ones.
    """
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, (list, tuple)) and archs else None
    if not isinstance(arch, str) or arch not in _PARSERS:
        raise ConfigError(
            "config.json:architectures",
            archs,
            "not a hybrid architecture the geometry model knows",
            f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    _check_layer_count(config)
    return _PARSERS[str(arch)](config)
