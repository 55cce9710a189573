"""spec/layout.py against geometry computed by hand from vLLM 0.33's formulas.

Every expected number below is derived in the comment above it. The Qwen3-Next block sizes
(576 on an H100 in align mode, 640 on vLLM's CPU platform, 544 in none mode) were also measured
with vLLM 0.33's own code.
"""

from __future__ import annotations

import pytest

from spec.errors import ConfigError
from spec.kinds import GroupKind, MambaCacheMode
from spec.layout import PLATFORMS, LayoutSettings, derive_layout, model_from_config
from spec.mamba_state import MambaVariant
from spec.presets import preset_config

LEN = 32768


def layout(name: str, **settings: object):
    return derive_layout(
        model_from_config(preset_config(name)),
        LayoutSettings(max_model_len=settings.pop("max_model_len", LEN), **settings),
    )


# Qwen3-Next-80B-A3B, bf16, tp 1:
#   attention page per token = 2 (K,V) * 2 kv heads * 256 * 2 B = 2048 B
#   GDN conv state (3, 2*16*128 + 32*128) = (3, 8192) -> 24576 * 2 B = 49152 B
#   GDN temporal state (32, 128, 128) -> 524288 * 2 B = 1048576 B; mamba page 1097728 B.
QWEN3_NEXT_MAMBA_PAGE = 49152 + 1048576


def test_qwen3_next_align_on_h100_is_576() -> None:
    # align = lcm(max(16, 16), 64 GDN checkpoint) = 64; cdiv(1097728, 64 * 2048) = 9 -> 576.
    lay = layout("qwen3-next-80b-a3b", platform="cuda-sm90", cache_mode="align")
    assert lay.block_size == 576
    assert lay.mamba_block_size == 576
    assert (lay.scheduler_block_size, lay.hash_block_size) == (576, 576)
    assert lay.cache_hit_alignment_tokens == 576
    # 36 GDN layers and 12 attention layers: group size 12, so 3 mamba groups and 1 full group,
    # mamba group i taking every third GDN layer starting at the i-th.
    assert [g.kind for g in lay.groups] == [GroupKind.MAMBA] * 3 + [GroupKind.FULL]
    gdn = [i for i in range(48) if i % 4 != 3]
    assert [g.layer_indices for g in lay.groups] == [
        tuple(gdn[0::3]),
        tuple(gdn[1::3]),
        tuple(gdn[2::3]),
        tuple(range(3, 48, 4)),
    ]
    for g in lay.groups:
        assert g.block_size == 576
        assert g.page_size_bytes == 576 * 2048 == 1179648
    mamba = lay.groups[0]
    assert mamba.real_page_size_bytes == QWEN3_NEXT_MAMBA_PAGE
    assert mamba.padding_bytes == 1179648 - 1097728 == 81920
    assert mamba.mamba_shapes == ((3, 8192), (32, 128, 128))
    assert mamba.mamba_dtypes == ("bfloat16", "bfloat16")
    assert mamba.mamba_variant is MambaVariant.GDN
    assert lay.groups[3].padding_bytes == 0


def test_qwen3_next_align_on_cpu_is_640() -> None:
    # align = max(32, 128 default) = 128, no GDN alignment: cdiv(1097728, 128 * 2048) = 5.
    lay = layout("qwen3-next-80b-a3b", platform="cpu", cache_mode="align")
    assert lay.block_size == 640
    assert lay.groups[0].page_size_bytes == 640 * 2048
    assert lay.groups[0].padding_bytes == 640 * 2048 - 1097728 == 212992


def test_qwen3_next_on_avx512bf16_cpu_keeps_fp32_state() -> None:
    # Temporal state in float32: 49152 + 524288 * 4 = 2146304 B; cdiv(., 128 * 2048) = 9.
    lay = layout("qwen3-next-80b-a3b", platform="cpu-avx512bf16")
    assert lay.groups[0].mamba_dtypes == ("bfloat16", "float32")
    assert lay.groups[0].real_page_size_bytes == 2146304
    assert lay.block_size == 1152


