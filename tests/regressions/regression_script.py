"""A regression scenario as a script of engine events, every invariant checked after each one.

Not a test module (no ``test_`` prefix); the regression tests import it by name.

A :class:`Script` drives one :class:`spec.system.engine.Engine` (scheduler, reference connector,
worker, host store and content model) through the events a scenario names, in order:

- ``arrive(rid)``: the scheduler receives request ``rid`` (vLLM ``add_request``);
- ``step()``: one ``schedule()`` + forward + ``update_from_output``;
- ``complete(rid, kind, ok)``: a transfer job of ``rid`` reports success or failure (vLLM's
  worker ``get_finished`` / ``failed_recving``);
- ``abort(rid)``: the client cancels (vLLM ``finish_requests(..., FINISHED_ABORTED)``);
- ``seed(rid, n)``: the host tier holds the first ``n`` tokens of ``rid``'s prompt, as an
  earlier request with that prompt would have left them (the CPU tier primed);
- ``reset_prefix_cache()``: vLLM's ``reset_prefix_cache`` on the GPU pool (the host kept).

After every event the script checks every registered invariant the engine and its parts are
subject to (exactly the explorer's check, :meth:`spec.system.model.EngineModel.violations`) and
records what broke, so a test asserts both "the correct model breaks nothing" and "the broken
variant breaks exactly this id, at this event".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spec.connector_api import JobId, RequestId, TransferKind
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler.config import RecoveryMode, SchedulerConfig
from spec.scheduler.output import ClaimRecord, SchedulerOutput
from spec.system import parts
from spec.system.engine import Engine, EngineConfig, Read, RequestSpec
from spec.system.model import EngineModel

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
LOAD, STORE = TransferKind.LOAD, TransferKind.STORE


def full(block: int = 2) -> GroupSpec:
    return GroupSpec(FULL, block)


def sliding(block: int = 2, window: int = 4) -> GroupSpec:
    return GroupSpec(SLIDING, block, sliding_window=window)


def mamba(block: int = 2, speculative: int = 0) -> GroupSpec:
    return GroupSpec(MAMBA, block, num_speculative_blocks=speculative)


def request(
    rid: str,
    prompt: Iterable[int],
    max_tokens: int = 2,
    *,
    salt: str | None = None,
    stop: Iterable[int] = (),
) -> RequestSpec:
    return RequestSpec(RequestId(rid), tuple(prompt), max_tokens, salt, frozenset(stop))


def config(
    groups: tuple[GroupSpec, ...],
    requests: Iterable[RequestSpec],
    *,
    recovery: RecoveryMode = RecoveryMode.VLLM_RECOMPUTE,
    num_blocks: int = 48,
    budget: int = 16,
    max_running: int = 4,
    hash_block_size: int = 2,
    chunk_size: int = 2,
    store_capacity: int = 64,
    max_model_len: int = 64,
    **scheduler: Any,
) -> EngineConfig:
    """An engine configuration; ``scheduler`` passes further :class:`SchedulerConfig` fields."""
    return EngineConfig(
        SchedulerConfig(
            groups=groups,
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_running=max_running,
            hash_block_size=hash_block_size,
            recovery=recovery,
            **scheduler,
        ),
        tuple(requests),
        chunk_size=chunk_size,
        store_capacity=store_capacity,
        max_model_len=max_model_len,
    )


def expected_token(rid: str, position: int) -> int:
    """The token a request samples once ``position`` tokens are computed (the engine's fixed
    sampler, :func:`spec.system.engine.sampled_token`: ``100 + (position + len(rid)) % 2``)."""
    return 100 + (position + len(rid)) % 2


@dataclass(frozen=True, slots=True)
class Broken:
    """One invariant broken after one event: the event's 1-based index and label, the id and
    the messages."""

    index: int
    event: str
    invariant_id: str
    messages: tuple[str, ...]


class Script:
    """The engine driven event by event; see the module docstring."""

    def __init__(
        self,
        cfg: EngineConfig,
        *,
        connector_cls: type[Any] | None = None,
        scheduler_cls: type[Any] | None = None,
        engine_cls: type[Engine] = Engine,
    ) -> None:
        self.engine = engine_cls.create(
            cfg, connector_cls=connector_cls, scheduler_cls=scheduler_cls
        )
        self._model = EngineModel(())
        self.events: list[str] = []
        self.found: list[Broken] = []
        self.outputs: list[SchedulerOutput] = []
        self.step_reads: list[tuple[Read, ...]] = []

    # ----------------------------------------------------------------- events
    def arrive(self, *rids: str) -> None:
        for rid in rids:
            self.engine.arrive(RequestId(rid))
            self._checked(f"arrive {rid}")

    def seed(self, rid: str, num_tokens: int, groups: tuple[int, ...] = ()) -> None:
        self.engine.seed_host(RequestId(rid), num_tokens, groups)
        self._checked(f"seed {num_tokens} tokens of {rid}'s prompt, groups {groups or 'all'}")

    def reset_prefix_cache(self) -> bool:
        done = self.engine.reset_prefix_cache()
        self._checked("reset_prefix_cache")
        return done

    def step(self, times: int = 1) -> SchedulerOutput:
        for _ in range(times):
            self.engine.step()
            self.outputs.append(self.engine.last_output)
            self.step_reads.append(self.engine.reads)
            self._checked(f"step {len(self.outputs)}")
        return self.outputs[-1]

    def jobs(self, rid: str, kind: TransferKind = LOAD) -> list[JobId]:
        """The in-flight jobs of ``rid`` of ``kind``, oldest first."""
        return sorted(
            j
            for j, f in self.engine.in_flight.items()
            if f.job.request_id == rid and f.job.kind is kind
        )

    def complete(
        self, rid: str, kind: TransferKind = LOAD, *, ok: bool = True, index: int | None = None
    ) -> list[JobId]:
        """Report ``rid``'s in-flight jobs of ``kind`` (all, or the ``index``-th oldest)."""
        jobs = self.jobs(rid, kind)
        chosen = jobs if index is None else [jobs[index]]
        for job_id in chosen:
            self.engine.complete(job_id, ok)
            outcome = "completes" if ok else "fails"
            self._checked(f"{kind.value} job {job_id} of {rid} {outcome}")
        return chosen

    def complete_all(self, *, ok: bool = True) -> None:
        """Report every job in flight, oldest first."""
        for job_id in sorted(self.engine.in_flight):
            job = self.engine.in_flight[job_id].job
            self.engine.complete(job_id, ok)
            outcome = "completes" if ok else "fails"
            self._checked(f"{job.kind.value} job {job_id} of {job.request_id} {outcome}")

    def abort(self, rid: str) -> None:
        self.engine.abort(RequestId(rid))
        self._checked(f"abort {rid}")

    def run(self, max_steps: int = 30) -> int:
        """Every job completes, then a step, until every arrived request finished and nothing is
        in flight; returns the steps taken. Pre: it ends within ``max_steps``."""
        for taken in range(max_steps + 1):
            if self.done():
                return taken
            self.complete_all()
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.statuses()}")

    def _checked(self, label: str) -> None:
        self.events.append(label)
        for inv_id, messages in sorted(self._model.violations(self.engine).items()):
            self.found.append(Broken(len(self.events), label, inv_id, tuple(messages)))

    # ----------------------------------------------------------------- observations
    def broken(self) -> set[str]:
        """Every invariant id broken after some event."""
        return {b.invariant_id for b in self.found}

    def first(self, inv_id: str) -> Broken:
        """The first event after which ``inv_id`` broke."""
        return next(b for b in self.found if b.invariant_id == inv_id)

    def done(self) -> bool:
        """Every arrived request finished, no job in flight or unreported, no block held."""
        engine = self.engine
        quiet = not engine.in_flight and not engine.pending
        return quiet and not parts.has_work(engine.scheduler)

    def statuses(self) -> Mapping[RequestId, str]:
        return self.engine.statuses()

    def status(self, rid: str) -> str:
        return self.statuses()[RequestId(rid)]

    def tokens(self, rid: str) -> tuple[int, ...]:
        """The tokens ``rid`` sampled."""
        return self.engine.scheduler.requests[RequestId(rid)].output_token_ids

    def counter(self, name: str) -> int:
        return int(self.engine.scheduler.counters[name])

    def claims(self, rid: str) -> list[ClaimRecord]:
        """Every connector answer for ``rid``, in order."""
        return [c for out in self.outputs for c in out.claims if c.request_id == rid]

    def scheduled(self, rid: str) -> list[tuple[int, int]]:
        """``(computed before, tokens)`` of every step that ran ``rid``."""
        return [
            (s.num_computed_tokens, s.num_scheduled_tokens)
            for out in self.outputs
            for s in out.scheduled
            if s.request.request_id == rid
        ]

    def computed_tokens(self, rid: str) -> int:
        """Tokens ``rid`` computed on the GPU over the whole run (prefill and decode)."""
        return sum(n for _, n in self.scheduled(rid))

    def reads(self, rid: str, step: int) -> list[Read]:
        """What ``rid``'s forward read in step ``step`` (1-based)."""
        return [r for r in self.step_reads[step - 1] if r.request_id == rid]


__all__ = [
    "FULL",
    "LOAD",
    "MAMBA",
    "SLIDING",
    "STORE",
    "Broken",
    "Script",
    "config",
    "expected_token",
    "full",
    "mamba",
    "request",
    "sliding",
]
