"""tools/bench_vs_native.py's chunk: hybridkv at one scheduler block reaches the trace's floor.

HybridKVConnector's claims end on multiples of its chunk (``claim_unit``). Its recommended
chunk moves 1 MiB (256 tokens on the bench's sliding + full layout), so a claim rounds down to
256 tokens while native's rounds down to its one-block chunk (32). The bench therefore gives
hybridkv one block, native's chunk, and keeps one row at the recommended chunk for contrast.
Asserted on a small sliding + full chat: at one block hybridkv computes exactly the floor (every
term non-zero: loads, GPU hits, floor); at the recommended chunk it computes more and loads less.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402

bench = load_tool("bench_vs_native")


def test_one_block_chunk_reaches_the_floor_and_the_recommended_one_rounds_claims_off() -> None:
    (case,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
    trace = replace(case.trace, convs=3, turns=3)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    block = probe.block_size
    chunk_bytes = bench.block_bytes(probe)
    floor = bench.floor_tokens(trace, block)
    host = 2 * bench.working_set_blocks(trace, block)

    one_block = bench.Variant("hybridkv", "lru", 1, host, chunk_size=block)
    engine, _ = bench._engine(case, one_block, chunk_bytes)
    assert engine.scheduler.connector.chunk_size == block
    assert engine.scheduler.connector.core.geometry.align == block
    engine.close()
    recommended, _ = bench._engine(case, bench.Variant("hybridkv", "lru", 1, host), chunk_bytes)
    coarse = recommended.scheduler.connector.chunk_size
    recommended.close()
    assert coarse > block  # the 1 MiB target: several blocks on this tiny layout

    fine = bench.run_variant(case, trace, one_block, chunk_bytes, 1)
    rounded = bench.run_variant(
        case, trace, bench.Variant("hybridkv", "lru", 1, host), chunk_bytes, 1
    )
    for result in (fine, rounded):
        assert result.error == ""
        r = result.report
        assert (r.wrong_reads, r.leaked_blocks, r.finished) == (0, 0, r.requests)
    assert floor > 0
    assert fine.report.external_loaded > 0
    assert fine.report.gpu_prefix_hits > 0
    assert fine.report.prefill_computed == floor
    assert rounded.report.prefill_computed > floor
    assert rounded.report.external_loaded < fine.report.external_loaded
    assert "default chunk" in bench.Variant("hybridkv").name()
    assert "default chunk" not in one_block.name()
