"""``hybridkv plan``: explain a hybrid model's KV-cache geometry and its offload plan.

The geometry comes from the formal model (:func:`spec.layout.derive_layout`, checked against
vLLM 0.33's own planning in ``nox -s vllm``); the offload plan from the optimized planner
(:class:`hybridkv.planner.HybridOffloadPlanner`). This module only gathers, decides the
recommendation and prints; the JSON form is a stable schema (``schema_version``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind as LibKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.simulator.chunking import ChunkOption, chunk_options, recommend
from hybridkv.simulator.flags import require_at_least
from hybridkv.simulator.model_config import load_model_config
from spec.layout import Layout, LayoutSettings, derive_layout, model_from_config
from spec.platforms import DEFAULT_PLATFORM, PLATFORMS
from spec.presets import DEFAULT_PRESET, PRESETS

__all__ = ["SCHEMA_VERSION", "add_parser", "build_plan", "run"]

SCHEMA_VERSION = 1


def add_parser(sub: Any) -> None:
    """Register ``plan`` on the subcommand set of the top-level parser."""
    p = sub.add_parser(
        "plan",
        help="explain a hybrid model's KV-cache geometry and offload plan",
        description="Derive the KV cache groups vLLM 0.33 builds for a model and plan offload.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", metavar="NAME", help=f"a built-in model (default {DEFAULT_PRESET})"
    )
    src.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    src.add_argument("--list-presets", action="store_true", help="list the built-in models")
    p.add_argument("--max-model-len", type=int, help="default: the model's context length")
    p.add_argument("--block-size", type=int, help="vLLM --block-size (default: the platform's)")
    p.add_argument(
        "--cache-mode",
        choices=["align", "none"],
        default="align",
        help="mamba cache mode: align = prefix caching on (vLLM's default)",
    )
    p.add_argument("--dtype", default="auto", help="KV cache dtype (default: the checkpoint's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--platform",
        default=DEFAULT_PLATFORM,
        choices=sorted(PLATFORMS),
        help=f"whose kernel alignment to assume (default {DEFAULT_PLATFORM})",
    )
    p.add_argument("--chunk-size", type=int, help="offload chunk in tokens (default: recommended)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``hybridkv plan``; returns the exit code (config errors propagate to main)."""
    if args.list_presets:
        return _list_presets(args.json)
    for flag, value, example in (
        ("--max-model-len", args.max_model_len, 32768),
        ("--block-size", args.block_size, 16),
        ("--tp", args.tp, 1),
        ("--chunk-size", args.chunk_size, 1024),
    ):
        require_at_least(flag, value, 1, example)
    source, config = load_model_config(args.preset, args.config)
    plan = build_plan(
        config,
        source=source,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        cache_mode=args.cache_mode,
        dtype=args.dtype,
        tp=args.tp,
        platform=args.platform,
        chunk_size=args.chunk_size,
    )
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        from hybridkv.cli.plan_render import render

        render(plan)
    return 0


def build_plan(
    config: Mapping[str, Any],
    *,
    source: str,
    max_model_len: int | None = None,
    block_size: int | None = None,
    cache_mode: str = "align",
    dtype: str = "auto",
    tp: int = 1,
    platform: str = DEFAULT_PLATFORM,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """The plan of one model as a JSON-ready dict (schema ``SCHEMA_VERSION``).

    Raises the spec's ConfigError or HybridKVConfigError naming the field for bad input; a
    default chunk size that makes offload impossible is not an error but ``offload: null``
    with the reason in ``warnings``.
    """
    model = model_from_config(config)
    settings = LayoutSettings(
        max_model_len=_context_length(config) if max_model_len is None else max_model_len,
        block_size=block_size,
        cache_mode=cache_mode,  # type: ignore[arg-type]  # the settings accept the string
        dtype=dtype,
        tp=tp,
        platform=platform,
    )
    layout = derive_layout(model, settings)
    options = chunk_options(layout, settings.max_model_len)
    warnings: list[str] = list(layout.warnings)  # what vLLM itself warns about these settings
    offload = _offload(layout, settings.max_model_len, chunk_size, options, warnings)
    requested = block_size or PLATFORMS[platform].default_block_size
    warnings += _traps(layout, settings.max_model_len, requested, offload)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "source": source,
            "architecture": model.architecture,
            "layers_with_kv": len(model.layers),
        },
        "settings": {
            "max_model_len": settings.max_model_len,
            "block_size": block_size,
            "cache_mode": layout.cache_mode.value,
            "dtype": layout.dtype,
            "tp": tp,
        },
        "platform": {
            "name": layout.platform,
            "description": PLATFORMS[layout.platform].description,
        },
        "groups": [_group_json(i, g) for i, g in enumerate(layout.groups)],
        "block_size": layout.block_size,
        "mamba_block_size": layout.mamba_block_size,
        "scheduler_block_size": layout.scheduler_block_size,
        "hash_block_size": layout.hash_block_size,
        "cache_hit_alignment_tokens": layout.cache_hit_alignment_tokens,
        "offload": offload,
        "chunk_options": [o.as_json() for o in options],
        "warnings": warnings,
        "notes": list(layout.notes),
    }


