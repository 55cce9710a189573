"""``hybridkv simulate`` with transfers that take modelled time: loads span steps, the load
deadline fires, requests are preempted and aborted while loads are in flight, and every loaded
and read block still holds what recomputation would write, with every invariant (TR-1 on the
jobs in flight included) checked every step, for both connectors. Every scenario also proves
the report balances: prompt tokens = first-time computed + loaded + GPU hit + unserved (the
prompt tokens of aborted requests never served), with every read served by a counted event,
and each injected failure observed to recover (or ended with its aborted request).

The configurations are the built-in workloads with a slower host link, so each event happens
several times in a run of a few seconds; the counts they produce are in docs/howto/simulate.md.
Three broken variants show the checks see what these events put at risk: a scheduler that
frees an abandoned load's blocks before its copy stops, an engine that reports a load before its
bytes land, and a connector that does not pin store sources, so a preempted request's blocks
are rewritten before their store's copy reads them (TR-2).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest

from hybridkv.cli.main import main
from hybridkv.simulator import engine as sim_engine
from hybridkv.simulator import engine_adapter
from hybridkv.simulator import optimized as sim_optimized
from hybridkv.simulator.run import SimOptions, simulate
from hybridkv.testbed.timed_engine import TimedTransferEngine
from hybridkv.transfer import Direction, FinishedJob, JobId
from spec.connector_api import RequestId
from spec.scheduler import Scheduler
from spec.scheduler.loads import ParkedLoad

CONNECTORS = ["optimized", "reference"]

# Several requests behind one shared prefix, a 1 GB/s link and a 4-step deadline: loads take
# up to 25 steps, so deadlines fire, and the restarted requests are preempted while the copies
# they abandoned are still in flight.
SLOW_SHARED = SimOptions(
    trace="shared-prefix", requests=12, transfer_gbps=1.0, load_deadline_steps=4, check=True
)
# Chat turns whose clients give up when no first token came within 1-16 steps: the turns
# waiting for a slow load are the ones cancelled.
IMPATIENT = SimOptions(requests=24, aborts=1.0, transfer_gbps=1.0, check=True)
# The default workload and link, under GPU pressure (invariants are checked in the two above).
DEFAULT_12 = SimOptions(requests=12)
# The two above with 30% of jobs failing: failures recovered while loads span steps and a
# deadline fires, and failures of requests their clients then cancel.
SLOW_SHARED_FAULTS = dataclasses.replace(SLOW_SHARED, faults=0.3)
IMPATIENT_FAULTS = dataclasses.replace(IMPATIENT, faults=0.3)


@cache
def _run(options: SimOptions, connector: str) -> dict[str, Any]:
    return simulate(dataclasses.replace(options, connector=connector))


def _assert_balances(report: dict[str, Any], *, unserved: bool = False) -> None:
    """The identity holds with its three first-time terms non-zero (and the unserved term
    exactly when requests were aborted), no read went unserved, and every injected failure was
    seen to recover or ended with its request."""
    computed = report["prefill_tokens_computed"]
    loaded = report["prefill_tokens_loaded"]
    hit = report["local_hit_tokens"]
    rest = report["prompt_tokens_unserved"]
    assert report["prompt_tokens"] == computed + loaded + hit + rest
    assert report["identity_holds"] is True
    assert min(computed, loaded, hit) > 0
    assert (rest > 0) is unserved
    assert report["unaccounted_reads"] == 0
    ended = report["failures_recovered"] + report["failures_ended"]
    assert ended == report["failures_injected"]
    if not unserved:
        assert report["failures_ended"] == 0  # no request ended early: all must recover


def _assert_clean(report: dict[str, Any]) -> None:
    assert report["blocks_verified"] > 0
    assert report["wrong_content_loads"] == report["wrong_content_reads"] == 0
    assert report["transfers"]["store_blocks_verified"] > 0
    assert report["transfers"]["wrong_content_stores"] == 0
    assert report["invariant_checks"] > 0
    assert report["invariant_violations"] == 0, report["violations"]
    assert report["verdict"] == "pass"


@pytest.mark.parametrize("connector", CONNECTORS)
def test_loads_span_steps(connector: str) -> None:
    report = _run(SLOW_SHARED, connector)
    t = report["transfers"]
    assert report["load_jobs"] >= t["load_jobs_spanning_steps"] > 0
    assert t["longest_load_steps"] >= 2
    _assert_clean(report)
    _assert_balances(report)


def test_loads_span_steps_with_the_default_model() -> None:
    report = _run(DEFAULT_12, "optimized")
    t = report["transfers"]
    assert (t["gbps"], t["latency_us"], t["step_ms"]) == (12.0, 50.0, 20.0)
    assert report["load_jobs"] > t["load_jobs_spanning_steps"] > 0
    assert report["prefill_tokens_loaded"] > 0
    assert report["wrong_content_loads"] == report["wrong_content_reads"] == 0
    assert report["verdict"] == "pass"
    _assert_balances(report)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_load_deadline_fires_and_abandoned_blocks_wait_for_their_copy(connector: str) -> None:
    report = _run(SLOW_SHARED, connector)
    t = report["transfers"]
    assert t["deadlines_fired"] > 0
    # Every abandoned copy reported later; until then its blocks stayed held (TR-1, checked
    # every step) and the request recomputed.
    assert t["abandoned_loads_reported"] == t["deadlines_fired"]
    assert t["longest_load_steps"] > 4  # the deadline: the late copies ran past it
    assert report["finished"] == {"finished_length": SLOW_SHARED.requests}
    _assert_clean(report)
    _assert_balances(report)
    # The abandoned loads' tokens were served by recomputation, counted once; the GPU hits the
    # abandonment took back were served again after a failure, outside the identity.
    assert report["served_again"]["failure"]["computed"] > 0
    # A copy abandoned at its deadline serves nothing when it lands: had it served its tokens,
    # those its request recomputed meanwhile would show as served again while in place.
    assert not any(report["served_again"]["replay"].values())


@pytest.mark.parametrize("connector", CONNECTORS)
def test_preemption_during_a_load(connector: str) -> None:
    report = _run(SLOW_SHARED, connector)
    t = report["transfers"]
    assert t["preemptions_during_loads"] >= t["preemptions_of_loading_requests"] > 0
    _assert_clean(report)
    _assert_balances(report)
    assert sum(report["served_again"]["preemption"].values()) > 0


@pytest.mark.parametrize("connector", CONNECTORS)
def test_abort_during_a_load(connector: str) -> None:
    report = _run(IMPATIENT, connector)
    t = report["transfers"]
    assert t["aborts"] >= t["aborts_during_load"] > 0
    assert report["finished"]["finished_aborted"] == t["aborts"]
    _assert_clean(report)
    # The aborted requests' prompt tokens never served are the identity's unserved term; a load
    # that lands after its request was aborted serves nothing.
    _assert_balances(report, unserved=True)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_failures_recover_while_loads_span_steps_and_the_deadline_fires(connector: str) -> None:
    report = _run(SLOW_SHARED_FAULTS, connector)
    t = report["transfers"]
    assert t["load_jobs_spanning_steps"] > 0
    assert t["deadlines_fired"] > 0
    assert report["failed_loads"] > 0
    assert report["failed_stores"] > 0
    assert report["failures_recovered"] == report["failures_injected"]
    assert report["recovered_loads"] == report["failed_loads"]
    _assert_clean(report)
    _assert_balances(report)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_failures_of_requests_aborted_during_loads_end_with_them(connector: str) -> None:
    report = _run(IMPATIENT_FAULTS, connector)
    t = report["transfers"]
    assert t["aborts_during_load"] > 0
    assert report["failed_loads"] > 0
    assert report["failures_ended"] > 0  # a failed load whose request was then cancelled
    assert report["failures_recovered"] > 0
    _assert_clean(report)
    _assert_balances(report, unserved=True)


@pytest.mark.parametrize(
    "options",
    [SLOW_SHARED, IMPATIENT, SLOW_SHARED_FAULTS, IMPATIENT_FAULTS],
    ids=["deadline", "aborts", "deadline-faults", "aborts-faults"],
)
def test_both_connectors_meet_the_same_events(options: SimOptions) -> None:
    fast, ref = _run(options, "optimized"), _run(options, "reference")
    assert fast["transfers"] == ref["transfers"]
    timing = ("seconds", "load_gbps", "store_gbps", "setup")
    assert {k: v for k, v in fast.items() if k not in timing} == {
        k: v for k, v in ref.items() if k not in timing
    }


def test_the_table_shows_the_transfer_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", "shared-prefix", "--requests", "12"]
    assert main([*argv, "--transfer-gbps", "1", "--load-deadline-steps", "4"]) == 0
    out = capsys.readouterr().out
    for phrase in (
        "copy-time model",
        "1 GB/s",
        "loads that spanned steps",
        "load deadlines fired",
        "preemptions during loads",
        "aborts during load",
    ):
        assert phrase in out


# ----------------------------------------------------------------- broken variants


class _FreesAbandonedBlocks(Scheduler):
    """Frees an abandoned load's blocks at once, while its copy may still write them."""

    def _abandon(self, rid: RequestId) -> None:
        super()._abandon(rid)
        parked = self.parked[rid]
        self.kv.pool.free_blocks(reversed(parked.blocks))
        self.parked[rid] = ParkedLoad(parked.load, ())


