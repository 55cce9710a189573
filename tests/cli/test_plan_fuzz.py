"""Fuzz `hybridkv plan` inputs: a plan or a named config error, never any other exception."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cli.plan import build_plan
from hybridkv.errors import HybridKVConfigError
from spec.errors import ConfigError
from spec.presets import PRESETS, preset_config

_ints = st.one_of(
    st.none(),
    st.integers(min_value=-4, max_value=300_000),
    st.sampled_from([16, 32, 64, 128, 512, 544, 576, 1024, 4096]),
    st.booleans(),
)
_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70_000),
    st.text(max_size=4),
    st.lists(st.integers(0, 3), max_size=3),
)

EXAMPLES = settings().max_examples * 2


def _plan_or_named_error(config: dict[str, Any], **kwargs: Any) -> None:
    try:
        plan = build_plan(config, source="fuzz", **kwargs)
    except (ConfigError, HybridKVConfigError) as err:
        assert err.field, err
        assert str(err).startswith(f"{err.field}="), str(err)
        return
    assert plan["groups"], plan
    if plan["offload"] is not None:
        assert plan["offload"]["claim_unit"] % plan["offload"]["chunk_size"] == 0


@settings(max_examples=EXAMPLES)
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    max_model_len=_ints,
    block_size=_ints,
    cache_mode=st.sampled_from(["align", "none", "all", ""]),
    dtype=st.sampled_from(["auto", "bfloat16", "float16", "float32", "fp8", "int3"]),
    tp=st.one_of(st.integers(-1, 9), st.booleans()),
    platform=st.sampled_from(["cuda-sm90", "cpu", "cpu-avx512bf16", "tpu"]),
    chunk_size=_ints,
)
def test_settings_fuzz(preset: str, **kwargs: Any) -> None:
    _plan_or_named_error(preset_config(preset), **kwargs)


@settings(max_examples=EXAMPLES)
@given(preset=st.sampled_from(sorted(PRESETS)), data=st.data())
def test_config_fuzz(preset: str, data: st.DataObject) -> None:
    config = preset_config(preset)
    text = config.get("text_config", config)
    for key in data.draw(st.lists(st.sampled_from(sorted(text)), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            del text[key]
        else:
            text[key] = data.draw(_junk)
    _plan_or_named_error(config, max_model_len=data.draw(st.sampled_from([None, 8192])))
