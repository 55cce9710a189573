"""The random two-engine traces: one seed -> two in-process vLLM 0.33 engines (sliding window +
full attention, each its own HybridKVConnector and host tier) sharing one real Redis server,
with a server fault drawn for every fetch.

Under tensor parallel (``play(..., tp=2)``, ranks simulated in process) each rank writes and
fetches its own shard of every chunk; the faults fire before the fetches of one rank (drawn
from the seed), on that rank's own shard, so a deleted or corrupted shard is one rank's alone.

Shared by ``test_remote_two_engines.py`` (Hypothesis draws the seeds) and the soak runner
(``tools/soak.py``), so it imports no pytest. A trace is a pure function of its seed (the
server's answers aside: a paused or killed server answers by the wall clock).

:func:`play` reports what it observed (:class:`TwoEngineOutcome`) and asserts nothing; a run
past an engine's ``max_steps`` raises :class:`hybridkv.vllm.harness.engine_config.WedgedError`.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _invariants_on_vllm import InvariantChecker
from _two_engines import SHAPES, Prompt, build, flush_writes, run_prompts
from diffharness.layouts import Layout

from hybridkv.remote import redis_key
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.report import InProcessReport
from hybridkv.vllm.remote import FetchOrder

__all__ = [
    "FAULT_KINDS",
    "OUTCOMES",
    "TwoEngineOutcome",
    "TwoEngineTrace",
    "Wave",
    "counter_mismatches",
    "play",
    "random_two_engine_trace",
    "remote_residue",
]

OUTCOMES = ("promoted", "missing", "fault", "timeout", "corrupt")
"""How a promotion resolves (the scheduler's counters); all but ``promoted`` are failures."""
FAULT_KINDS = ("none", "deleted", "corrupted", "client-kill", "paused", "flushed", "killed")
"""What happens to the server just before a fetch."""


@dataclass(frozen=True, slots=True)
class Wave:
    """One prompt (a family's prefix plus ``tail`` drawn tokens) on ``engine`` under ``salt``,
    then the same prompt on the other engine: same tenant, other tenant, or not at all."""

    engine: str
    family: int
    tail: int
    salt: str | None
    mirror: str


@dataclass(frozen=True, slots=True)
class TwoEngineTrace:
    """A trace's plan: its families, waves, the fault cycle fetches draw from, the token seed."""

    families: int
    waves: tuple[Wave, ...]
    faults: tuple[str, ...]
    seed: int


def random_two_engine_trace(rng: random.Random) -> TwoEngineTrace:
    """1-3 families, 2-6 waves, 1-8 faults cycled over the fetches."""
    families = rng.randint(1, 3)
    waves = tuple(
        Wave(
            rng.choice("AB"),
            rng.randint(0, families - 1),
            rng.randint(0, 160),
            rng.choice((None, "t1")),
            rng.choice(("same", "other", "no")),
        )
        for _ in range(rng.randint(2, 6))
    )
    faults = tuple(rng.choice(FAULT_KINDS) for _ in range(rng.randint(1, 8)))
    return TwoEngineTrace(families, waves, faults, rng.randint(0, 2**16))


@dataclass(slots=True)
class TwoEngineOutcome:
    """One trace's observations, over both engines (the spec's invariants were checked on each
    after every step: a violation raises instead).

    Attributes:
        reports: each engine's last report (its running totals: the whole trace).
        injected: the faults fired before fetches, by kind.
        outcomes: promotions resolved, by outcome (:data:`OUTCOMES`).
        recovered: requests that met a failed promotion (or lookup) and still finished.
        cross_tenant_hits: promotions of a chunk that no engine wrote under the same salt.
        unfinished: requests not finished.
        unflushed: engines whose write-behind did not drain in time.
        residue: what an engine still holds at the end (:func:`remote_residue`).
        counter_mismatches: promotion counters that do not add up (:func:`counter_mismatches`).
        steps / load_jobs / failed_jobs: engine steps; the cores' load jobs and failed jobs.
        lookup_faults: remote lookups that failed (each answers nothing present).
        situations: the invariant checkers' tally (both engines; ``steps_checked`` among them).
    """

    reports: dict[str, InProcessReport] = field(default_factory=dict)
    injected: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    recovered: int = 0
    cross_tenant_hits: int = 0
    unfinished: int = 0
    unflushed: int = 0
    residue: Counter[str] = field(default_factory=Counter)
    counter_mismatches: list[str] = field(default_factory=list)
    steps: int = 0
    load_jobs: int = 0
    failed_jobs: int = 0
    lookup_faults: int = 0
    situations: Counter[str] = field(default_factory=Counter)


def remote_residue(engine: InProcessEngine) -> Counter[str]:
    """Nonzero leftovers once every request is done: transfers, promotions, pinned or storing
    store entries, GPU blocks out of vLLM's pool. Empty when quiescent."""
    connector = engine.scheduler.connector
    store = connector.core.store.stats()
    found = Counter(
        pending_transfers=engine.pending(),
        remote_in_flight=connector.remote.in_flight(),
        promotions_in_flight=connector.core.promotions_in_flight(),
        store_pinned=store.pinned,
        store_storing=store.storing,
        leaked_gpu_blocks=engine.leaked_blocks(),
    )
    return +found


def fetching_workers(engine: InProcessEngine) -> list[Any]:
    """The ranks' worker-side remote tiers that fetch (all but replicas sharing a host region
    their group's first rank fills)."""
    found = []
    for rank in engine.ranks:
        remote = rank.worker.worker_remote
        if remote.shards.fetches(remote.rank):
            found.append(remote)
    return found


def counter_mismatches(engine: InProcessEngine) -> list[str]:
    """Promotion counters that do not add up: started = resolved; on every fetching rank,
    fetches = their outcomes = the scheduler's resolved promotions (each rank fetched each
    promotion once); the scheduler's outcomes = the rank's (one rank), or bounded by the ranks'
    (several: a promotion is PROMOTED only if every rank promoted its shard)."""
    count = engine.scheduler.connector.remote.count
    resolved = {name: count[name] for name in OUTCOMES}
    failed = sum(resolved.values()) - resolved["promoted"]
    workers = fetching_workers(engine)
    found = []
    if count["promotions_started"] != sum(resolved.values()):
        found.append(f"promotions_started != resolved: {count}")
    for worker in workers:
        outcomes = worker.outcomes
        if worker.count["remote_fetches"] != sum(outcomes.values()):
            found.append(f"remote_fetches != outcomes: {worker.count} {outcomes}")
        if sum(outcomes.values()) != sum(resolved.values()):
            found.append(f"rank {worker.rank} fetched {outcomes}, scheduler resolved {resolved}")
        if len(workers) == 1 and outcomes != resolved:
            found.append(f"worker outcomes {outcomes} != scheduler's {resolved}")
        if outcomes["promoted"] < resolved["promoted"]:
            found.append(f"rank {worker.rank} promoted {outcomes}, scheduler {resolved}")
    rank_failures = [sum(w.outcomes.values()) - w.outcomes["promoted"] for w in workers]
    if not max(rank_failures) <= failed <= sum(rank_failures):
        found.append(f"scheduler failures {failed} outside the ranks' {rank_failures}")
    return found


def _failures(engine: InProcessEngine) -> int:
    count = engine.scheduler.connector.remote.count
    return count["remote_lookup_faults"] + sum(count[n] for n in OUTCOMES if n != "promoted")


def restart_if_dead(server: Any) -> None:
    """Start the server again if a fault killed it."""
    if server._process is None or server._process.poll() is not None:
        server.start()


def _kill_connections(server: Any) -> None:
    admin = server.admin()
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()


def _injector(server: Any, faults: tuple[str, ...], injected: Counter[str], shard: int) -> Any:
    cycle = itertools.cycle(faults)  # every fetch draws the next fault

    def before_fetch(order: FetchOrder) -> None:
        restart_if_dead(server)
        kind = next(cycle)
        injected[kind] += 1
        key = redis_key(order.shard_keys[shard])  # the fetching rank's own shard
        if kind == "deleted":
            server.admin().delete(key)
        elif kind == "corrupted":
            server.admin().setrange(key, 100, b"\x00\x01" * 4)
        elif kind == "client-kill":
            _kill_connections(server)
        elif kind == "paused":
            admin = server.admin()
            admin.client_pause(150, all=True)  # past the 100 ms timeout
            admin.close()
        elif kind == "flushed":
            server.admin().flushall()
        elif kind == "killed":
            server.kill()

    return before_fetch


def play(
    server: Any, trace: TwoEngineTrace, *, tp: int = 1, replicated: bool = False
) -> TwoEngineOutcome:
    """Play ``trace`` on ``server`` (emptied first) with engines of ``tp`` ranks
    (``replicated``: holding replicated KV); both engines are closed after."""
    shape = SHAPES[Layout.SLIDING_FULL]
    restart_if_dead(server)
    admin = server.admin()
    admin.flushall()
    admin.close()
    rng = random.Random(trace.seed)
    prefixes = [[rng.randint(3, 999) for _ in range(rng.randint(64, 200))] for _ in range(3)]
    engines = {
        name: build(shape, server.port, namespace="n", timeout_ms=100, tp=tp, replicated=replicated)
        for name in "AB"
    }
    checkers = {name: InvariantChecker(engine) for name, engine in engines.items()}
    out = TwoEngineOutcome()
    try:
        for engine in engines.values():
            # The faults fire before one fetching rank's fetches (drawn from the seed).
            workers = fetching_workers(engine)
            faulty = workers[trace.seed % len(workers)]
            faulty.before_fetch = _injector(server, trace.faults, out.injected, faulty.shard)
        for i, wave in enumerate(trace.waves):
            tokens = prefixes[wave.family] + [rng.randint(3, 999) for _ in range(wave.tail)]
            tokens = tokens[: shape.settings.max_model_len - 8]
            runs = [(wave.engine, wave.salt)]
            if wave.mirror != "no":
                flipped = "t1" if wave.salt is None else None
                other = wave.salt if wave.mirror == "same" else flipped
                runs.append(("B" if wave.engine == "A" else "A", other))
            for j, (who, tenant) in enumerate(runs):
                engine = engines[who]
                failed_before = _failures(engine)
                prompt = Prompt(f"w{i}-{j}", tokens, tenant)
                report = run_prompts(engine, [prompt], after_step=checkers[who].after_step)
                # One request per call: it met a failed promotion and finished all the same.
                out.recovered += report.finished * (_failures(engine) > failed_before)
                out.reports[who] = report
                out.unflushed += not flush_writes(engine)
                restart_if_dead(server)
        _observe(engines, out)
        for checker in checkers.values():
            out.situations.update(checker.situations)
    finally:
        for engine in engines.values():
            engine.close()
    return out


def _observe(engines: dict[str, InProcessEngine], out: TwoEngineOutcome) -> None:
    written: dict[bytes, set[str | None]] = {}
    for engine in engines.values():
        for key, salt in engine.scheduler.connector.remote.written_log:
            written.setdefault(key, set()).add(salt)
    for name, engine in engines.items():
        remote = engine.scheduler.connector.remote
        last = out.reports.get(name) or engine.report(0)
        out.reports[name] = last
        out.unfinished += sum(not r.is_finished() for r in engine.requests.values())
        out.cross_tenant_hits += sum(
            1 for key, salt in remote.promoted_log if written.get(key) != {salt}
        )
        out.residue.update(remote_residue(engine))
        out.counter_mismatches += counter_mismatches(engine)
        out.outcomes.update({o: remote.count[o] for o in OUTCOMES})
        out.lookup_faults += remote.count["remote_lookup_faults"]
        core = engine.scheduler.connector.core.stats()
        out.steps += engine.tally.steps
        out.load_jobs += core.load_jobs
        out.failed_jobs += core.load_jobs_failed + core.store_jobs_failed