def test_checks_catch_blocks_reused_before_an_abandoned_copy_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sim_engine, "Scheduler", _FreesAbandonedBlocks)
    report = simulate(dataclasses.replace(SLOW_SHARED, connector="reference"))
    assert report["transfers"]["deadlines_fired"] > 0
    assert any(": TR-1: " in v for v in report["violations"])
    assert report["verdict"] == "fail"


class _ReportsLoadsAtOnce(TimedTransferEngine):
    """Reports each load as done in the step it was submitted; its bytes still land later."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._told: set[JobId] = set()

    def poll(self) -> list[FinishedJob]:
        real = [f for f in super().poll() if f.job_id not in self._told]
        early = [
            p.job_id
            for p in self.pending()
            if p.direction is Direction.LOAD and p.job_id not in self._told
        ]
        self._told.update(early)
        return real + [FinishedJob(j, True) for j in early]


def test_content_checks_catch_a_load_reported_before_its_bytes_land(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sim_optimized, "TimedTransferEngine", _ReportsLoadsAtOnce)
    report = simulate(DEFAULT_12)
    assert report["wrong_content_loads"] > 0
    assert report["verdict"] == "fail"


def test_store_checks_catch_a_source_rewritten_before_its_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pins(self: engine_adapter.CoreConnector, pool: object) -> None:
        """The core never learns the pool, so it pins no store source."""

    monkeypatch.setattr(engine_adapter.CoreConnector, "bind_gpu_block_pool", no_pins)
    report = simulate(dataclasses.replace(SLOW_SHARED, check=False))
    assert report["transfers"]["wrong_content_stores"] > 0
    assert report["verdict"] == "fail"
