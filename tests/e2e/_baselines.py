"""Each model's checkpoint and its no-connector run, built once per session.

The served runs compare with the same baseline as the in-process ones: one greedy run of the
chats through ``LLM`` without a connector is the reference for every request of that model.
"""

from __future__ import annotations

from pathlib import Path

import _llm
import _models

_MODELS: dict[str, _models.TinyModel] = {}
_BASELINES: dict[str, _llm.Run] = {}


def model(name: str, root: Path) -> _models.TinyModel:
    """The named tiny model, saved under ``root`` on first use."""
    if name not in _MODELS:
        _MODELS[name] = _models.build(name, root)
    return _MODELS[name]


def baseline(name: str, root: Path) -> _llm.Run:
    """The named model's chats without a connector, run on first use."""
    if name not in _BASELINES:
        _BASELINES[name] = _llm.run(model(name, root), None)
    return _BASELINES[name]
