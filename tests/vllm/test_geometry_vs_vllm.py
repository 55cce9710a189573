"""Differential test: spec/layout.py against vLLM 0.33's own KV-cache planning.

Every preset, cut to a few layers (``tiny_config``: same per-layer dims and pattern), is written
as a config.json; ``_geometry_oracle.py`` builds it with vLLM's loader and runs vLLM's platform
block-size update, per-layer specs and ``EngineCore._initialize_kv_caches``, one subprocess per
platform (they run side by side, once per session). The spec must give the same groups, block
and page sizes, padding, scheduler and hash block sizes and cache-hit alignment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spec.kinds import GroupKind, MambaCacheMode
from spec.layout import Layout, LayoutSettings, derive_layout, model_from_config
from spec.platforms import PLATFORMS
from spec.presets import PRESETS, tiny_config

pytestmark = pytest.mark.vllm

ORACLE = Path(__file__).parent / "_geometry_oracle.py"
MAX_MODEL_LEN = 4096
MODES = ("align", "none")
# Explicit --block-size cases: (preset, platform, mode, block_size).
BLOCK_SIZE_CASES = (
    ("qwen3-next-80b-a3b", "cuda-sm90", "align", 128),
    ("nemotron-h-8b", "cuda-sm90", "none", 32),
    ("gemma-3-1b", "cuda-sm90", "align", 64),
    ("jamba-mini-1.5", "cpu", "align", 256),
    # Off the CPU's 32-token kernel block: vLLM keeps them with a warning (spec.platforms).
    ("gpt-oss-20b", "cpu", "align", 16),
    ("gpt-oss-20b", "cpu", "align", 48),
    ("falcon-h1-7b", "cpu", "align", 16),
    ("falcon-h1-7b", "cpu", "none", 16),
    ("jamba-mini-1.5", "cpu-avx512bf16", "align", 16),
)
CPU_BLOCK_WARNING = "prefers block_size is multiples of"  # vLLM 0.33's text, platforms/cpu.py
SPEC_NAMES = {
    "FullAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.SLIDING,
    "MambaSpec": GroupKind.MAMBA,
}


def _cases(config_dirs: dict[str, str], platform: str) -> list[dict[str, Any]]:
    cases = [
        {
            "config_dir": config_dirs[name],
            "max_model_len": MAX_MODEL_LEN,
            "cache_mode": mode,
            "block_size": None,
        }
        for name in PRESETS
        for mode in MODES
    ]
    cases += [
        {
            "config_dir": config_dirs[name],
            "max_model_len": MAX_MODEL_LEN,
            "cache_mode": mode,
            "block_size": block,
        }
        for name, plat, mode, block in BLOCK_SIZE_CASES
        if plat == platform
    ]
    return cases


@pytest.fixture(scope="session")
def vllm_geometry(
    vllm_module: object,
    vllm_subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, str, str, int | None], dict[str, Any]]:
    """vLLM's answer for every (preset, platform, mode, block_size), measured once."""
    root = tmp_path_factory.mktemp("presets")
    config_dirs = {}
    for name in PRESETS:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(tiny_config(name)))
        config_dirs[name] = str(root / name)
    by_dir = {v: k for k, v in config_dirs.items()}
    procs = {
        platform: subprocess.Popen(
            [sys.executable, str(ORACLE), platform],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=vllm_subprocess_env,
        )
        for platform in PLATFORMS
    }
    answers = {}
    for platform, proc in procs.items():
        out, err = proc.communicate(json.dumps(_cases(config_dirs, platform)), timeout=420)
        assert proc.returncode == 0, f"{platform} oracle failed:\n{err[-4000:]}"
        for result in json.loads(out):
            if "case" in result:
                case = result["case"]
                key = (by_dir[case["config_dir"]], platform, case["cache_mode"], case["block_size"])
                answers[key] = result
    return answers


def _spec_layout(name: str, platform: str, mode: str, block_size: int | None) -> Layout:
    settings = LayoutSettings(
        max_model_len=MAX_MODEL_LEN, block_size=block_size, cache_mode=mode, platform=platform
    )
    return derive_layout(model_from_config(tiny_config(name)), settings)


def _spec_group(group: Any) -> dict[str, Any]:
    out = {
        "kind": group.kind,
        "layer_indices": list(group.layer_indices),
        "block_size": group.block_size,
        "page_size_bytes": group.page_size_bytes,
        "real_page_size_bytes": group.real_page_size_bytes,
        "padding_bytes": group.padding_bytes,
        "prefix_cacheable": group.prefix_cacheable,
    }
    if group.kind is GroupKind.SLIDING:
        out["sliding_window"] = group.sliding_window
        out["extra_retained_tokens"] = group.extra_retained_tokens
    if group.kind is GroupKind.MAMBA:
        out["shapes"] = [list(s) for s in group.mamba_shapes]
        out["dtypes"] = list(group.mamba_dtypes)
    return out


