"""Two engines, one store (issue 12): two in-process vLLM 0.33 engines (vLLM's real ``Scheduler``,
each with its own ``HybridKVConnector`` pair and its own host tier, every slot and mamba state
the forward reads content-checked) share one real ``redis-server`` through the remote tier
(:mod:`hybridkv.vllm.remote`).

- Engine A serves a chat trace and writes its chunks behind; engine B serves the same prompts
  and promotes A's chunks: 0 wrong reads, every chunk B promoted was written by A under the same
  salt, and B computes fewer prompt tokens than the same engine without the remote tier
  (prefill saved, measured side by side). A third engine under another ``cache_salt`` finds
  none of A's chunks.
- Faults between B's lookup and B's fetch (server killed, every connection reset, the server
  paused past the timeout, the chunk deleted, the chunk corrupted): the promotion resolves
  FAULT / TIMEOUT / MISSING / CORRUPT (a reset connection may also reconnect and load whole),
  its members are dropped, B recomputes exactly what is missing (every prompt token computed or
  hit exactly once), nothing wrong loaded, nothing wedged.
- Random two-engine traces (Hypothesis; ``HYPOTHESIS_PROFILE=ci``: 20 traces, ``nightly``: 200;
  ``HYBRIDKV_TWO_ENGINE_TRACES`` overrides; each a seed of ``_two_engine_traces``, which
  ``nox -s soak`` plays by the thousand) with remote faults injected before fetches: 0 wrong
  loads, 0 cross-tenant hits, 0 wedges, 0 leaks, the promotion counters add up, and the spec's
  invariants hold on each engine after every step (``_invariants_on_vllm``).
- Tensor parallel 2 and 4 (issue 30, ranks simulated in process as for the host tier): each
  rank SETs its own shard of every chunk (replicated KV: one SET per chunk, rank 0's), B's
  ranks each fetch their own, 0 wrong reads on every rank. A shard missing on one rank before
  the lookup is a miss (nothing promoted); gone between the lookup and that rank's fetch, the
  promotion fails on every rank, vLLM never sees a load of it, B recomputes exactly what is
  missing. The random fault traces pass at TP 2 and 4 (faults on one drawn rank's fetches).

The slow-server fault uses ``CLIENT PAUSE`` (the server stops answering for longer than
``remote_timeout_ms``): ``DEBUG SLEEP`` needs ``enable-debug-command``, off by default in
Redis 7.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.remote]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _two_engine_traces import (  # noqa: E402
    OUTCOMES,
    TwoEngineOutcome,
    counter_mismatches,
    random_two_engine_trace,
)
from _two_engine_traces import play as play_two_engines  # noqa: E402
from _two_engines import (  # noqa: E402
    SHAPES,
    Shape,
    build,
    chat_prompts,
    flush_writes,
    run_prompts,
    started_server,
)
from diffharness.layouts import Layout  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.remote import redis_key  # noqa: E402
from hybridkv.vllm.config import RemoteSettings, parse_extra_config  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.remote import FetchOrder  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    yield from started_server(tmp_path)


def _remote(engine: InProcessEngine) -> Any:
    return engine.scheduler.connector.remote


def _quiescent(engine: InProcessEngine) -> None:
    """Nothing in flight, pinned, storing or promoting once every request is done."""
    connector = engine.scheduler.connector
    store = connector.core.store.stats()
    assert engine.pending() == 0
    assert connector.remote.in_flight() == 0
    assert connector.core.promotions_in_flight() == 0
    assert (store.pinned, store.storing) == (0, 0), store
    assert engine.leaked_blocks() == 0


def _counters_add_up(engine: InProcessEngine) -> None:
    # Every fetch each rank ran was reported and folded (none resolved by the deadline).
    assert not counter_mismatches(engine), counter_mismatches(engine)
    assert _remote(engine).count["promotion_deadlines"] == 0


def _every_token_once(report: InProcessReport) -> None:
    """Recompute of exactly what is missing: each prompt position computed or hit once."""
    assert report.preemptions == 0
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens, report


def _serve_a(shape: Shape, port: int) -> tuple[InProcessEngine, InProcessReport]:
    a = build(shape, port)
    report = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    return a, report


# ------------------------------------------------------------------ the documented config

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto" / "share-prefix-cache.md"


def test_the_howto_config_parses_to_the_remote_tier_it_describes() -> None:
    line = next(x for x in HOWTO.read_text().splitlines() if "--kv-transfer-config" in x)
    config = json.loads(line.split("--kv-transfer-config '")[1].rstrip("'"))
    parsed = parse_extra_config(config["kv_connector_extra_config"]).remote
    assert parsed == RemoteSettings("10.0.0.5", 6379, "prod", 3600, 64, 0.2)
    for key, bad, field in (
        ("remote_url", "redis://10.0.0.5:6379/3", "remote_url"),
        ("remote_timeout_ms", 0, "remote_timeout_ms"),
        ("remote_max_pending_writes", 0, "remote_max_pending_writes"),
    ):
        extra = {**config["kv_connector_extra_config"], key: bad}
        with pytest.raises(HybridKVConfigError, match=field):
            parse_extra_config(extra)


# ------------------------------------------------------------------ B hits what A stored


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_engine_b_hits_what_engine_a_stored(server: Any, layout: Layout) -> None:
    shape = SHAPES[layout]
    a, ra = _serve_a(shape, server.port)
    a_remote = _remote(a)
    written = a.worker.worker_remote.counters()
    assert a_remote.count["writes_ordered"] > 0
    assert written["remote_written"] == written["remote_writes_enqueued"] > 0

    b = build(shape, server.port)
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    alone = build(shape, None)  # the same engine without the remote tier
    rc = run_prompts(alone, chat_prompts(shape.trace, "c-"))
    b_remote = _remote(b)
    saved = rc.prefill_computed - rb.prefill_computed
    print(
        f"\n{layout.value}: A wrote {written['remote_written']} chunks "
        f"({written['remote_written_bytes']} B); B promoted {b_remote.count['promoted']} "
        f"of {b_remote.count['promotions_started']}, external hits {rb.external_hits}, "
        f"prefill computed {rb.prefill_computed} vs {rc.prefill_computed} alone: "
        f"saved {saved} of {rb.prompt_tokens} prompt tokens"
    )
    for report in (ra, rb, rc):
        assert report.finished == report.requests > 0
        assert report.slots_checked > 0
        assert report.wrong_reads == 0
        _every_token_once(report)
    assert b_remote.count["promoted"] > 0
    assert rb.external_hits > 0
    assert saved > 0
    # Every chunk B promoted was written by A, under the same salt (content addressing).
    a_wrote = set(a_remote.written_log)
    assert b_remote.promoted_log
    assert set(b_remote.promoted_log) <= a_wrote
    for engine in (a, b):
        _quiescent(engine)
        _counters_add_up(engine)

    # Another tenant (cache_salt) on the same prompts finds none of A's chunks.
    tenant = build(shape, server.port)
    rt = run_prompts(tenant, chat_prompts(shape.trace, "t-", salt="tenant-2"))
    t_remote = _remote(tenant)
    assert t_remote.count["remote_lookups"] > 0
    assert t_remote.count["remote_chunks_found"] == 0
    assert t_remote.count["promotions_started"] == 0
    assert rt.wrong_reads == 0
    for engine in (a, b, alone, tenant):
        engine.close()


# ------------------------------------------------------------------ model identity, reset


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_engines_of_different_models_share_no_chunk(server: Any, layout: Layout) -> None:
    """Issue 17 (2l): equal geometry, equal prompts, equal namespace, another model path:
    vLLM's block hashes (the member keys) are equal, so only the model identity in the chunk
    key keeps B off A's KV. A replica of A's model (C) still hits."""
    shape = SHAPES[layout]
    a, ra = _serve_a(shape, server.port)
    assert _remote(a).count["writes_ordered"] > 0
    b = build(shape, server.port, model="other-model")
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    b_remote = _remote(b)
    assert b_remote.count["remote_lookups"] > 0
    assert b_remote.count["remote_chunks_found"] == 0
    assert b_remote.count["promotions_started"] == 0
    # B's only hits are its own host tier's (turn 2 on turn 1): those of an engine alone.
    alone = run_prompts(build(shape, None, model="other-model"), chat_prompts(shape.trace, "d-"))
    assert rb.external_hits == alone.external_hits
    assert rb.prefill_computed == alone.prefill_computed
    c = build(shape, server.port)  # A's model: a replica
    rc = run_prompts(c, chat_prompts(shape.trace, "c-"))
    assert _remote(c).count["promoted"] > 0
    assert rc.external_hits > 0
    for report in (ra, rb, rc):
        assert report.wrong_reads == 0
    for engine in (a, b, c):
        _quiescent(engine)
        engine.close()


def test_after_a_reset_an_engine_reads_none_of_what_it_wrote_before(server: Any) -> None:
    """Issue 17 (2b): a connector reset (new weights) moves the weights version: the chunks A
    wrote before it stay on the server but are never asked for; what A writes after it is.
    Issue 28: what A writes after its reset lies in A's own epoch, so a replica that reset too
    (a sleep, perhaps, on other weights) reads none of it, while a replica that never reset
    reads what A wrote before its reset (both on the checkpoint's weights)."""
    shape = SHAPES[Layout.SLIDING_FULL]
    a, _ = _serve_a(shape, server.port)
    written = a.worker.worker_remote.counters()["remote_written"]
    assert written > 0
    assert a.scheduler.reset_prefix_cache(reset_connector=True)
    found = _remote(a).count["remote_chunks_found"]
    hits, computed = a.tally.external_hits, a.tally.prefill_computed
    again = run_prompts(a, chat_prompts(shape.trace, "again-"))
    assert _remote(a).count["remote_chunks_found"] == found
    # A's hits after the reset are only those it stores afresh (turn 2 on turn 1), exactly
    # those of a new engine alone: nothing from before the reset, host or remote.
    alone = run_prompts(build(shape, None), chat_prompts(shape.trace, "d-"))
    assert again.external_hits - hits == alone.external_hits
    assert again.prefill_computed - computed == alone.prefill_computed
    assert flush_writes(a)
    assert a.worker.worker_remote.counters()["remote_written"] > written  # written afresh
    # A replica that reset too (the same weights version) reads nothing A wrote after it.
    b = build(shape, server.port)
    assert b.scheduler.reset_prefix_cache(reset_connector=True)
    assert _remote(b).weights_version == _remote(a).weights_version == 1
    rb = run_prompts(b, chat_prompts(shape.trace, "again-"))
    assert _remote(b).count["remote_chunks_found"] == 0
    assert _remote(b).count["promoted"] == 0
    # A replica that never reset reads what A wrote before its reset.
    c = build(shape, server.port)
    rc = run_prompts(c, chat_prompts(shape.trace, ""))
    assert _remote(c).count["promoted"] > 0
    assert rb.wrong_reads == rc.wrong_reads == again.wrong_reads == 0
    for engine in (a, b, c):
        _quiescent(engine)
        engine.close()


# ------------------------------------------------------------------ faults


def _pause(server: Any) -> None:
    admin = server.admin()
    admin.client_pause(600, all=True)  # past B's 100 ms timeout
    admin.close()


def _kill_connections(server: Any) -> None:
    admin = server.admin()
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()


FAULTS: dict[str, tuple[Callable[[Any, FetchOrder], None], frozenset[str]]] = {
    "server-killed": (lambda s, order: s.kill(), frozenset({"fault"})),
    # redis-py may find the reset idle connection at checkout and reconnect: whole or dropped.
    "client-kill": (lambda s, order: _kill_connections(s), frozenset({"fault", "promoted"})),
    "paused-past-timeout": (lambda s, order: _pause(s), frozenset({"timeout"})),
    "deleted": (
        lambda s, order: s.admin().delete(redis_key(order.chunk_key)),
        frozenset({"missing"}),
    ),
    "corrupted": (
        lambda s, order: s.admin().setrange(redis_key(order.chunk_key), 200, b"\xff" * 8),
        frozenset({"corrupt"}),
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_between_lookup_and_load_recomputes_what_is_missing(server: Any, fault: str) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    inject, expected = FAULTS[fault]
    a, _ = _serve_a(shape, server.port)
    b = build(shape, server.port, timeout_ms=100)
    fired: list[bytes] = []

    def before_fetch(order: FetchOrder) -> None:
        if not fired:  # the first fetch only
            fired.append(order.chunk_key)
            inject(server, order)

    b.worker.worker_remote.before_fetch = before_fetch
    started = time.monotonic()
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    elapsed = time.monotonic() - started
    count = _remote(b).count
    print(f"\n{fault}: {dict(count)} in {elapsed:.2f}s; {rb}")
    assert fired
    outcome_of_first = {name for name in OUTCOMES if count[name]}
    assert outcome_of_first & expected, (outcome_of_first, expected)
    assert rb.finished == rb.requests
    assert rb.wrong_reads == 0
    assert rb.failed_loads == 0  # a failed fetch never reaches vLLM: the claim ended before it
    _every_token_once(rb)
    _quiescent(b)
    _counters_add_up(b)
    # A failed chunk is remembered: never promoted again for this engine.
    if "promoted" not in expected:
        assert count["promotions_started"] - count["promoted"] >= 1
    for engine in (a, b):
        engine.close()


# ------------------------------------------------------------------ random two-engine traces
# The generator and the player live in _two_engine_traces (the soak runner, tools/soak.py,
# plays the same seeds by the thousand); Hypothesis draws the seeds here.

TRACES = int(
    os.environ.get("HYBRIDKV_TWO_ENGINE_TRACES", max(8, settings.default.max_examples // 10))
)
FIGURES: dict[str, Counter[str]] = {}


@settings(
    max_examples=TRACES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_two_engine_traces_with_remote_faults(server: Any, seed: int) -> None:
    """Waves of requests (a family's shared prefix plus a drawn tail on one engine under a
    drawn tenant, then maybe the same prompt on the other engine), one drawn fault per fetch:
    0 wrong loads, 0 cross-tenant hits, 0 wedges, the promotion counters add up."""
    _check_trace(play_two_engines(server, random_two_engine_trace(random.Random(seed))), "tp1")


def _check_trace(out: TwoEngineOutcome, name: str) -> None:
    assert out.unfinished == 0
    assert out.unflushed == 0
    for report in out.reports.values():
        assert report.wrong_reads == 0  # content-verified: 0 wrong loads
    assert out.cross_tenant_hits == 0
    assert not out.residue, dict(out.residue)  # 0 wedges: every promotion and job resolved
    assert not out.counter_mismatches, out.counter_mismatches
    figures = FIGURES.setdefault(name, Counter())
    figures.update(out.outcomes)
    figures["external_hits"] += sum(r.external_hits for r in out.reports.values())
    figures["wrong_reads"] += sum(r.wrong_reads for r in out.reports.values())
    figures["slots_checked"] += sum(r.slots_checked for r in out.reports.values())
    figures["cross_tenant_hits"] += out.cross_tenant_hits
    figures["traces"] += 1
    figures.update({f"injected_{k}": v for k, v in out.injected.items()})
    print(f"\ntwo-engine traces so far ({name}): {dict(sorted(figures.items()))}")


# ------------------------------------------------------------------ tensor parallel (issue 30)
# Ranks simulated in process as for the host tier (hybridkv.vllm.harness.inprocess): each rank
# its own caches, worker-side connector, host memory and server connection; vLLM's own
# KVOutputAggregator folds the ranks' outputs. Replicated KV: kv_tp_replicas = the TP size (an
# all-MLA model), one host region the ranks share.

TP_CASES = [(2, False), (4, False), (2, True), (4, True)]


def _tp_id(case: tuple[int, bool]) -> str:
    return f"tp{case[0]}{'-replicated' if case[1] else ''}"


def _sets(server: Any) -> int:
    """SET commands the server ran (its own count, ``INFO commandstats``)."""
    admin = server.admin()
    calls = int(admin.info("commandstats").get("cmdstat_set", {}).get("calls", 0))
    admin.close()
    return calls


@pytest.mark.parametrize("case", TP_CASES, ids=_tp_id)
def test_tp_engines_share_every_ranks_shard(server: Any, case: tuple[int, bool]) -> None:
    tp, replicated = case
    shape = SHAPES[Layout.SLIDING_FULL]
    a = build(shape, server.port, tp=tp, replicated=replicated)
    ra = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    chunks = {key for key, _ in _remote(a).written_log}
    assert chunks
    written = [rank.worker.worker_remote.counters()["remote_written"] for rank in a.ranks]
    sets = _sets(server)
    print(f"\n{_tp_id(case)}: {len(chunks)} chunks, {sets} SETs, per rank {written}")
    if replicated:  # one shard per chunk, written by rank 0 alone: once, not once per rank
        assert written == [len(chunks)] + [0] * (tp - 1)
        assert sets == len(chunks)
    else:  # each rank its own shard under its own key
        assert written == [len(chunks)] * tp
        assert sets == tp * len(chunks)
    admin = server.admin()
    assert admin.dbsize() == sets
    admin.close()
    b = build(shape, server.port, tp=tp, replicated=replicated)
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    b_remote = _remote(b)
    assert b_remote.count["promoted"] > 0
    assert rb.external_hits > 0
    assert set(b_remote.promoted_log) <= set(_remote(a).written_log)
    fetched = [rank.worker.worker_remote.count["remote_fetches"] for rank in b.ranks]
    promotions = b_remote.count["promotions_started"]
    # One shared host region is filled by rank 0 alone; otherwise every rank fetches its own.
    assert fetched == ([promotions] + [0] * (tp - 1) if replicated else [promotions] * tp)
    for report in (ra, rb):
        assert report.finished == report.requests > 0
        assert report.slots_checked > 0
        assert report.wrong_reads == 0  # every rank's reads content-checked, rank-salted
        _every_token_once(report)
    for engine in (a, b):
        _quiescent(engine)
        _counters_add_up(engine)
        engine.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_a_shard_missing_on_one_rank_before_the_lookup_is_a_miss(server: Any, tp: int) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    a = build(shape, server.port, tp=tp)
    run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    # The last rank's shards vanish (TTL, eviction); every other rank's stay on the server.
    last = a.ranks[-1].worker.worker_remote
    gone = [redis_key(bytes.fromhex(key)) for key, _ in last.tier.snapshot()["remote"]]
    assert gone
    admin = server.admin()
    assert admin.delete(*gone) == len(gone)
    assert admin.dbsize() == (tp - 1) * len(gone)
    admin.close()
    b = build(shape, server.port, tp=tp)
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    count = _remote(b).count
    assert count["remote_lookups"] > 0
    assert count["remote_chunks_found"] == 0  # every chunk lacks one rank's shard: a miss
    assert count["promotions_started"] == 0
    assert [rank.worker.worker_remote.count["remote_fetches"] for rank in b.ranks] == [0] * tp
    assert rb.failed_loads == 0
    assert rb.wrong_reads == 0
    _every_token_once(rb)
    for engine in (a, b):
        _quiescent(engine)
        engine.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_a_shard_gone_before_one_ranks_fetch_fails_the_chunk_on_every_rank(
    server: Any, tp: int
) -> None:
    shape = SHAPES[Layout.SLIDING_FULL]
    a, _ = _serve_a_tp(shape, server.port, tp)
    b = build(shape, server.port, tp=tp, timeout_ms=100)
    victim = b.ranks[-1].worker.worker_remote
    fired: list[bytes] = []

    def before_fetch(order: FetchOrder) -> None:
        if not fired:  # the first fetch only: its shard on the last rank is gone
            fired.append(order.chunk_key)
            server.admin().delete(redis_key(order.shard_keys[victim.shard]))

    victim.before_fetch = before_fetch
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    count = _remote(b).count
    print(f"\ntp{tp}, one shard gone: {dict(count)}; {rb}")
    assert fired
    assert count["missing"] == 1
    assert victim.outcomes["missing"] == 1
    # The other ranks promoted their shards of that chunk, and the scheduler still failed it.
    for rank in b.ranks[:-1]:
        assert rank.worker.worker_remote.outcomes["promoted"] == count["promoted"] + 1
    assert all(key != fired[0] for key, _ in _remote(b).promoted_log)
    assert rb.failed_loads == 0  # the claim ended before the chunk: vLLM saw no load of it
    assert rb.finished == rb.requests
    assert rb.wrong_reads == 0
    _every_token_once(rb)
    _quiescent(b)
    _counters_add_up(b)
    for engine in (a, b):
        engine.close()


def _serve_a_tp(shape: Shape, port: int, tp: int) -> tuple[InProcessEngine, InProcessReport]:
    a = build(shape, port, tp=tp)
    report = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    return a, report


# A quarter of the TP 1 count per TP case (three cases, each engine up to four ranks): `nox -s
# remote`'s 200 give 50 traces each.
TP_TRACES = max(4, TRACES // 4)


@pytest.mark.parametrize("case", [(2, False), (4, False), (4, True)], ids=_tp_id)
@settings(
    max_examples=TP_TRACES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_two_engine_traces_with_remote_faults_under_tp(
    server: Any, case: tuple[int, bool], seed: int
) -> None:
    """The random traces with both engines on ``tp`` ranks, the faults before one drawn rank's
    fetches on its own shard: the same verdicts as at TP 1."""
    tp, replicated = case
    trace = random_two_engine_trace(random.Random(seed))
    _check_trace(play_two_engines(server, trace, tp=tp, replicated=replicated), _tp_id(case))
