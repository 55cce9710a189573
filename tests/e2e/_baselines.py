"""Each model's checkpoint, its no-connector run, and its reference, built once per session.

The served runs compare with the same baseline as the in-process ones: one greedy run of the
chats through ``LLM`` without a connector is the baseline for every request of that model.
A bfloat16 model also has a reference (``_drift``): the baseline's prompts again without a
connector and with prefix caching off, measured against the baseline.
"""

from __future__ import annotations

from pathlib import Path

import _drift
import _llm
import _models

_MODELS: dict[str, _models.TinyModel] = {}
_BASELINES: dict[str, _llm.Run] = {}
_REFERENCES: dict[str, _drift.Criterion] = {}


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


def criterion(name: str, root: Path) -> _drift.Criterion:
    """The bound of the named bfloat16 model: vLLM's own variation (prefix caching off against
    on, no connector), measured on first use."""
    if name not in _REFERENCES:
        base = baseline(name, root)
        off = _llm.run(model(name, root), None, base.transcript, prefix_caching=False)
        _REFERENCES[name] = _drift.Criterion(_drift.measure(off.transcript, base.transcript))
    return _REFERENCES[name]
