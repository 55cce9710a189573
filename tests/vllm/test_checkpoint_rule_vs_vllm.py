"""The checkpoint rule of the library and of the spec, against vLLM 0.33's own functions.

Exhaustive over small geometries: ``CheckpointRule.position`` (library) and
``checkpoint_position`` (spec) equal ``get_mamba_prefill_checkpoint_position`` for every token
count, cache-hit grid, EAGLE drop and lookahead (the lookahead is unreachable with a connector,
tests/vllm/test_hybridkv_checkpoints.py, but it is part of the formula); the states a step
writes (library ``states_written``, spec ``states_written``) hold the checkpoint exactly where
the worker's ``compute_mamba_prefill_checkpoints`` exports one: same position (offset from the
query start) and same block-table column.
"""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from vllm.model_executor.layers.mamba.checkpoint import (  # noqa: E402
    compute_mamba_prefill_checkpoints,
)
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position  # noqa: E402

from hybridkv.connector.checkpoints import CheckpointRule  # noqa: E402
from spec.connector import checkpoints as spec_checkpoints  # noqa: E402


def test_the_position_is_vllms() -> None:
    compared = 0
    for n, grid, eagle, lookahead in itertools.product(
        range(80), (1, 2, 4, 8), (False, True), (0, 1, 3)
    ):
        rule = CheckpointRule(None, 1, grid, eagle, lookahead)
        spec_rule = spec_checkpoints.CheckpointRule(None, 1, grid, eagle, lookahead)
        expected = get_mamba_prefill_checkpoint_position(n, grid, eagle, lookahead)
        assert rule.position(n) == expected, (n, grid, eagle, lookahead)
        assert spec_checkpoints.checkpoint_position(spec_rule, n) == expected
        compared += 1
    assert compared == 80 * 4 * 2 * 3


@pytest.mark.parametrize("block", [4, 8])
def test_the_exported_checkpoint_is_the_workers(block: int) -> None:
    exported = 0
    for hash_block, grid, alignment, eagle, lookahead in itertools.product(
        (1, 2, 4), (2, 4), (None, 1, 2, 4), (False, True), (0, 2)
    ):
        if block % hash_block or grid % hash_block:
            continue
        rule = CheckpointRule(alignment, hash_block, grid, eagle, lookahead)
        spec_rule = spec_checkpoints.CheckpointRule(alignment, hash_block, grid, eagle, lookahead)
        for start, end in itertools.combinations(range(6 * block), 2):
            (offset,), (col,) = compute_mamba_prefill_checkpoints(
                [end],
                [end - start],
                hash_block_size=hash_block,
                mamba_block_size=block,
                checkpoint_alignment=alignment,
                drop_eagle_block=eagle,
                cache_hit_alignment_tokens=grid,
                num_hash_lookahead_tokens=lookahead,
            )
            running = (-(-end // block) - 1, end)
            expected = [running] if col < 0 else [running, (col, start + offset)]
            ours = list(rule.states_written(start, end, block))
            theirs = [
                (s.slot, s.position)
                for s in spec_checkpoints.states_written(spec_rule, start, end, block)
            ]
            assert ours == expected == theirs, (rule, start, end)
            exported += col >= 0
    assert exported > 100  # the comparison reaches checkpoints, not only running states
