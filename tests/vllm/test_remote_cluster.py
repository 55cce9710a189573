"""Two engines on a Redis Cluster (issue 30, item 2): two in-process vLLM 0.33 engines (vLLM's
real ``Scheduler``, each its own ``HybridKVConnector`` pair and host tier, every slot the
forward reads content-checked) share a real 6-node cluster (3 primaries, 3 replicas, started
by ``tests/remote/_redis_cluster``) through ``remote_url = "redis+cluster://..."``.

One run, three phases, the spec's invariants checked on each engine after every step:

1. A serves a chat trace: its chunks spread over the three shards.
2. B serves the same prompts and the primary holding the chunk of B's first fetch is killed
   just before that fetch: B's fetches and lookups on that shard fail (counted), B recomputes
   exactly what is missing, 0 wrong reads, 0 wedges. The replica takes over; then a fresh
   engine promotes chunks again, those on the promoted replica among them, and B's own lookups
   answer again (recovered).
3. A shard is added (a primary and its replica) and 1024 slots move to it (``redis-cli
   --cluster reshard``, keys migrated while the engines run: ASK, then MOVED) while A and B
   serve new tenants' prompts round after round: 0 wrong reads, B promotes A's chunks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))  # _redis_cluster

pytestmark = [pytest.mark.vllm]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import InvariantChecker  # noqa: E402
from _redis_cluster import LocalCluster, cli_or_skip  # noqa: E402
from _two_engine_traces import OUTCOMES, counter_mismatches, remote_residue  # noqa: E402
from _two_engines import (  # noqa: E402
    SHAPES,
    build,
    chat_prompts,
    flush_writes,
    redis_binary_or_skip,
    run_prompts,
)
from diffharness.layouts import Layout  # noqa: E402

from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.remote import redis_key  # noqa: E402
from hybridkv.vllm.config import parse_extra_config  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.remote import FetchOrder, remote_config  # noqa: E402

SHAPE = SHAPES[Layout.SLIDING_FULL]
BACKOFF_MS = 100


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    started = LocalCluster(redis_binary_or_skip(), cli_or_skip(), tmp_path)
    try:
        started.start()
        yield started
    finally:
        started.stop()


def test_the_cluster_url_parses_to_its_seeds_and_bad_ones_are_refused() -> None:
    url = "redis+cluster://10.0.0.5:7000,10.0.0.6:7001/0"
    settings = parse_extra_config({"remote_url": url}).remote
    assert settings is not None
    assert settings.cluster_nodes == (("10.0.0.5", 7000), ("10.0.0.6", 7001))
    assert remote_config(settings).cluster_nodes == settings.cluster_nodes
    for bad, why in (
        ("redis+cluster://", "seed ''"),
        ("redis+cluster://h:1,,h:2", "seed ''"),
        ("redis+cluster://h", "seed 'h'"),
        ("redis+cluster://user:pw@h:1", "carries credentials"),
        ("rediss+cluster://h:1,u:pw@h:2", "carries credentials"),
        ("redis+cluster://h:1/2", "database '2'"),
        ("redis+cluster://h:1,h:1", "twice"),
        ("redis+cluster://h:70000", "1..65535"),
        ("rediscluster://h:1", "redis\\+cluster://HOST:PORT,HOST:PORT"),
    ):
        with pytest.raises(HybridKVConfigError, match=f"remote_url.*{why}"):
            parse_extra_config({"remote_url": bad})


def _checked(engine: InProcessEngine, checkers: list[InvariantChecker]) -> Any:
    checker = InvariantChecker(engine)
    checkers.append(checker)
    return checker.after_step


def _whole(engine: InProcessEngine, report: InProcessReport) -> None:
    """Every request finished, 0 wrong reads, every prompt position computed or hit once
    (``report``: the engine's running totals)."""
    assert report.finished > 0
    assert all(request.is_finished() for request in engine.requests.values())
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.preemptions == 0
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens, report


def _settled(engine: InProcessEngine) -> None:
    """0 wedges: nothing in flight, pinned or leaked; the promotion counters add up."""
    assert not remote_residue(engine), dict(remote_residue(engine))
    assert not counter_mismatches(engine), counter_mismatches(engine)


def _failures(engine: InProcessEngine) -> dict[str, int]:
    count = engine.scheduler.connector.remote.count
    names = ("remote_lookup_faults", *(n for n in OUTCOMES if n != "promoted"))
    return {name: count[name] for name in names if count[name]}


@pytest.mark.remote
def test_two_engines_on_a_cluster_through_a_killed_primary_and_a_new_shard(
    cluster: LocalCluster,
) -> None:
    checkers: list[InvariantChecker] = []
    # One circuit breaker per side covers the whole cluster: the killed primary's faults open
    # B's for the backoff, and the cluster is skipped meanwhile, its healthy shards too. A
    # 100 ms backoff (not 5 s) keeps that skipping out of the phases after the failover, whose
    # subject is the slot map (the replica's, the moved slots'), not the breaker.
    a = build(SHAPE, cluster.url, breaker_backoff_ms=BACKOFF_MS)
    b = build(SHAPE, cluster.url, breaker_backoff_ms=BACKOFF_MS)
    engines = [a, b]
    try:
        # 1. A's chunks spread over the shards.
        a_step = _checked(a, checkers)
        _whole(a, run_prompts(a, chat_prompts(SHAPE.trace, "a-"), after_step=a_step))
        assert flush_writes(a)
        per_shard = cluster.keys_per_primary()
        assert len(per_shard) == 3, per_shard
        assert all(per_shard.values()), per_shard
        cluster.wait_replicated()

        # 2. A primary dies just before B's first fetch.
        killed: list[int] = []

        def kill_first(order: FetchOrder) -> None:
            if not killed:
                killed.append(cluster.owner(redis_key(order.chunk_key)))
                cluster.kill(killed[0])

        b.worker.worker_remote.before_fetch = kill_first
        b_step = _checked(b, checkers)
        rb = run_prompts(b, chat_prompts(SHAPE.trace, "b-"), after_step=b_step)
        b.worker.worker_remote.before_fetch = None
        _whole(b, rb)
        assert killed
        failed = _failures(b)
        assert failed, "the killed primary cost B nothing: no fetch or lookup reached it"
        assert rb.failed_loads == 0  # a failed fetch never reaches vLLM
        promoted_to = cluster.wait_failover(killed[0])
        # Recovered: a fresh engine promotes again, from the promoted replica's shard too.
        c = build(SHAPE, cluster.url, breaker_backoff_ms=BACKOFF_MS)
        engines.append(c)
        rc = run_prompts(c, chat_prompts(SHAPE.trace, "c-"), after_step=_checked(c, checkers))
        _whole(c, rc)
        c_remote = c.scheduler.connector.remote
        assert c_remote.count["promoted"] > 0
        assert not _failures(c), _failures(c)
        owners = {cluster.owner(redis_key(key)) for key, _ in c_remote.promoted_log}
        assert promoted_to in owners, (promoted_to, owners)
        # B's own lookups answer again (each client faults at most once after the failover).
        # Counted in EXISTS round trips: lookups asked off the scheduler thread share one
        # round trip when they wait together, and a faulted one answers each of them.
        queue = b.scheduler.connector.remote.lookups.queue
        before = queue.counts().faulted
        rb2 = run_prompts(b, chat_prompts(SHAPE.trace, "b2-", salt="after"), after_step=b_step)
        _whole(b, rb2)
        assert queue.counts().faulted - before <= 1
        print(
            f"\nprimary {killed[0]} killed before B's first fetch; B's failures {failed}; "
            f"replica {promoted_to} took over; C promoted {c_remote.count['promoted']} "
            f"(owners {sorted(owners)})"
        )

        # 3. A shard joins and slots move to it while A and B serve.
        added = cluster.add_shard()
        reshard = cluster.reshard(added, 1024)
        rounds = promoted_during = 0
        while reshard.poll() is None or rounds == 0:
            tenant = f"r{rounds}"
            ra = run_prompts(
                a, chat_prompts(SHAPE.trace, f"{tenant}a-", salt=tenant), after_step=a_step
            )
            assert flush_writes(a)
            before = b.scheduler.connector.remote.count["promoted"]
            rb3 = run_prompts(
                b, chat_prompts(SHAPE.trace, f"{tenant}b-", salt=tenant), after_step=b_step
            )
            promoted_during += b.scheduler.connector.remote.count["promoted"] - before
            _whole(a, ra)
            _whole(b, rb3)
            rounds += 1
        output = (cluster.workdir / f"reshard-{added}.log").read_text()
        assert reshard.wait() == 0, output[-2000:]
        cluster.wait_ready()
        per_shard = cluster.keys_per_primary()
        print(
            f"reshard to {added} during {rounds} rounds; B promoted {promoted_during} of A's "
            f"chunks meanwhile; keys per primary now {per_shard}; "
            f"invariant checks {sum(ch.situations['steps_checked'] for ch in checkers)} steps"
        )
        assert cluster.topology()[added][2] == 1024  # the new shard owns the moved slots
        assert per_shard[added] > 0  # and the chunks that lived in them
        assert promoted_during > 0
        for engine in engines:
            _settled(engine)
    finally:
        for engine in engines:
            engine.close()
