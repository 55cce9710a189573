"""Where a command's model comes from: a built-in preset or a user's config.json.

``hybridkv plan`` and ``hybridkv simulate`` take the same ``--preset NAME | --config PATH``;
this is the one place that reads them, with errors that name the flag, the file and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVConfigError
from spec.presets import DEFAULT_PRESET, preset_config

__all__ = ["load_model_config"]


def load_model_config(preset: str | None, config: str | None) -> tuple[str, Mapping[str, Any]]:
    """``(source, config.json dict)``: the file at ``config`` (or ``config/config.json``), else
    the preset (the default preset when both are ``None``).

    Refusal: an unreadable file, invalid JSON or a non-object raises
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
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise HybridKVConfigError(
            "--config",
            str(path),
            f"cannot read it ({err.strerror or err})",
            "give the path of a Hugging Face config.json",
        ) from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as err:
        raise HybridKVConfigError(
            "--config",
            str(path),
            f"not valid JSON (line {err.lineno}: {err.msg})",
            "give a config.json file",
        ) from None
    if not isinstance(loaded, dict):
        raise HybridKVConfigError(
            "--config", str(path), "the JSON is not an object", "give a config.json file"
        )
    return str(path), loaded
