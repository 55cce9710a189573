"""spec/presets.py: the published layer mixes, sources, copies and the tiny variants."""

from __future__ import annotations

from typing import Any

import pytest

from spec.config_json import KVLayer, model_from_config
from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.presets import DEFAULT_PRESET, PRESETS, preset_config, tiny_config

# Layer mixes as the model cards publish them: (mamba, sliding, full).
PUBLISHED_MIX = {
    "qwen3.5-27b": (48, 0, 16),
    "qwen3-next-80b-a3b": (36, 0, 12),
    "nemotron-h-8b": (24, 0, 4),
    "granite-4.0-h-tiny": (36, 0, 4),
    "jamba-mini-1.5": (28, 0, 4),
    "falcon-h1-7b": (44, 0, 44),  # attention and mamba-2 side by side in each of 44 layers
    "gpt-oss-20b": (0, 12, 12),
    "gemma-3-1b": (0, 22, 4),
}


def _decoder_count(cfg: dict[str, Any]) -> int:
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


def _by_decoder(layers: tuple[KVLayer, ...], n: int) -> list[tuple[int, str, int | None]]:
    return sorted((layer.index % n, layer.kind.value, layer.sliding_window) for layer in layers)


def _mix(cfg: dict[str, object]) -> tuple[int, int, int]:
    kinds = [layer.kind for layer in model_from_config(cfg).layers]
    return tuple(kinds.count(k) for k in (GroupKind.MAMBA, GroupKind.SLIDING, GroupKind.FULL))


def test_at_least_six_presets_with_sources() -> None:
    assert set(PRESETS) == set(PUBLISHED_MIX)
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert preset.source.startswith("https://huggingface.co/")
        assert preset.source.endswith("config.json")
        assert preset.description


@pytest.mark.parametrize("name", sorted(PUBLISHED_MIX))
def test_preset_layer_mix_is_published(name: str) -> None:
    assert _mix(preset_config(name)) == PUBLISHED_MIX[name]


def test_default_preset_is_qwen35_class() -> None:
    assert DEFAULT_PRESET in PRESETS
    model = model_from_config(preset_config(DEFAULT_PRESET))
    assert model.architecture == "Qwen3_5ForConditionalGeneration"
    assert model.is_hybrid


def test_preset_config_is_a_fresh_copy() -> None:
    cfg = preset_config("gpt-oss-20b")
    cfg["num_hidden_layers"] = 1
    cfg["layer_types"].clear()
    assert preset_config("gpt-oss-20b")["num_hidden_layers"] == 24
    assert len(preset_config("gpt-oss-20b")["layer_types"]) == 24


@pytest.mark.parametrize("name", sorted(PUBLISHED_MIX))
def test_tiny_keeps_dims_and_every_kind(name: str) -> None:
    full = model_from_config(preset_config(name))
    tiny = model_from_config(tiny_config(name))
    assert (tiny.num_kv_heads, tiny.head_dim, tiny.mamba, tiny.dtype, tiny.ssm_dtype) == (
        full.num_kv_heads,
        full.head_dim,
        full.mamba,
        full.dtype,
        full.ssm_dtype,
    )
    assert {layer.kind for layer in tiny.layers} == {layer.kind for layer in full.layers}
    # The tiny layers are the full model's first decoder layers, kinds unchanged. A parallel
    # hybrid (Falcon-H1) indexes the mamba branch of decoder layer i as n + i, so compare
    # decoder layers: index mod n.
    n_tiny, n_full = (_decoder_count(c) for c in (tiny_config(name), preset_config(name)))
    assert _by_decoder(tiny.layers, n_tiny) == [
        layer for layer in _by_decoder(full.layers, n_full) if layer[0] < n_tiny
    ]
    assert len(tiny.layers) < len(full.layers)


def test_tiny_layer_count_can_be_chosen() -> None:
    assert len(model_from_config(tiny_config("qwen3-next-80b-a3b", 8)).layers) == 8


@pytest.mark.parametrize(
    ("name", "n", "field"),
    [("nope", None, "preset"), ("gpt-oss-20b", 0, "num_layers"), ("gpt-oss-20b", 25, "num_layers")],
)
def test_bad_preset_requests_name_the_field(name: str, n: int | None, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_config(name, n)
    assert err.value.field == field
