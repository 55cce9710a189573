"""Which child of a weighted multi-connector loads a request: the pure part of
:class:`hybridkv.vllm.multi.WeightedMultiConnector`, free of vLLM so it is unit-tested alone.

The multi-connector asks every child how many tokens past the local hit it can load
(``get_num_new_matched_tokens``) and picks the child with the largest
``matched_tokens * load_weight``:

- a child that answers ``None`` (its lookup is still running) makes the whole answer
  :class:`Pending`: a child not yet heard from may hold the best match, so nothing is chosen
  until every child has answered (vLLM asks again at its next schedule);
- a score of 0 (no tokens, or weight 0) is never chosen; if every score is 0 the answer is
  :class:`NoHit` and the request is computed;
- ties go to the child listed first, so equal weights reproduce vLLM 0.33's own
  ``MultiConnector`` whenever the first child with hits also has the most tokens.

A weight of 0 keeps a child as a store-only target: it sees every request and stores, and is
never asked to load.

:func:`parse_children` validates the per-child entries of ``kv_connector_extra_config`` (name,
weight); the child's own connector config is vLLM's to validate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError

__all__ = [
    "ChildSpec",
    "Chosen",
    "NoHit",
    "Pending",
    "Selection",
    "SelectionTally",
    "parse_children",
    "select",
]

# The keys a child entry adds to vLLM's own child entry (a KVTransferConfig's fields).
NAME_KEY = "name"
WEIGHT_KEY = "load_weight"
DEFAULT_WEIGHT = 1.0
_FIELD = "kv_connector_extra_config.connectors"


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child as the multi-connector sees it.

    Attributes:
        name: the instance name, unique among the children (stats are keyed by it).
        load_weight: the multiplier of the child's matched tokens (>= 0; 0 = never loads).
        config: the child's own ``KVTransferConfig`` fields (the entry less ``name`` and
            ``load_weight``), handed to vLLM unchanged.
    """

    name: str
    load_weight: float
    config: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Pending:
    """At least one child is still looking up: answer vLLM ``(None, False)``."""


@dataclass(frozen=True, slots=True)
class NoHit:
    """Every child answered and no score is positive: answer vLLM ``(0, False)``."""


@dataclass(frozen=True, slots=True)
class Chosen:
    """The child at ``index`` loads ``tokens`` (its own answer), scored ``score``."""

    index: int
    tokens: int
    score: float


Selection = Pending | NoHit | Chosen


def select(answers: Sequence[int | None], weights: Sequence[float]) -> Selection:
    """Pick the child that loads (module docstring): the largest ``tokens * weight``, ties to
    the earliest child, ``Pending`` if any answer is ``None``, ``NoHit`` if no score is positive.

    Raises:
        ValueError: ``answers`` and ``weights`` differ in length, or an answer is negative
            (a child broke vLLM's contract; the caller names it).
    """
    if len(answers) != len(weights):
        raise ValueError(f"{len(answers)} answers for {len(weights)} children")
    if any(tokens is None for tokens in answers):
        return Pending()
    best: Chosen | None = None
    for index, (tokens, weight) in enumerate(zip(answers, weights, strict=True)):
        assert tokens is not None  # ruled out above
        if tokens < 0:
            raise ValueError(f"child {index} answered {tokens} matched tokens (< 0)")
        score = tokens * weight
        # Strictly greater: the earlier child keeps a tie.
        if score > 0 and (best is None or score > best.score):
            best = Chosen(index, tokens, score)
    return NoHit() if best is None else best


def _name(entry: Mapping[str, Any], index: int, seen: set[str]) -> str:
    name = entry.get(NAME_KEY)
    if not isinstance(name, str) or not name.strip():
        raise HybridKVConfigError(
            f"{_FIELD}[{index}].{NAME_KEY}",
            name,
            "each child needs a non-empty instance name (its stats are keyed by it)",
            'add e.g. "name": "host-tier"',
        )
    if name in seen:
        raise HybridKVConfigError(
            f"{_FIELD}[{index}].{NAME_KEY}",
            name,
            "is the name of an earlier child (stats keyed by it would merge)",
            "give every child its own name",
        )
    return name


def _weight(entry: Mapping[str, Any], index: int) -> float:
    weight = entry.get(WEIGHT_KEY, DEFAULT_WEIGHT)
    valid = isinstance(weight, int | float) and not isinstance(weight, bool)
    if not valid or not math.isfinite(weight) or weight < 0:
        raise HybridKVConfigError(
            f"{_FIELD}[{index}].{WEIGHT_KEY}",
            weight,
            "must be a finite number >= 0 (it multiplies the child's matched tokens)",
            f"use e.g. {DEFAULT_WEIGHT} (0 keeps the child store-only)",
        )
    return float(weight)


def parse_children(extra_config: Mapping[str, Any]) -> tuple[ChildSpec, ...]:
    """The children listed under ``connectors`` of the multi-connector's extra config, in
    order, with names and weights validated (an entry's other keys are vLLM's to validate).

    Raises:
        HybridKVConfigError: no list, an empty list, an entry that is not an object, a missing,
            blank or repeated name, or a weight that is not a finite number >= 0.
    """
    entries = extra_config.get("connectors")
    if not isinstance(entries, list) or not entries:
        raise HybridKVConfigError(
            _FIELD,
            entries,
            "must be a non-empty list of child connector configs",
            'list at least one child, e.g. [{"name": "host", "kv_connector": ..., '
            '"kv_role": "kv_both", "load_weight": 1.0}]',
        )
    seen: set[str] = set()
    children = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise HybridKVConfigError(
                f"{_FIELD}[{index}]",
                entry,
                "must be an object (a KVTransferConfig's fields plus name and load_weight)",
                'write {"name": ..., "kv_connector": ..., "kv_role": ...}',
            )
        name = _name(entry, index, seen)
        seen.add(name)
        config = {k: v for k, v in entry.items() if k not in (NAME_KEY, WEIGHT_KEY)}
        children.append(ChildSpec(name, _weight(entry, index), config))
    return tuple(children)


class SelectionTally:
    """How often each child was chosen and the tokens it was given, counted per answer the
    multi-connector returned (a request asked again after a preemption counts again)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self.chosen = dict.fromkeys(self._names, 0)
        self.tokens = dict.fromkeys(self._names, 0)
        self.pending = 0
        self.no_hit = 0

    def record(self, selection: Selection) -> None:
        """Count one answer."""
        if isinstance(selection, Chosen):
            name = self._names[selection.index]
            self.chosen[name] += 1
            self.tokens[name] += selection.tokens
        elif isinstance(selection, Pending):
            self.pending += 1
        else:
            self.no_hit += 1

    @property
    def answers(self) -> int:
        """Every answer counted (recounts ``chosen``, ``pending`` and ``no_hit``)."""
        return sum(self.chosen.values()) + self.pending + self.no_hit
