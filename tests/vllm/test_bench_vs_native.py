"""tools/bench_vs_native.py: hybridkv at its default chunk reaches the trace's floor, with the
same host bytes as native.

HybridKVConnector's claims end on multiples of its chunk (``claim_unit``). Its default chunk is
one block on the bench's layouts (hybridkv.default_chunk), native's chunk too; a 256-token chunk
(the old 1 MiB default on sliding + full) rounds claims down and is kept as an override here for
contrast. Asserted on a small sliding + full chat: at the default chunk hybridkv computes exactly
the floor (every term non-zero: loads, GPU hits, floor); at 256 tokens it computes more and loads
less.

Equal bytes: native sizes its host tier in chunks of one GPU block, which on a hybrid layout is
one group's block (the groups overlay one allocation); the bench sizes both tiers from the
working set in those chunks and gives hybridkv the same bytes, so both hold the same number of
group blocks.

The continuation columns, on the same chat with 40-token answers: hybridkv loads earlier
answers (the previous one included, which only its decode computed), native never loads the
previous answer, each continuation count is a part of the cached tokens it came from, and
computed + loaded + GPU hits = prompt tokens with every term non-zero; ``--plot`` writes a PNG.

The traffic trace (issue 18): its aborts fire, one at least with a load in flight, the pool
preempts, every request neither aborted nor preempted keeps the identity, and the floor that
leaves aborted requests out is a lower bound of what each kept request computes.
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


def test_the_default_chunk_reaches_the_floor_and_a_coarse_one_rounds_claims_off() -> None:
    (case,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
    trace = replace(case.trace, convs=3, turns=3)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    block = probe.block_size
    chunk_bytes = bench.native_chunk_bytes(probe)
    floor = bench.floor_tokens(trace, block)
    host = 2 * bench.working_set_chunks(trace, probe)

    default = bench.Variant("hybridkv", "lru", 1, host)
    engine, _ = bench._engine(case, default, chunk_bytes)
    assert engine.scheduler.connector.chunk_size == block == bench.default_chunk(probe)
    assert engine.scheduler.connector.core.geometry.align == block
    engine.close()
    coarse = bench.Variant("hybridkv", "lru", 1, host, chunk_size=8 * block)

    fine = bench.run_variant(case, trace, default, chunk_bytes, 1)
    rounded = bench.run_variant(case, trace, coarse, chunk_bytes, 1)
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
    assert default.name() == "hybridkv lru d=1"
    assert coarse.name().endswith(f" chunk={8 * block}")


@pytest.mark.parametrize("name", ["mamba+full", "sliding+full"])
def test_both_host_tiers_get_the_same_bytes_and_hold_the_same_group_blocks(name: str) -> None:
    (case,) = (c for c in bench._cases(quick=True) if c.name == name)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    chunks = bench.working_set_chunks(case.trace, probe)
    groups = len(probe.kv_cache_config.kv_cache_groups)
    # The working set counts every group's block of each distinct token block.
    token_blocks = bench.working_set_blocks(case.trace, probe.block_size)
    assert chunks == token_blocks * groups
    native, _ = bench._engine(case, bench.Variant("native", "lru", 1, chunks), 0)
    worker = native.adapter.worker  # native's CPU spec sized it (NativeOffloadOnCPU checks)
    native_bytes = sum(t.numel() * t.element_size() for t in worker.host)
    rows = {t.shape[0] for t in worker.host}
    native.close()
    chunk_bytes = bench.native_chunk_bytes(probe)
    ours, _ = bench._engine(case, bench.Variant("hybridkv", "lru", 1, chunks), chunk_bytes)
    connector = ours.scheduler.connector
    slots, slot = connector.num_chunks, connector.layout.slot_bytes
    ours.close()
    assert rows == {chunks}
    assert native_bytes == chunks * chunk_bytes  # native's own chunk: one GPU block
    # hybridkv's slot is the largest group's block: here every group's block is one chunk.
    assert slot == chunk_bytes
    assert slots == chunks


def _small_long_answer_run() -> tuple[Any, int, dict[Any, Any]]:
    """sliding + full, 3 x 3 chat with 40-token answers: the bench's own variants at d=1."""
    (case,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
    trace = replace(case.trace, convs=3, turns=3, output_len=40)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    block = probe.block_size
    host = 2 * bench.working_set_chunks(trace, probe)
    variants = [
        bench.Variant("none"),
        bench.Variant("native", "lru", 1, host),
        bench.Variant("hybridkv", "lru", 1, host),
    ]
    chunk_bytes = bench.native_chunk_bytes(probe)
    results = {v: bench.run_variant(case, trace, v, chunk_bytes, 1) for v in variants}
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


def test_the_traffic_trace_aborts_preempts_and_accounts_for_every_request() -> None:
    """The traffic trace on sliding + full (16 x 6, a few seconds): the seeded aborts fire,
    some while a connector load is in flight; the pool preempts without a connector; every
    request neither aborted nor preempted satisfies computed + loaded + GPU hit = prompt; hybridkv
    computes at least the floor (a lower bound) and every token above it has a cause."""
    (case,) = (c for c in bench._cases(quick=False) if c.name == "sliding+full")
    trace = case.traffic
    aborts = trace.aborts()
    assert len(aborts) == round(trace.abort_rate * trace.convs * trace.turns) > 0
    probe = bench.InProcessEngine(case.config_json, case.traffic_settings)
    probe.close()
    floors = bench.traffic_floor(trace, probe.block_size)
    assert len(floors) == trace.convs * trace.turns - len(aborts)
    floor, working, _ = bench._figures(trace, probe)
    chunk_bytes = bench.native_chunk_bytes(probe)

    plain = bench.run_variant(case, trace, bench.Variant("none"), chunk_bytes, 1)
    assert plain.report is not None
    assert plain.report.preemptions > 0
    ours = bench.run_variant(
        case, trace, bench.Variant("hybridkv", "lru", 1, 2 * working), chunk_bytes, 1
    )
    assert ours.error == ""
    assert ours.report is not None
    assert ours.ledger is not None
    r, ledger = ours.report, ours.ledger
    assert (r.wrong_reads, r.leaked_blocks, r.finished) == (0, 0, r.requests)
    assert set(ledger.aborted) == {f"c{c}-t{t}" for c, t in aborts}
    assert any(ledger.aborted.values())  # aborted with a load in flight
    assert "UNEXPLAINED" not in bench.traffic_identity(ledger)
    for rid, prompt in ledger.prompt.items():
        if rid not in ledger.aborted and not ledger.preempted.get(rid):
            total = ledger.computed.get(rid, 0) + ledger.loaded.get(rid, 0) + ledger.gpu.get(rid, 0)
            assert total == prompt, rid
    assert sum(ledger.loaded.values()) > 0
    assert floor <= ours.computed() < plain.computed()
    for rid, own in floors.items():
        assert ledger.computed.get(rid, 0) >= own or ledger.preempted.get(rid), rid
