"""tools/host_tier_bound.py, gpu_hit_loss.py and host_pressure_seeds.py on vLLM 0.33, small.

- The recorder captures the host tier's traffic faithfully: replaying it under the run's own
  policy reproduces every ask's claim and the run's loaded tokens, with evictions (0.5x tier).
- The GPU-hit probe's sums are vLLM's own counter, and on sliding + full a connector's loads
  cut GPU hits through the sliding group: the full-attention group still holds a request's
  prefix, the sliding group no longer holds its window.
- The seed sweep prints one row per seed and policy and their sum.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402

bound = load_tool("host_tier_bound")
loss = load_tool("gpu_hit_loss")
bench = bound.bench


def _setup() -> tuple[object, object, int, int, int]:
    (case,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
    trace = replace(case.trace, convs=6, turns=3)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    block, chunk_bytes = probe.block_size, bench.block_bytes(probe)
    probe.close()
    return case, trace, block, chunk_bytes, bench.working_set_blocks(trace, block)


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_replay_under_the_runs_policy_reproduces_every_claim(policy: str) -> None:
    # The bench's own trace and 0.5x row (native chunks, the same bytes for hybridkv): where
    # a replay that touched loads in group order, not the core's, diverged under ARC.
    (case,) = (c for c in bench._cases(quick=False) if c.name == "sliding+full")
    trace = case.trace
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    half = round(0.5 * bench.working_set_chunks(trace, probe))
    variant = bench.Variant("hybridkv", policy, 1, half)
    events, report, geometry, capacity = bound.record(
        case, trace, variant, bench.native_chunk_bytes(probe)
    )
    asks = [e for e in events if isinstance(e, bound.Ask)]
    assert len(asks) == report.requests
    results = {r.policy: r for r in bound.replays(events, geometry, capacity, delay=1)}
    own = results[policy]
    assert own.ends == tuple(a.loaded for a in asks)
    assert own.claimed == report.external_loaded > 0
    assert own.evicted > 0
    assert set(results) == {"lru", "arc", "min", "min bypass", "no limit"}
    assert results["no limit"].evicted == 0


def test_connector_loads_cut_gpu_hits_through_the_sliding_group() -> None:
    case, trace, block, chunk_bytes, working = _setup()
    none_report, none = loss.probe(case, trace, bench.Variant("none"), chunk_bytes)
    variant = bench.Variant("hybridkv", "lru", 1, 2 * working, chunk_size=block)
    report, hybrid = loss.probe(case, trace, variant, chunk_bytes)
    for r, probe in ((none_report, none), (report, hybrid)):
        assert sum(a.gpu for a in probe.admissions.values()) == r.gpu_prefix_hits
        assert len(probe.admissions) == r.requests
    assert report.gpu_prefix_hits < none_report.gpu_prefix_hits
    cut = [a for a in hybrid.admissions.values() if a.full > a.gpu]
    assert cut
    assert all(a.sliding_cached < a.full // block for a in cut)
    assert sum(a.null for a in hybrid.admissions.values()) > 0
    served = sum(a.gpu + a.ext for a in hybrid.admissions.values())
    assert served > sum(a.gpu for a in none.admissions.values())


seeds = load_tool("host_pressure_seeds")


def test_seed_sweep_reports_each_row_and_the_sum(capsys: pytest.CaptureFixture[str]) -> None:
    # One chat seed at a 2x tier: nothing is evicted, so hybridkv computes the trace's floor
    # (one-block claims) and native its own figure, as in the bench's own 2x rows.
    assert seeds.main(["--chat-seeds", "1234", "--traffic-seeds", "", "--host", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("chat 1234")]
    assert len(rows) == 2
    for row in rows:
        assert "native   2636 hybridkv   2380 (-256)" in row
    assert lines[-1] == "sum: hybridkv 4760 native 5272 (0.903); 2 of 2 rows <= native"
