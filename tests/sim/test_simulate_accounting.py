"""``hybridkv simulate``'s accounting: the token identity balances, recovery is observed (and a
broken recovery shows), the plot draws the table's figures, and loads reported steps after
they ran (landing late, or abandoned at their deadline) keep every figure exact.

The runs are 12 requests of the default multi-turn workload: at that size the GPU prefix cache
hits, the host store loads, and ``--faults 0.05``/``0.3`` fail loads whose tokens are then both
recomputed and reloaded, so every term of the identity and of the served-again rows is
non-zero (asserted, so a change that empties a term fails here rather than passing vacuously).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import pytest

from hybridkv.cli.sim_plot import plot_series
from hybridkv.cli.sim_report import identity_line, rows
from hybridkv.simulator import engine as sim_engine
from hybridkv.simulator import reference as sim_reference
from hybridkv.simulator.ledger import Cause, Source, TokenLedger
from hybridkv.simulator.run import SimOptions, simulate
from hybridkv.simulator.setup import derive_setup
from spec.connector import ReferenceConnector
from spec.connector_api import (
    ConnectorMeta,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferKind,
)
from spec.scheduler import RecoveryMode, RecoveryRecord, Scheduler
from spec.scheduler.recovery import FailureReport

SIZE = SimOptions(requests=12)


def _identity_terms(report: dict[str, Any]) -> tuple[int, int, int]:
    return (
        report["prefill_tokens_computed"],
        report["prefill_tokens_loaded"],
        report["local_hit_tokens"],
    )


@pytest.mark.parametrize("connector", ["optimized", "reference"])
@pytest.mark.parametrize("faults", [0.0, 0.05, 0.3])
def test_prompt_tokens_balance_with_every_term_non_zero(connector: str, faults: float) -> None:
    report = simulate(dataclasses.replace(SIZE, faults=faults, connector=connector))
    computed, loaded, hit = _identity_terms(report)
    assert report["prompt_tokens"] == computed + loaded + hit
    assert report["identity_holds"] is True
    assert "(holds)" in identity_line(report)
    assert min(computed, loaded, hit) > 0
    assert report["prompt_tokens_unserved"] == report["unaccounted_reads"] == 0
    assert report["verdict"] == "pass"
    again = report["served_again"]["failure"]
    if faults == 0:
        assert report["failures_injected"] == 0
        assert again == {"computed": 0, "loaded": 0, "hit": 0}
        return
    # Tokens a failure took back, then recomputed and reloaded: both rows non-zero.
    assert again["computed"] > 0
    assert again["loaded"] > 0
    assert report["failed_loads"] > 0
    assert report["failures_injected"] == report["failed_loads"] + report["failed_stores"]
    assert report["recovered_loads"] == report["failed_loads"]
    assert report["recovered_stores"] == report["failed_stores"]
    assert report["failures_recovered"] == report["failures_injected"]
    if faults == 0.3:
        assert report["failed_stores"] > 0


def test_ledger_counts_first_service_and_service_again_apart() -> None:
    ledger = TokenLedger()
    rid = RequestId("r")
    ledger.add(rid, 10)
    ledger.serve(rid, Source.HIT, 0, 4)
    ledger.serve(rid, Source.LOADED, 4, 8)
    ledger.lose(rid, 6, Cause.FAILURE)
    assert ledger.read(rid, 8) == 2  # 6 and 7 are no longer in place
    ledger.serve(rid, Source.COMPUTED, 6, 12)  # 10 and 11 are output tokens: not counted
    assert ledger.first == {Source.HIT: 4, Source.LOADED: 4, Source.COMPUTED: 2}
    assert ledger.again[(Cause.FAILURE, Source.COMPUTED)] == 2
    assert ledger.unaccounted_reads == 2
    assert ledger.first_total() == 10


# ---------------------------------------------------------------- recovery broken on purpose


class _KeepsFailedStores(ReferenceConnector):
    """A connector that completes a failed store as if it had succeeded: the entry stays
    loadable though its bytes were never written."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        stores = {j for j, (job, _) in self._jobs.items() if job.kind is TransferKind.STORE}
        results = tuple(
            JobResult(r.job_id, True) if r.job_id in stores else r for r in output.completed_jobs
        )
        super().update_connector_output(dataclasses.replace(output, completed_jobs=results))


class _TrustsFailedLoads(Scheduler):
    """A scheduler that marks a failed load's tokens computed instead of recovering them."""

    def _recover_load(self, rid: RequestId, report: FailureReport | None) -> RecoveryRecord:
        end = self.loads[rid].claim_end
        return RecoveryRecord(rid, self.config.recovery, end, end, ())


def test_a_failed_store_left_loadable_is_not_counted_recovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import spec.connector

    monkeypatch.setattr(spec.connector, "ReferenceConnector", _KeepsFailedStores)
    report = simulate(dataclasses.replace(SIZE, faults=0.3, connector="reference"))
    assert report["failed_stores"] > 0
    assert report["recovered_stores"] < report["failed_stores"]
    assert report["failures_recovered"] < report["failures_injected"]
    assert report["verdict"] == "fail"