def _vllm_group(group: dict[str, Any]) -> dict[str, Any]:
    out = {
        "kind": SPEC_NAMES.get(group["spec"], group["spec"]),
        "padding_bytes": group["page_size_bytes"] - group["real_page_size_bytes"],
        **{
            k: group[k]
            for k in (
                "layer_indices",
                "block_size",
                "page_size_bytes",
                "real_page_size_bytes",
                "prefix_cacheable",
            )
        },
    }
    for key in ("sliding_window", "extra_retained_tokens", "shapes", "dtypes"):
        if key in group:
            out[key] = group[key]
    return out


def _compare(answer: dict[str, Any], layout: Layout) -> None:
    assert "error" not in answer, answer.get("error")
    assert [_spec_group(g) for g in layout.groups] == [_vllm_group(g) for g in answer["groups"]]
    assert layout.block_size == answer["block_size"]
    assert layout.scheduler_block_size == answer["scheduler_block_size"]
    assert layout.hash_block_size == answer["hash_block_size"]
    assert layout.hash_block_size == answer["kv_config_hash_block_size"]
    assert layout.cache_hit_alignment_tokens == answer["cache_hit_alignment_tokens"]
    if layout.mamba_block_size is not None:
        assert layout.mamba_block_size == answer["mamba_block_size"]
        assert layout.cache_mode == MambaCacheMode(answer["mamba_cache_mode"])
    # The spec warns about the block size exactly when vLLM does.
    vllm_warned = any(CPU_BLOCK_WARNING in w for w in answer["warnings"])
    assert bool(layout.warnings) == vllm_warned, (layout.warnings, answer["warnings"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_geometry_matches_vllm(
    vllm_geometry: dict[Any, dict[str, Any]], name: str, platform: str, mode: str
) -> None:
    _compare(vllm_geometry[(name, platform, mode, None)], _spec_layout(name, platform, mode, None))


@pytest.mark.parametrize(("name", "platform", "mode", "block_size"), BLOCK_SIZE_CASES)
def test_user_block_size_geometry_matches_vllm(
    vllm_geometry: dict[Any, dict[str, Any]], name: str, platform: str, mode: str, block_size: int
) -> None:
    answer = vllm_geometry[(name, platform, mode, block_size)]
    _compare(answer, _spec_layout(name, platform, mode, block_size))


def test_platforms_really_differ_in_vllm(vllm_geometry: dict[Any, dict[str, Any]]) -> None:
    """Guard: the emulated H100 and the CPU platform take different paths inside vLLM.

    Qwen3-Next in align mode: the H100's FlashInfer GDN prefill adds a 64-token alignment (576);
    the CPU platform asks for 128-token blocks (640); a CPU with AVX-512 BF16 keeps the SSM state
    in float32 (1152). In none mode the H100 needs no 64-token alignment (544).
    """
    block = {
        (p, m): vllm_geometry[("qwen3-next-80b-a3b", p, m, None)]["groups"][-1]["block_size"]
        for p in PLATFORMS
        for m in MODES
    }
    assert block[("cuda-sm90", "align")] == 576
    assert block[("cpu", "align")] == 640
    assert block[("cpu-avx512bf16", "align")] == 1152
    assert block[("cuda-sm90", "none")] == 544


def test_cpu_block_size_off_the_kernel_block_really_rounds_up_in_vllm(
    vllm_geometry: dict[Any, dict[str, Any]],
) -> None:
    """Guard: vLLM itself keeps a CPU --block-size 16 with its warning and ends at 32 (gpt-oss),
    pads the sliding group for 48, and aligns Falcon-H1 past it; the comparisons above then
    check the spec against these answers."""
    answer = vllm_geometry[("gpt-oss-20b", "cpu", "align", 16)]
    assert any(CPU_BLOCK_WARNING in w for w in answer["warnings"])
    assert [g["block_size"] for g in answer["groups"]] == [32, 32]
    answer = vllm_geometry[("gpt-oss-20b", "cpu", "align", 48)]
    assert [g["block_size"] for g in answer["groups"]] == [32, 48]
    assert answer["hash_block_size"] == 16
    answer = vllm_geometry[("falcon-h1-7b", "cpu", "align", 16)]
    assert {g["block_size"] for g in answer["groups"]} == {1568}


def test_falcon_h1_is_parallel_in_vllm(vllm_geometry: dict[Any, dict[str, Any]]) -> None:
    """Guard: vLLM builds Falcon-H1's attention and mamba-2 mixer in every layer, the mamba
    branch of layer i under index n + i (tiny config: n = 2), in both cache modes."""
    for platform in PLATFORMS:
        for mode in MODES:
            groups = vllm_geometry[("falcon-h1-7b", platform, mode, None)]["groups"]
            assert [(g["spec"], g["layer_indices"]) for g in groups] == [
                ("FullAttentionSpec", [0, 1]),
                ("MambaSpec", [2, 3]),
            ]
            assert groups[1]["mamba_type"] == "MAMBA2"