def test_qwen3_next_none_mode_is_544_and_prefix_caching_off() -> None:
    # align = 16 (no GDN checkpoint in none mode): cdiv(1097728, 16 * 2048) = 34 -> 544.
    # The mamba block is max_model_len; the final block is the smaller, 544.
    # scheduler = lcm(544 = 2^5 * 17, 32768 = 2^15) = 2^15 * 17 = 557056; no prefix caching,
    # so hashes and hits use the scheduler block size.
    lay = layout("qwen3-next-80b-a3b", platform="cuda-sm90", cache_mode="none")
    assert lay.block_size == 544
    assert lay.mamba_block_size == LEN
    assert lay.groups[0].block_size == LEN
    assert lay.groups[3].block_size == 544
    assert lay.groups[0].page_size_bytes == 544 * 2048
    assert lay.scheduler_block_size == 557056
    assert lay.hash_block_size == lay.cache_hit_alignment_tokens == 557056
    assert lay.cache_mode is MambaCacheMode.NONE
    assert any("prefix caching is off" in n for n in lay.notes)


def test_user_block_size_raises_the_alignment() -> None:
    # align = lcm(max(16, 128), 64) = 128; cdiv(1097728, 128 * 2048) = 5 -> 640 > 128.
    lay = layout("qwen3-next-80b-a3b", platform="cuda-sm90", block_size=128)
    assert lay.block_size == 640


def test_tensor_parallel_halves_heads_and_state() -> None:
    # tp 2: 1 kv head -> 1024 B/token; conv (3, 4096), temporal (16, 128, 128):
    # 12288 * 2 + 262144 * 2 = 548864 B; cdiv(548864, 64 * 1024) = 9 -> 576.
    lay = layout("qwen3-next-80b-a3b", tp=2)
    assert lay.groups[0].mamba_shapes == ((3, 4096), (16, 128, 128))
    assert lay.groups[0].real_page_size_bytes == 548864
    assert lay.block_size == 576
    assert lay.groups[3].page_size_bytes == 576 * 1024


def test_qwen35_27b_fp32_state() -> None:
    # 4 kv heads * 256 * 2 * 2 B = 4096 B/token. conv (3, 2*16*128 + 48*128) = (3, 10240):
    # 61440 B; temporal (48, 128, 128) float32 (config mamba_ssm_dtype): 3145728 B.
    # Total 3207168. none: cdiv(., 16 * 4096) = 49 -> 784; align: cdiv(., 64 * 4096) = 13 -> 832.
    none = layout("qwen3.5-27b", cache_mode="none")
    align = layout("qwen3.5-27b", cache_mode="align")
    assert none.groups[0].real_page_size_bytes == 3207168
    assert none.groups[0].mamba_dtypes == ("bfloat16", "float32")
    assert (none.block_size, align.block_size) == (784, 832)
    # 48 GDN + 16 attention layers: 3 mamba groups of 16 and one full group.
    assert [g.num_layers for g in align.groups] == [16, 16, 16, 16]


def test_nemotron_h_mamba2_padding() -> None:
    # 8 kv heads * 128 * 2 * 2 B = 4096 B/token. conv dim 128*64 + 2*8*128 = 10240 -> (3, 10240)
    # = 61440 B; temporal (128, 64, 128) float32 (Nemotron-H default) = 4194304 B; 4255744 B.
    # align 16 (mamba-2 has no prefill checkpoint): cdiv(4255744, 65536) = 65 -> 1040.
    lay = layout("nemotron-h-8b")
    assert lay.block_size == 1040
    assert lay.groups[0].padding_bytes == 1040 * 4096 - 4255744 == 4096
    # 24 mamba and 4 attention layers: group size 4 -> 6 mamba groups and 1 full group.
    assert [g.kind for g in lay.groups] == [GroupKind.MAMBA] * 6 + [GroupKind.FULL]
    # Pattern "M-M-M-M*" (8 chars) then "-M-M-M-M-M*" (11 chars) three times: * at 7, 18, 29, 40.
    assert lay.groups[6].layer_indices == (7, 18, 29, 40)


