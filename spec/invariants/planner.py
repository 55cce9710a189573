"""PL-*: invariants of the hybrid offload planner (snapshot subject ``"planner"``).

Each predicate reads the plain dict that ``snapshot()`` returns on either planner (the
reference :mod:`spec.planner` or the optimized ``hybridkv.planner``) and recounts one derived
field from the inputs. The predicates guard their own arithmetic (a zero or a missing entry is
reported, not divided by), so a corrupted snapshot yields messages rather than a crash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__ = [
    "attention_unit_follows_the_chunk_rule",
    "claim_unit_is_lcm_of_chunk_and_units",
    "first_storable_chunk_recounts",
    "hash_block_divides_blocks_and_chunk",
    "hash_factors_recount_units",
    "mamba_unit_is_its_block",
    "shortest_hit_fits_max_model_len",
    "splittable_means_unit_below_block",
]

Snapshot = Mapping[str, Any]
_ATTENTION_KINDS = ("full", "sliding")


def _per_group(snapshot: Snapshot, key: str) -> tuple[list[Any], list[str]]:
    """The per-group tuple ``key``, or a message when its length is not one per group."""
    values = list(snapshot[key])
    groups = snapshot["groups"]
    if len(values) != len(groups):
        return [], [f"{key} has {len(values)} entries for {len(groups)} groups"]
    return values, []


def _positive(snapshot: Snapshot, key: str) -> list[str]:
    value = snapshot[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return [f"{key}={value!r} is not a positive int"]
    return []


@invariant("planner")
def hash_block_divides_blocks_and_chunk(snapshot: Snapshot) -> list[str]:
    """PL-1: hash_block_size divides chunk_size and every group's block size."""
    problems = _positive(snapshot, "hash_block_size")
    if problems:
        return problems
    h = snapshot["hash_block_size"]
    if snapshot["chunk_size"] % h != 0:
        problems.append(f"chunk_size {snapshot['chunk_size']} is not a multiple of {h}")
    for index, (_, block) in enumerate(snapshot["groups"]):
        if block % h != 0:
            problems.append(f"group {index} block_size {block} is not a multiple of {h}")
    return problems


@invariant("planner")
def mamba_unit_is_its_block(snapshot: Snapshot) -> list[str]:
    """PL-2: a mamba group's offload unit is its whole block (its state exists only there)."""
    units, problems = _per_group(snapshot, "units")
    if problems:
        return problems
    for index, ((kind, block), unit) in enumerate(zip(snapshot["groups"], units, strict=True)):
        if kind == "mamba" and unit != block:
            problems.append(f"mamba group {index} has unit {unit}, block_size {block}")
    return problems


@invariant("planner")
def attention_unit_follows_the_chunk_rule(snapshot: Snapshot) -> list[str]:
    """PL-3: an attention group's unit is chunk_size if that divides its block, else the block."""
    units, problems = _per_group(snapshot, "units")
    problems += _positive(snapshot, "chunk_size")
    if problems:
        return problems
    chunk = snapshot["chunk_size"]
    for index, ((kind, block), unit) in enumerate(zip(snapshot["groups"], units, strict=True)):
        if kind not in _ATTENTION_KINDS:
            continue
        expected = chunk if block % chunk == 0 else block
        if unit != expected:
            problems.append(f"{kind} group {index} (block {block}) has unit {unit}, not {expected}")
    return problems


@invariant("planner")
def splittable_means_unit_below_block(snapshot: Snapshot) -> list[str]:
    """PL-4: a group is splittable exactly when its offload unit is smaller than its block."""
    units, problems = _per_group(snapshot, "units")
    flags, more = _per_group(snapshot, "splittable")
    problems += more
    if problems:
        return problems
    groups = snapshot["groups"]
    for index, ((_, block), unit, flag) in enumerate(zip(groups, units, flags, strict=True)):
        if flag != (unit < block):
            problems.append(f"group {index}: splittable={flag} but unit {unit}, block {block}")
    return problems


@invariant("planner")
def hash_factors_recount_units(snapshot: Snapshot) -> list[str]:
    """PL-5: each unit is a positive multiple of hash_block_size and its hash factor is u / h."""
    units, problems = _per_group(snapshot, "units")
    factors, more = _per_group(snapshot, "hash_factors")
    problems += more + _positive(snapshot, "hash_block_size")
    if problems:
        return problems
    h = snapshot["hash_block_size"]
    for index, (unit, factor) in enumerate(zip(units, factors, strict=True)):
        if unit <= 0 or unit % h != 0:
            problems.append(f"group {index} unit {unit} is not a positive multiple of {h}")
        elif factor * h != unit:
            problems.append(f"group {index} hash factor {factor} != unit {unit} / {h}")
    return problems


@invariant("planner")
def first_storable_chunk_recounts(snapshot: Snapshot) -> list[str]:
    """PL-6: a group's first storable chunk is the first chunk whose end its unit divides."""
    units, problems = _per_group(snapshot, "units")
    firsts, more = _per_group(snapshot, "first_storable_chunks")
    problems += more + _positive(snapshot, "chunk_size")
    if problems:
        return problems
    chunk = snapshot["chunk_size"]
    for index, (unit, first) in enumerate(zip(units, firsts, strict=True)):
        if unit <= 0:
            problems.append(f"group {index} unit {unit} is not positive")
            continue
        # The chunk ends k*c run through every residue mod the unit within `unit` steps.
        expected = next(k for k in range(unit) if (k + 1) * chunk % unit == 0)
        if first != expected:
            problems.append(f"group {index} first storable chunk {first}, recount {expected}")
    return problems


@invariant("planner")
def claim_unit_is_lcm_of_chunk_and_units(snapshot: Snapshot) -> list[str]:
    """PL-7: claim_unit is the least common multiple of chunk_size and every offload unit."""
    units, problems = _per_group(snapshot, "units")
    problems += _positive(snapshot, "chunk_size")
    if problems:
        return problems
    expected = math.lcm(snapshot["chunk_size"], *units)
    if snapshot["claim_unit"] != expected:
        problems.append(f"claim_unit {snapshot['claim_unit']} != lcm {expected}")
    return problems


@invariant("planner")
def shortest_hit_fits_max_model_len(snapshot: Snapshot) -> list[str]:
    """PL-8: shortest_hit_prompt is claim_unit + 1 and is at most max_model_len."""
    shortest = snapshot["shortest_hit_prompt"]
    problems = []
    if shortest != snapshot["claim_unit"] + 1:
        problems.append(f"shortest_hit_prompt {shortest} != claim_unit + 1")
    if shortest > snapshot["max_model_len"]:
        problems.append(f"shortest_hit_prompt {shortest} > max_model_len")
    return problems
