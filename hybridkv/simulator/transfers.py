"""What transfer timing made happen in a ``hybridkv simulate`` run, counted from observed events.

:class:`TransferEvents` watches the jobs each step's connector metadata starts and the
completions each ``KVConnectorOutput`` reports, so it knows, at every point of a step, which
loads and stores are in flight and for which request. From that and the scheduler's own output
(preempted and abandoned requests) and the client's aborts it counts:

- ``load_jobs_spanning_steps``: load jobs reported in a later step than the one that started
  them (``longest_load_steps``: the most steps one took, its start step included);
- ``deadlines_fired``: loads the scheduler abandoned at ``--load-deadline-steps``;
  ``abandoned_loads_reported``: those whose copy was in flight when abandoned and reported later
  (the scheduler holds their blocks until then);
- ``preemptions_during_loads``: preemptions made while some load was in flight (the preempted
  request's freed blocks must not be blocks a load is writing); ``preemptions_of_loading_requests``:
  of those, the ones whose request had its own (abandoned) load in flight;
- ``aborts`` and ``aborts_during_load``: client cancels, and those of a request whose load was
  in flight (its blocks stay held until the load reports);
- ``store_blocks_verified`` and ``wrong_content_stores``: the source blocks of every successful
  store, checked when it is reported against what recomputation writes for its key. The timed
  engine copies a store's bytes at its modelled completion, so a source rewritten before then
  (``TR-2``) is what the host got, and shows here.

It also gives the in-flight jobs in the TR-* snapshot form, so ``--check`` can judge ``TR-1``
(:func:`tr1_messages`) on the real schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from spec.connector_api import ConnectorMeta, KVConnectorOutput, RequestId, TransferJob
from spec.scheduler import Scheduler

__all__ = ["TransferCounts", "TransferEvents", "tr1_messages"]


@dataclass
class TransferCounts:
    """The counts of the module docstring (the report's ``transfers`` section)."""

    load_jobs_spanning_steps: int = 0
    longest_load_steps: int = 0
    store_jobs_spanning_steps: int = 0
    deadlines_fired: int = 0
    abandoned_loads_reported: int = 0
    preemptions_during_loads: int = 0
    preemptions_of_loading_requests: int = 0
    aborts: int = 0
    aborts_during_load: int = 0
    store_blocks_verified: int = 0
    wrong_content_stores: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts by name."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Started:
    job: TransferJob
    step: int


class TransferEvents:
    """Tracks in-flight jobs and counts the events of the module docstring."""

    def __init__(self) -> None:
        self.counts = TransferCounts()
        self._jobs: dict[int, _Started] = {}
        self._abandoned: set[RequestId] = set()  # abandoned with their load still in flight

    # ----------------------------------------------------------------- queries
    def in_flight(self) -> bool:
        """Whether any started job has not been reported."""
        return bool(self._jobs)

    def loading(self, request_id: RequestId) -> bool:
        """Whether a load job of ``request_id`` is in flight."""
        return any(
            s.job.request_id == request_id and s.job.kind.value == "load"
            for s in self._jobs.values()
        )

    def any_load(self) -> bool:
        """Whether any load job is in flight."""
        return any(s.job.kind.value == "load" for s in self._jobs.values())

    def snapshot_jobs(self) -> tuple[tuple[Any, ...], ...]:
        """The in-flight jobs as the TR-* snapshot's ``in_flight`` rows (sources unknown)."""
        return tuple(
            (
                job_id,
                s.job.kind.value,
                s.job.request_id,
                tuple((i.group_idx, i.block_id, i.end_token, None) for i in s.job.items),
            )
            for job_id, s in sorted(self._jobs.items())
        )

    # ----------------------------------------------------------------- events
    def scheduled(
        self,
        step: int,
        preempted: Iterable[RequestId],
        abandoned: Iterable[RequestId],
        meta: ConnectorMeta,
    ) -> None:
        """A ``schedule()`` made these preemptions and abandonments, then started ``meta``'s
        jobs (in flight from now on). The first two are judged against the jobs in flight
        before this step's."""
        c = self.counts
        for rid in preempted:
            if self.any_load():
                c.preemptions_during_loads += 1
                c.preemptions_of_loading_requests += self.loading(rid)
        for rid in abandoned:
            c.deadlines_fired += 1
            if self.loading(rid):
                self._abandoned.add(rid)
        for job in (*meta.load_jobs, *meta.store_jobs):
            self._jobs[job.job_id] = _Started(job, step)

    def reported(
        self,
        step: int,
        kv_output: KVConnectorOutput,
        wrong_sources: Callable[[TransferJob], int] | None = None,
    ) -> None:
        """The step's output reported these jobs complete (or failed). ``wrong_sources`` counts
        the blocks of a successful store that do not hold their key's true content."""
        c = self.counts
        for result in kv_output.completed_jobs:
            started = self._jobs.pop(result.job_id, None)
            if started is None:
                continue
            steps = step - started.step + 1
            if started.job.kind.value == "store":
                c.store_jobs_spanning_steps += steps > 1
                if result.success and wrong_sources is not None:
                    c.store_blocks_verified += len(started.job.items)
                    c.wrong_content_stores += wrong_sources(started.job)
                continue
            c.load_jobs_spanning_steps += steps > 1
            c.longest_load_steps = max(c.longest_load_steps, steps)
            rid = started.job.request_id
            if rid in self._abandoned and not self.loading(rid):
                self._abandoned.discard(rid)
                c.abandoned_loads_reported += 1

    def aborted(self, request_id: RequestId) -> None:
        """The client cancelled ``request_id`` (an unfinished request)."""
        self.counts.aborts += 1
        self.counts.aborts_during_load += self.loading(request_id)


def tr1_messages(scheduler: Scheduler, events: TransferEvents) -> list[str]:
    """``TR-1`` (spec.invariants.system) on the scheduler's pool and tables and the jobs in
    flight: no block a job moves is free, in another group, or (a load's) another request's."""
    from spec.invariants.system import tr1_in_flight_blocks_held
    from spec.system.parts import ref_counts, tables

    snap: Mapping[str, Any] = {
        "ref_counts": ref_counts(scheduler),
        "tables": tables(scheduler),
        "in_flight": events.snapshot_jobs(),
    }
    return tr1_in_flight_blocks_held(snap)
