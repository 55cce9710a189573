"""tools/bench_vs_native.py's chunk: hybridkv at one scheduler block reaches the trace's floor.

HybridKVConnector's claims end on multiples of its chunk (``claim_unit``). Its recommended
chunk moves 1 MiB (256 tokens on the bench's sliding + full layout), so a claim rounds down to
256 tokens while native's rounds down to its one-block chunk (32). The bench therefore gives
hybridkv one block, native's chunk, and keeps one row at the recommended chunk for contrast.
Asserted on a small sliding + full chat: at one block hybridkv computes exactly the floor (every
term non-zero: loads, GPU hits, floor); at the recommended chunk it computes more and loads less.

The continuation columns, on the same chat with 40-token answers: hybridkv loads earlier
answers (the previous one included, which only its decode computed), native never loads the
previous answer, each continuation count is a part of the cached tokens it came from, and
computed + loaded + GPU hits = prompt tokens with every term non-zero; ``--plot`` writes a PNG.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

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


def _small_long_answer_run() -> tuple[Any, int, dict[Any, Any]]:
    """sliding + full, 3 x 3 chat with 40-token answers: the bench's own variants at d=1."""
    (case,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
    trace = replace(case.trace, convs=3, turns=3, output_len=40)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    block = probe.block_size
    host = 2 * bench.working_set_blocks(trace, block)
    variants = [
        bench.Variant("none"),
        bench.Variant("native", "lru", 1, host),
        bench.Variant("hybridkv", "lru", 1, host, chunk_size=block),
    ]
    results = {v: bench.run_variant(case, trace, v, bench.block_bytes(probe), 1) for v in variants}
    return trace, block, results


def test_continuation_hits_are_observed_and_every_column_term_adds_up(tmp_path: Path) -> None:
    trace, block, results = _small_long_answer_run()
    plain, native, ours = results.values()
    for result in results.values():
        assert result.error == ""
        r = result.report
        assert (r.wrong_reads, r.leaked_blocks, r.finished, r.preemptions) == (0, 0, r.requests, 0)
        cont = result.continuation
        # Continuation hits are a part of the cached tokens, the previous answer a part of them.
        assert cont.loaded <= r.external_loaded
        assert cont.gpu <= r.gpu_prefix_hits
        assert cont.total <= r.external_loaded + r.gpu_prefix_hits
        assert cont.loaded_previous <= cont.loaded
    # hybridkv stores what decode computed: the next turn loads the previous answer.
    assert ours.continuation.loaded > 0
    assert ours.continuation.loaded_previous > 0
    # Native stores prefills only: the previous answer is never loaded (FIELD-NOTES).
    assert native.continuation.loaded_previous == 0
    assert ours.continuation.total > native.continuation.total
    # The identity the bench checks per variant: every prompt position is computed, loaded or
    # a GPU prefix hit, once (no preemption, no failed load here), each term non-zero.
    r = ours.report
    assert min(r.prefill_computed, r.external_loaded, r.gpu_prefix_hits) > 0
    assert r.prefill_computed + r.external_loaded + r.gpu_prefix_hits == r.prompt_tokens
    assert plain.report.prompt_tokens == r.prompt_tokens == native.report.prompt_tokens
    assert bench.identity_breaks(results) == []
    # The printed row carries the observed columns.
    row = bench._row("hybridkv", ours, bench.floor_tokens(trace, block)).split()
    cont = ours.continuation
    assert row[5:8] == [str(cont.loaded), str(cont.loaded_previous), str(cont.gpu)]
    # Both clocks measured the connector's calls: CPU time is spent inside the same spans the
    # wall clock times, so it is positive and never longer (a tick of slack for the clocks'
    # resolution), and the connector's CPU time is a part of the scheduler's.
    for result in (native, ours):
        r = result.report
        assert 0 < r.connector_cpu_us <= r.connector_us + 1.0
        assert r.connector_cpu_us <= r.schedule_cpu_us <= r.schedule_us + 1.0
        assert result.connector_cpu_us > 0
    assert row[11] == f"{ours.connector_cpu_us:.0f}"

    # The figure: one panel pair per trace, written where --plot says.
    outcome = bench.TraceOutcome(
        "sliding+full, answers 40", bench.floor_tokens(trace, block), results, [], []
    )
    path = tmp_path / "figure" / "vs-native.png"
    bench.plot([outcome, outcome], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