def test_jamba_mamba1() -> None:
    # head dim 4096 / 32 = 128; 8 kv heads -> 4096 B/token. conv (3, 8192) = 49152 B,
    # temporal (8192, 16) bf16 = 262144 B; 311296 B; cdiv(311296, 65536) = 5 -> 80.
    lay = layout("jamba-mini-1.5")
    assert lay.block_size == 80
    assert lay.groups[0].mamba_shapes == ((3, 8192), (8192, 16))
    assert lay.groups[0].padding_bytes == 80 * 4096 - 311296


def test_granite_group_count() -> None:
    # head dim 1536 / 12 = 128, 4 kv heads -> 2048 B/token. conv dim 3072 + 2*1*128 = 3328:
    # 19968 B; temporal (48, 64, 128) bf16 = 786432 B; 806400 B; cdiv(., 32768) = 25 -> 400.
    lay = layout("granite-4.0-h-tiny")
    assert lay.block_size == 400
    # 36 mamba, 4 attention: group size 4 -> 9 mamba groups + 1 full group.
    assert len(lay.groups) == 10
    assert lay.groups[-1].layer_indices == (5, 15, 25, 35)


def test_gpt_oss_sliding_and_full() -> None:
    # Not hybrid: block 16 on CUDA; 8 kv heads * 64 * 2 * 2 B = 2048 B/token -> 32768 B pages.
    # 12 sliding and 12 full layers: two groups of 12, sliding first (layer 0 slides).
    lay = layout("gpt-oss-20b")
    assert lay.mamba_block_size is None
    assert [(g.kind, g.layer_indices) for g in lay.groups] == [
        (GroupKind.SLIDING, tuple(range(0, 24, 2))),
        (GroupKind.FULL, tuple(range(1, 24, 2))),
    ]
    assert lay.groups[0].sliding_window == 128
    assert lay.groups[0].extra_retained_tokens == 0
    assert lay.groups[1].sliding_window is None
    assert all(g.page_size_bytes == 32768 and g.padding_bytes == 0 for g in lay.groups)
    assert (lay.block_size, lay.scheduler_block_size, lay.hash_block_size) == (16, 16, 16)
    assert lay.cache_hit_alignment_tokens == 16


def test_gemma3_groups_with_padding_layers() -> None:
    # 22 sliding (window 512), 4 full (layers 5, 11, 17, 23). 22 >= 1.5 * 4: group size 4,
    # ceil(22 / 4) = 6 sliding groups; sliding group i takes sliding[i::6].
    lay = layout("gemma-3-1b", platform="cpu")
    sliding = [i for i in range(26) if (i + 1) % 6]
    assert [g.layer_indices for g in lay.groups[:6]] == [tuple(sliding[i::6]) for i in range(6)]
    assert lay.groups[0].layer_indices == (0, 7, 14, 21)
    assert lay.groups[5].layer_indices == (6, 13, 20)  # sliding[5], [11], [17]
    assert lay.groups[6].kind is GroupKind.FULL
    assert lay.groups[6].layer_indices == (5, 11, 17, 23)
    # CPU: block 128; 1 kv head * 256 * 2 * 2 B = 1024 B/token -> 131072 B pages.
    assert lay.block_size == 128
    assert all(g.page_size_bytes == 131072 for g in lay.groups)


# Falcon-H1-7B, bf16, tp 1: attention in all 44 layers and a mamba-2 mixer beside each.
#   attention page per token = 2 * 2 kv heads * 128 * 2 B = 1024 B
#   conv state (3, 3072 + 2*1*256) = (3, 3584) -> 10752 * 2 B = 21504 B
#   temporal state (24, 128, 256) -> 786432 * 2 B = 1572864 B; mamba page 1594368 B.
# H100 align: align = 16, block = 16 * cdiv(1594368, 16 * 1024) = 16 * 98 = 1568.
# CPU align: align = 32 -> 32 * cdiv(1594368, 32 * 1024) = 32 * 49 = 1568 as well; the CPU's
# default 128 -> 128 * cdiv(1594368, 131072) = 128 * 13 = 1664.
FALCON_MAMBA_PAGE = 21504 + 1572864