def test_a_failed_load_marked_computed_is_not_counted_recovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sim_engine, "Scheduler", _TrustsFailedLoads)
    report = simulate(dataclasses.replace(SIZE, faults=0.3))
    assert report["failed_loads"] > 0
    assert report["recovered_loads"] < report["failed_loads"]
    assert report["failures_recovered"] < report["failures_injected"]
    # The tokens it skipped were read though nothing served them, and never served after.
    assert report["unaccounted_reads"] > 0
    assert report["identity_holds"] is False
    assert report["verdict"] == "fail"


def test_requests_failed_by_design_leave_the_identity_as_unserved_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``fail`` recovery ends a request whose load failed: its unserved prompt tokens are
    a term of the identity, and its failure is counted as ended with the request."""
    failing = partial(derive_setup, recovery=RecoveryMode.VLLM_FAIL)
    monkeypatch.setattr("hybridkv.simulator.run.derive_setup", failing)
    report = simulate(dataclasses.replace(SIZE, faults=0.3))
    assert report["finished"].get("finished_error", 0) > 0
    unserved = report["prompt_tokens_unserved"]
    assert unserved > 0
    assert report["prompt_tokens"] == sum(_identity_terms(report)) + unserved
    assert report["identity_holds"] is True
    assert report["failures_ended"] > 0
    ended = report["failures_recovered"] + report["failures_ended"]
    assert ended == report["failures_injected"]
    assert report["verdict"] == "pass"


# ---------------------------------------------------------------- the plot and the table


def test_the_plot_draws_the_tables_figures() -> None:
    report = simulate(dataclasses.replace(SIZE, faults=0.3))
    series = plot_series(report)
    table = dict(rows(report))
    assert series.loaded[-1] == report["prefill_tokens_loaded"]
    assert table["  loaded from host (first time)"] == f"{series.loaded[-1]:,}"
    assert table["  hit on GPU (first time)"] == f"{series.gpu_hit[-1]:,}"
    assert table["  computed (first time)"] == f"{series.computed[-1]:,}"
    assert series.bytes_loaded[-1] == report["bytes_loaded"]
    marked = f"{len(series.load_failure_steps)} / {len(series.store_failure_steps)}"
    assert table["failed jobs reported: loads / stores"] == marked
    assert len(series.load_failure_steps) > 0
    assert len(series.store_failure_steps) > 0
    # Loads count when they land: a step that adds loaded tokens moved bytes in that step.
    moved = dict(zip(series.steps, series.bytes_loaded, strict=True))
    for i, step in enumerate(series.steps[1:], start=1):
        if series.loaded[i] > series.loaded[i - 1]:
            assert moved[step] > moved[series.steps[i - 1]]


# ---------------------------------------------------------------- loads that span steps


class _LateLoads(sim_reference.ReferencePlane):
    """A plane that reports each load job two steps after the step its copy-time model has it
    done, as a slower engine would: a one-step deadline abandons every load, whose report then
    comes for parked blocks."""

    DELAY = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late: list[tuple[int, JobResult]] = []
        self._load_ids: set[int] = set()
        self._steps = 0

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        super().bind_connector_metadata(meta)
        self._load_ids.update(job.job_id for job in meta.load_jobs)

    def _collect(self) -> None:
        # After the plane collected the step's results (jobs the copy-time model has done, and
        # those failed at submission), hold its loads back DELAY more steps.
        super()._collect()
        self._steps += 1
        now = self._results
        self._late += [(self._steps + self.DELAY, r) for r in now if r.job_id in self._load_ids]
        due = [r for when, r in self._late if when <= self._steps]
        self._late = [(when, r) for when, r in self._late if when > self._steps]
        self._results = [r for r in now if r.job_id not in self._load_ids] + due


@pytest.mark.parametrize("deadline", [1, 64], ids=["abandoned", "landing-late"])
def test_loads_reported_steps_later_keep_the_accounting_exact(
    monkeypatch: pytest.MonkeyPatch, deadline: int
) -> None:
    monkeypatch.setattr(sim_reference, "ReferencePlane", _LateLoads)
    options = dataclasses.replace(
        SIZE, faults=0.3, connector="reference", load_deadline_steps=deadline
    )
    report = simulate(options)
    assert report["identity_holds"] is True
    assert report["unaccounted_reads"] == 0
    assert report["failed_loads"] > 0
    assert report["failures_recovered"] == report["failures_injected"]
    assert report["verdict"] == "pass"
    if deadline == 1:
        # Every load outlived its deadline: its tokens were recomputed, none counted loaded.
        assert report["prefill_tokens_loaded"] == 0
        assert report["tokens_discarded_by_recovery"] > 0
    else:
        assert report["prefill_tokens_loaded"] > 0
