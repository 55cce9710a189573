"""Where a command's model comes from: a built-in preset or a user's config.json.

``hybridkv plan`` and ``hybridkv simulate`` take the same ``--preset NAME | --config PATH``;
this is the one place that reads them, with errors that name the flag, the file and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.json_input import decode_utf8, parse_json
from spec.presets import DEFAULT_PRESET, preset_config

__all__ = ["MAX_CONFIG_BYTES", "load_model_config"]

MAX_CONFIG_BYTES = 16 << 20  # published config.json files are kilobytes; refuse before reading


def load_model_config(preset: str | None, config: str | None) -> tuple[str, Mapping[str, Any]]:
    """``(source, config.json dict)``: the file at ``config`` (or ``config/config.json``), else
    the preset (the default preset when both are ``None``).

    Refusal: an unreadable file, one over :data:`MAX_CONFIG_BYTES`, bytes that are not UTF-8,
    text that is not JSON (deep nesting and endless integers included) or a non-object raises
    :class:`HybridKVConfigError` (field ``--config``); an unknown preset the spec's
    ``ConfigError`` (field ``preset``). Frame: nothing changes.
    """
    if config is None:
        name = preset or DEFAULT_PRESET
        return f"preset:{name}", preset_config(name)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise HybridKVConfigError(
                "--config",
                str(path),
                f"is {size} bytes; a Hugging Face config.json is a few kilobytes",
                "give the model's config.json, not its weights or another file",
            )
        data = path.read_bytes()
    except OSError as err:
        raise HybridKVConfigError(
            "--config",
            str(path),
            f"cannot read it ({err.strerror or err})",
            "give the path of a Hugging Face config.json",
        ) from None
    text = decode_utf8(data, "--config", str(path), _FIX)
    loaded = parse_json(text, "--config", str(path), _FIX)
    if not isinstance(loaded, dict):
        raise HybridKVConfigError(
            "--config", str(path), "the JSON is not an object", "give a config.json file"
        )
    return str(path), loaded


_FIX = "give the model's config.json as published (UTF-8 JSON text, one object)"