def test_falcon_h1_is_a_parallel_hybrid() -> None:
    lay = layout("falcon-h1-7b")
    # vLLM indexes the mamba branch of decoder layer i as 44 + i; 44 and 44: one group each.
    assert [(g.kind, g.layer_indices) for g in lay.groups] == [
        (GroupKind.FULL, tuple(range(44))),
        (GroupKind.MAMBA, tuple(range(44, 88))),
    ]
    full, mamba = lay.groups
    assert lay.block_size == full.block_size == mamba.block_size == 1568
    assert full.page_size_bytes == mamba.page_size_bytes == 1568 * 1024
    assert mamba.real_page_size_bytes == FALCON_MAMBA_PAGE
    assert mamba.padding_bytes == 1568 * 1024 - FALCON_MAMBA_PAGE
    assert mamba.mamba_variant is MambaVariant.MAMBA2
    assert mamba.mamba_shapes == ((3, 3584), (24, 128, 256))
    assert mamba.mamba_dtypes == ("bfloat16", "bfloat16")
    assert (lay.scheduler_block_size, lay.hash_block_size) == (1568, 1568)
    assert layout("falcon-h1-7b", platform="cpu").block_size == 1664


def test_falcon_h1_none_mode_keeps_one_state_per_request() -> None:
    # Mamba block = max_model_len; scheduler block = lcm(1568, 32768) = 2^15 * 49 = 1605632.
    lay = layout("falcon-h1-7b", cache_mode="none")
    assert [g.block_size for g in lay.groups] == [1568, LEN]
    assert lay.scheduler_block_size == lay.hash_block_size == 32768 * 49


def test_falcon_h1_mamba_dims_from_auto_and_null_fields() -> None:
    # transformers resolves mamba_d_head "auto" to d_ssm / heads = 3072 / 24 = 128, the
    # published value; vLLM reads a null mamba_d_ssm as mamba_expand * hidden_size = 6144.
    cfg = preset_config("falcon-h1-7b")
    cfg["mamba_d_head"] = "auto"
    assert model_from_config(cfg).mamba == model_from_config(preset_config("falcon-h1-7b")).mamba
    cfg["mamba_d_ssm"] = None
    mamba = model_from_config(cfg).mamba
    assert (mamba.intermediate_size, mamba.head_dim) == (6144, 256)  # type: ignore[union-attr]
    cfg["mamba_d_head"] = 64
    with pytest.raises(ConfigError) as err:
        model_from_config(cfg)
    assert err.value.field == "config.json:mamba_d_head"


# A CPU --block-size off the 32-token kernel block is kept with vLLM's warning; gpt-oss:
#   16: full layers keep 16, sliding layers take their own kernel block max(32, 16//32*32) = 32;
#       the sliding page (32 tokens) is twice the full page, so full scales to 32: all 32.
#   48: sliding takes 48//32*32 = 32, full keeps 48; 32 does not divide 48, so the sliding page
#       is padded to 48 tokens' bytes; final block min(32, 48) = 32, scheduler lcm 96, hash
#       gcd 16, hit alignment 96 (no mamba group). vLLM 0.33 measured the same (tests/vllm).


def test_cpu_block_size_16_ends_as_32_with_a_warning() -> None:
    lay = layout("gpt-oss-20b", platform="cpu", block_size=16)
    assert [g.block_size for g in lay.groups] == [32, 32]
    assert (lay.block_size, lay.scheduler_block_size, lay.hash_block_size) == (32, 32, 32)
    assert len(lay.warnings) == 1
    assert "--block-size 16 is not a multiple of 32" in lay.warnings[0]
    assert "[32]" in lay.warnings[0]


def test_cpu_block_size_48_pads_the_sliding_group() -> None:
    lay = layout("gpt-oss-20b", platform="cpu", block_size=48)
    sliding, full = lay.groups
    assert (sliding.block_size, full.block_size) == (32, 48)
    assert sliding.page_size_bytes == full.page_size_bytes == 48 * 2048
    assert sliding.real_page_size_bytes == 32 * 2048
    assert (lay.block_size, lay.scheduler_block_size, lay.hash_block_size) == (32, 96, 16)
    assert lay.cache_hit_alignment_tokens == 96
    assert "[32, 48]" in lay.warnings[0]


