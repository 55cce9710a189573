"""The default ``chunk_size`` rounds off no claimable token on the bench's layouts (issue 18).

A claim ends on a multiple of ``claim_unit``, so a chunk coarser than it needs to be computes
again what the host holds. On each layout of ``tools/bench_vs_native.py`` a connector with no
``chunk_size`` and one with ``chunk_size`` one hash block play the same chat in vLLM 0.33's
real scheduler (:class:`hybridkv.vllm.harness.inprocess.InProcessEngine`), and every request's first
admission reports the same cached tokens (vLLM's ``PrefillStats``: local prefix hit, then the
connector's claim). The old default (the smallest chunk moving 1 MiB: 256 tokens on sliding +
full) claimed less there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402

bench = load_tool("bench_vs_native")

# The bench's quick traces, cut where that still makes the connector load on each layout.
_TRACES = {
    "mamba+full": {},
    "mamba+full-tight": {"convs": 4, "turns": 3},
    "sliding+full": {"convs": 3, "turns": 3},
}


def _claims(case: Any, trace: Any, chunk_size: int | None) -> tuple[dict[str, Any], Any]:
    """Per request, (local, external) cached tokens at its first admission; the run's report,
    the connector's chunk and its hash block size."""
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    host = 2 * bench.working_set_chunks(trace, probe)
    variant = bench.Variant("hybridkv", "lru", 1, host, chunk_size=chunk_size)
    engine, _ = bench._engine(case, variant, bench.native_chunk_bytes(probe))
    try:
        admissions = bench._Admissions(engine)
        report = bench.run_trace(engine, trace)
        chunk = engine.scheduler.connector.chunk_size
        hash_block = engine.scheduler.connector.layout.hash_block_size
    finally:
        engine.close()
    assert (report.wrong_reads, report.leaked_blocks, report.finished) == (0, 0, report.requests)
    return admissions.cached, (report, chunk, hash_block)


@pytest.mark.parametrize("name", sorted(_TRACES))
def test_the_default_chunk_claims_what_one_hash_block_chunks_claim(name: str) -> None:
    (case,) = (c for c in bench._cases(quick=True) if c.name == name)
    trace = replace(case.trace, **_TRACES[name])
    default, (report, chunk, hash_block) = _claims(case, trace, None)
    fine, (fine_report, fine_chunk, _) = _claims(case, trace, hash_block)
    assert fine_chunk == hash_block
    # The connector loaded something, so the comparison covers claims, not only misses.
    assert fine_report.external_loaded > 0
    assert default == fine, f"default chunk {chunk} vs one hash block {hash_block}"
    assert report.external_loaded == fine_report.external_loaded
    assert report.prefill_computed == fine_report.prefill_computed
