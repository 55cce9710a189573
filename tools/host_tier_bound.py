"""What any eviction policy could load from a host tier below the working set: MIN beside ARC/LRU.

Issue 11's goal "below the working set (0.5x), hits within 20% of the 1x run with ARC" asks
whether the loss is the policy's or the tier's. This tool runs ``tools/bench_vs_native.py``'s
sliding + full chat through HybridKVConnector on vLLM 0.33's real ``Scheduler`` (its default
chunk, one block here; copy delay 1; the host tier sized as the bench's sweep sizes it),
records the host tier's traffic (:mod:`hybridkv.testbed.host_replay`: each scheduled request's
last ask, each ``prepare_store`` offer, steps and polls), and replays it
against fresh stores of the same capacity under LRU, ARC, Belady's MIN (offline: evicts the key
needed furthest in the future; pinned and STORING entries stay unevictable) and MIN with bypass
(may also decline a store). The replay with the run's own policy must reproduce the run's
claims, ask by ask (the tool exits 1 otherwise), so the other rows are comparable. The request
sequence is the recorded one: a policy that loaded more would also change later GPU hits.

Printed per host tier (0.5x, 1x and 2x of the trace's working set, the bench's figures) and
recorded policy: the run's loaded tokens, then per replayed policy the tokens claimed, keys
loaded of the keys wanted (every key resident), deferred asks, stores, evictions, declined
stores, the share of the recorded 1x run's loaded tokens, the prefill the run would have
computed with that store (the run's computed plus loaded tokens, less the replay's claims) and
the run's computed prefill over it (``run/this``: at most 1.10 against ``min`` is issue 18's
goal at 1x).

Usage: ``python tools/host_tier_bound.py [--answers 4] [--factors 0.5,1.0,2.0]
[--policies arc,lru]``; needs vLLM 0.33 (``nox -s vllm`` installs it).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vs_native, _vllm_tool
import bench_vs_native as bench

from hybridkv.testbed.host_replay import (
    Ask,
    Event,
    Offer,
    Poll,
    Refresh,
    ReplayResult,
    Step,
    replay,
    unlimited,
)


class Recorder:
    """Wraps a HybridKVConnector core's scheduler-side calls and its store's ``prepare_store``
    to log :data:`~hybridkv.testbed.host_replay.Event` values in call order.

    Allocations and polls are read at the connector (``connector``), not at the core: the
    connector hands the core only allocations with external tokens and only outputs that
    report something, while an ask answered 0 counts too and every poll ticks the replay's
    copy delay.
    """

    def __init__(self, core: Any, connector: Any) -> None:
        self.events: list[Event] = []
        self.core = core
        self._asked: dict[str, tuple[int, int, tuple[tuple[bytes, ...], ...]]] = {}
        self._in_meta = False
        ask, alloc = core.get_num_new_matched_tokens, connector.update_state_after_alloc
        meta, output = core.build_connector_meta, connector.update_connector_output
        prepare_store, refresh = core.store.prepare_store, core.store.refresh
        units = core.geometry.units

        def asked(request: Any, num_computed_tokens: int) -> Any:
            claim = ask(request, num_computed_tokens)
            n = len(request.token_ids)
            chain = core._keys(request)  # the request's hash chain, as the claim rule reads it
            keys = tuple(
                tuple(chain.key(g, j) for j in range(n // unit)) for g, unit in enumerate(units)
            )
            self._asked[request.request_id] = (num_computed_tokens, n, keys)
            return claim

        def allocated(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            # vLLM allocates a waiting request once its last ask is answered (an ASYNC claim
            # then waits for its load and is not asked again): that ask is the one that counts.
            found = self._asked.pop(request.request_id, None)
            if found is not None:
                start, n, keys = found
                self.events.append(Ask(request.request_id, start, n, keys, num_external_tokens))
            return alloc(request, blocks, num_external_tokens)

        def built(step: Any) -> Any:
            self._in_meta = True
            try:
                return meta(step)
            finally:
                self._in_meta = False
                self.events.append(Step())

        def offered(keys: Any, *rest: Any) -> Any:  # rest: priority, then bound keys
            if self._in_meta:
                self.events.append(Offer(tuple(keys), *rest[:1], *map(tuple, rest[1:])))
            return prepare_store(keys, *rest)

        def refreshed(keys: Any) -> Any:  # a finished request's units, head first
            self.events.append(Refresh(tuple(keys)))
            return refresh(keys)

        def reported(connector_output: Any) -> Any:
            self.events.append(Poll())
            return output(connector_output)

        core.get_num_new_matched_tokens = asked
        connector.update_state_after_alloc = allocated
        core.build_connector_meta = built
        connector.update_connector_output = reported
        core.store.prepare_store = offered
        core.store.refresh = refreshed


def record(
    case: Any, trace: Any, variant: Any, chunk_bytes: int
) -> tuple[list[Event], Any, Any, int]:
    """One run of ``variant``: its events, its report, the core's geometry, the store's
    capacity in entries."""
    engine, _ = bench._engine(case, variant, chunk_bytes)
    core = engine.scheduler.connector.core
    recorder = Recorder(core, engine.scheduler.connector)
    report = bench.run_trace(engine, trace)
    return recorder.events, report, core.geometry, core.store.capacity


def replays(events: list[Event], geometry: Any, capacity: int, delay: int) -> list[ReplayResult]:
    """The recorded traffic under LRU, ARC, MIN and MIN with bypass, same capacity."""
    out = [replay(events, geometry, capacity, p, delay=delay) for p in ("lru", "arc", "min")]
    out.append(replay(events, geometry, capacity, "min", delay=delay, bypass=True))
    no_limit = replay(events, geometry, unlimited(events), "lru", delay=delay)
    out.append(replace(no_limit, policy="no limit"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=4, help="answer tokens per turn")
    parser.add_argument("--factors", default="0.5,1.0,2.0", help="host tier / working set")
    parser.add_argument("--policies", default="arc,lru", help="policies of the recorded runs")
    args = parser.parse_args(argv)
    (case,) = (c for c in bench._cases(False) if c.name == "sliding+full")
    trace = replace(case.trace, output_len=args.answers)
    probe = bench.InProcessEngine(case.config_json, case.settings)
    probe.close()
    # Sized as the bench sizes its sweep: the working set in native chunks, hybridkv given
    # the same bytes, so "0.5x" is the bench's 0.5x row (one entry per group block here).
    working = bench.working_set_chunks(trace, probe)
    chunk_bytes = bench.native_chunk_bytes(probe)
    factors = [float(f) for f in args.factors.split(",")]
    print(
        f"== sliding+full, {trace.convs} conversations x {trace.turns} turns, answers "
        f"{trace.output_len} tokens; hybridkv chunk_size the default "
        f"({bench.default_chunk(probe)} tokens), delay 1; working set {working} native chunks "
        f"of {chunk_bytes} B; replays keep the recorded asks and offers"
    )
    runs: dict[tuple[str, float], tuple[Any, list[ReplayResult]]] = {}
    failures = 0
    for policy in args.policies.split(","):
        for factor in factors:
            chunks = max(1, round(factor * working))
            variant = bench.Variant("hybridkv", policy, 1, chunks)
            events, report, geometry, capacity = record(case, trace, variant, chunk_bytes)
            results = replays(events, geometry, capacity, delay=1)
            runs[(policy, factor)] = (report, results)
            own = next(r for r in results if r.policy == policy)
            asks = [e for e in events if isinstance(e, Ask)]
            recorded = tuple(a.loaded for a in asks)
            faithful = own.ends == recorded and sum(recorded) == report.external_loaded
            failures += not faithful
            print(
                f"-- recorded hybridkv {policy} host={factor}x: {chunks} chunks = {capacity} "
                f"entries; loaded {report.external_loaded} tokens over {len(asks)} asks, "
                f"gpu hits {report.gpu_prefix_hits}; replay under {policy} "
                + ("reproduces every ask" if faithful else f"DIFFERS ({own.claimed} tokens)")
            )
    base = {p: runs[(p, 1.0)][0].external_loaded for p, f in runs if f == 1.0}
    header = (
        f"{'recorded':<20} {'replayed':<12} {'claimed':>7} {'keys':>5} {'defer':>5} "
        f"{'stored':>6} {'evict':>5} {'declined':>8} {'/1x':>5} {'computed':>8} {'run/this':>8}"
    )
    print(header)
    for (policy, factor), (report, results) in runs.items():
        one_x = base.get(policy)
        for r in results:
            share = f"{r.claimed / one_x:5.2f}" if one_x else f"{'-':>5}"
            # Same request sequence: what the replayed store does not load is computed.
            computed = report.prefill_computed + report.external_loaded - r.claimed
            print(
                f"{policy + ' host=' + str(factor) + 'x':<20} {r.policy:<12} {r.claimed:7d} "
                f"{r.key_reads:5d} {r.deferred:5d} {r.stored:6d} "
                f"{r.evicted:5d} {r.bypassed:8d} {share} {computed:8d} "
                f"{report.prefill_computed / computed:8.2f}"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