def test_kernel_multiples_and_defaults_do_not_warn() -> None:
    assert layout("gpt-oss-20b", platform="cpu", block_size=64).warnings == ()
    assert layout("gpt-oss-20b", platform="cpu").warnings == ()
    assert layout("falcon-h1-7b", platform="cpu", block_size=16).block_size == 1568


def test_platforms_are_documented_values() -> None:
    sm90 = PLATFORMS["cuda-sm90"]
    assert (sm90.default_block_size, sm90.kernel_block_base, sm90.gdn_checkpoint_alignment) == (
        16,
        16,
        64,
    )
    assert PLATFORMS["cpu"].default_block_size == 128
    assert PLATFORMS["cpu-avx512bf16"].fp32_ssm_state
    assert [p.odd_block_size_warns for p in PLATFORMS.values()] == [False, True, True]
    assert LayoutSettings(max_model_len=8).platform == "cuda-sm90"


# ---- refusals: each names the field the user must fix -------------------------------------


def test_missing_config_field_is_named() -> None:
    cfg = preset_config("qwen3-next-80b-a3b")
    del cfg["linear_num_value_heads"]
    with pytest.raises(ConfigError) as err:
        model_from_config(cfg)
    assert err.value.field == "config.json:linear_num_value_heads"
    assert "config.json:linear_num_value_heads" in str(err.value)


def test_missing_nested_text_config_field_is_named() -> None:
    cfg = preset_config("qwen3.5-27b")
    del cfg["text_config"]["num_key_value_heads"]
    with pytest.raises(ConfigError) as err:
        model_from_config(cfg)
    assert err.value.field == "config.json:num_key_value_heads"


@pytest.mark.parametrize(
    ("name", "key"),
    [("qwen3.5-27b", "mamba_ssm_dtype"), ("nemotron-h-8b", "mamba_ssm_cache_dtype")],
)
@pytest.mark.parametrize("value", [True, [1], "int3"])
def test_ssm_dtype_that_is_no_dtype_is_named(name: str, key: str, value: object) -> None:
    # Found by tests/cli/test_plan_fuzz.py: `true` crashed with KeyError 'True' in the layout.
    cfg = preset_config(name)
    cfg.get("text_config", cfg)[key] = value
    with pytest.raises(ConfigError) as err:
        model_from_config(cfg)
    assert err.value.field == f"config.json:{key}"


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ConfigError) as err:
        model_from_config({"architectures": ["LlamaForCausalLM"]})
    assert err.value.field == "config.json:architectures"
    assert "Qwen3NextForCausalLM" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": True}, "max_model_len"),
        ({"max_model_len": 8, "block_size": 24}, "block_size"),
        ({"max_model_len": 8, "block_size": 0, "platform": "cpu"}, "block_size"),
        ({"max_model_len": 8, "block_size": True}, "block_size"),
        ({"max_model_len": 8, "cache_mode": "all"}, "cache_mode"),
        ({"max_model_len": 8, "dtype": "int8"}, "dtype"),
        ({"max_model_len": 8, "tp": 0}, "tp"),
        ({"max_model_len": 8, "platform": "tpu"}, "platform"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        LayoutSettings(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}=")


def test_cache_mode_string_is_stored_as_enum() -> None:
    assert LayoutSettings(max_model_len=8, cache_mode="none").cache_mode is MambaCacheMode.NONE


@pytest.mark.parametrize("tp", [3, 32])
def test_tp_that_does_not_divide_heads_is_refused(tp: int) -> None:
    # Qwen3-Next: 16 attention heads, 2 kv heads; 3 divides neither, 32 exceeds 16 heads.
    model = model_from_config(preset_config("qwen3-next-80b-a3b"))
    with pytest.raises(ConfigError) as err:
        derive_layout(model, LayoutSettings(max_model_len=LEN, tp=tp))
    assert err.value.field == "tp"