def _offload(
    layout: Layout,
    max_model_len: int,
    chunk_size: int | None,
    options: list[ChunkOption],
    warnings: list[str],
) -> dict[str, Any] | None:
    if chunk_size is None:
        best = recommend(options)
        if best is None:
            warnings.append(_impossible_reason(layout, max_model_len))
            return None
        chunk_size, origin = best.chunk_size, "recommended"
    else:
        origin = "user"
    planner = _planner(layout, chunk_size, max_model_len)
    bytes_per_chunk = _host_bytes_per_chunk(layout, chunk_size)
    return {
        "chunk_size": chunk_size,
        "chunk_size_source": origin,
        "units": list(planner.units),
        "hash_factors": list(planner.hash_factors),
        "splittable": list(planner.splittable),
        "first_storable_chunks": list(planner.first_storable_chunks),
        "claim_unit": planner.claim_unit,
        "shortest_hit_prompt": planner.shortest_hit_prompt,
        "host_bytes_per_chunk": bytes_per_chunk,
        "host_bytes_per_claim_unit": bytes_per_chunk * planner.claim_unit // chunk_size,
        "keys_per_claim_unit": sum(planner.claim_unit // u for u in planner.units),
    }


def _planner(layout: Layout, chunk_size: int, max_model_len: int) -> HybridOffloadPlanner:
    groups = [(LibKind(g.kind.value), g.block_size) for g in layout.groups]
    return HybridOffloadPlanner(groups, layout.hash_block_size, chunk_size, max_model_len)


def _host_bytes_per_chunk(layout: Layout, chunk_size: int) -> int:
    """Host bytes one chunk of ``chunk_size`` tokens occupies, summed over every group.

    A group stores ``real_page_size_bytes`` per layer per block of ``block_size`` tokens
    (padding is not stored), so a chunk holds ``chunk_size / block_size`` of that, whether the
    group's unit splits the block (attention) or spans several chunks (a mamba state).
    """
    total = sum(
        g.num_layers * g.real_page_size_bytes * chunk_size / g.block_size for g in layout.groups
    )
    return math.ceil(total)


def _impossible_reason(layout: Layout, max_model_len: int) -> str:
    try:
        _planner(layout, layout.hash_block_size, max_model_len)
    except HybridKVConfigError as err:
        return f"offload impossible: {err}"
    return "offload impossible: no chunk size fits max_model_len"


def _traps(
    layout: Layout, max_model_len: int, requested_block: int, offload: Mapping[str, Any] | None
) -> list[str]:
    """Warnings about the known traps of hybrid offload for this geometry."""
    found: list[str] = []
    mamba = [g for g in layout.groups if g.kind.value == "mamba"]
    if mamba and layout.cache_mode.value == "none":
        found.append(
            "prefix caching is off for the mamba groups (cache mode none): vLLM keeps one "
            "running state per request, so no prefix can be restored; use --cache-mode align"
        )
    if offload is None:
        return found
    claim = int(offload["claim_unit"])
    if max_model_len % claim:
        found.append(
            f"max_model_len {max_model_len} is not a multiple of the claim unit {claim}: the "
            f"last {max_model_len % claim} tokens of a full-length prompt can never be loaded"
        )
    if mamba and layout.block_size > requested_block:
        found.append(
            f"attention blocks were raised to {layout.block_size} tokens to cover the mamba "
            f"state page: prompts shorter than {offload['shortest_hit_prompt']} tokens never "
            "hit (vLLM #40696)"
        )
    return found


def _group_json(index: int, g: Any) -> dict[str, Any]:
    return {
        "index": index,
        "kind": g.kind.value,
        "num_layers": g.num_layers,
        "block_size": g.block_size,
        "page_size_bytes": g.page_size_bytes,
        "real_page_size_bytes": g.real_page_size_bytes,
        "padding_bytes": g.padding_bytes,
        "sliding_window": g.sliding_window,
        "mamba_shapes": [list(s) for s in g.mamba_shapes],
        "mamba_dtypes": list(g.mamba_dtypes),
    }


def _context_length(config: Mapping[str, Any]) -> int:
    text = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_seq_len"):
        value = text.get(key) if isinstance(text, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise HybridKVConfigError(
        "--max-model-len",
        None,
        "the config has no max_position_embeddings",
        "pass --max-model-len N",
    )


def _list_presets(as_json: bool) -> int:
    rows = [
        {"name": p.name, "description": p.description, "source": p.source} for p in PRESETS.values()
    ]
    if as_json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, "presets": rows}, indent=2))
        return 0
    from hybridkv.cli.plan_render import render_presets

    render_presets(rows, DEFAULT_PRESET)
    return 0
