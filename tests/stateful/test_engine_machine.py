"""A hypothesis state machine over the whole engine: every invariant after every event.

The system under test is :class:`spec.system.engine.Engine`: the scheduler (with its KV cache
coordinator over one block pool), the reference connector, its worker, the host store and the
content model. Each machine draws a configuration in ``@initialize``:

- a layout: full attention + mamba, full + sliding window, or all three (block 2, hash block
  2, offload chunk 2);
- a recovery model: vLLM 0.33's ``recompute`` or ``fail``, or shared truncation;
- a small pool (the largest request fits alone, the others press on it), a small host store
  (evictions), a token budget, and a load deadline or none;
- five requests over a pool of prompts that share prefixes (4, 6, 8 tokens), some salted, with
  1 to 3 output tokens; some prompts' prefixes already in the host tier.

Rules then interleave arrivals, steps, job completions and failures in any order, aborts and
GPU prefix-cache resets. After every rule the ``@invariant`` checks every registered invariant
the engine's parts are subject to (the system family on ``engine.snapshot()`` and each part's
family: exactly :meth:`spec.system.model.EngineModel.violations`). A teardown drains the
engine (every job completes, then steps) and checks the invariants on the way.

Liveness is checked by :class:`LivenessMachine`: a liveness bound of 100 steps (SC-3 in every
state) and, after the drain, every arrived request finished. It runs under the spec's own rules
(our contract, all three recovery models, deadlines included): that is where liveness is
claimed. Under vLLM 0.33's rules (``vllm_exact``) it cannot be: the model replays vLLM's F2
wedge there (docs/explanation/vllm-differential.md: after a failed async load the restarted
request stays among the in-flight prefills, its re-claim is gated by its own reservation and
refused forever while the pool is empty, and FCFS keeps the others behind it), which a random
search finds.

Runs: ``max(200, the profile's max_examples)`` machines of 50 steps each; the ``ci`` profile's
derandomization is kept (the settings inherit the loaded profile).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spec.block_pool import BlockId
from spec.connector import ReferenceConnector
from spec.connector_api import RequestId
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec, cdiv
from spec.scheduler.config import RecoveryMode, SchedulerConfig
from spec.system import parts
from spec.system.engine import Engine, EngineConfig, RequestSpec
from spec.system.model import EngineModel

FULL = GroupSpec(GroupKind.FULL, 2)
SLIDING = GroupSpec(GroupKind.SLIDING, 2, sliding_window=4)
MAMBA = GroupSpec(GroupKind.MAMBA, 2)
LAYOUTS = {
    "full+mamba": (FULL, MAMBA),
    "full+sliding": (FULL, SLIDING),
    "full+sliding+mamba": (FULL, SLIDING, MAMBA),
}

BASE = (1, 2, 3, 4, 5, 6, 7, 8)
PROMPTS = (
    (*BASE, 9),  # 9 tokens
    (*BASE, 9, 10, 11),  # extends the first
    (*BASE[:4], 20, 21, 22),  # shares 4
    (*BASE[:6], 30),  # shares 6
    (40, 41, 42, 43, 44),  # unrelated
)
NUM_REQUESTS = 5
MAX_TOKENS = 3


def _blocks_alone(groups: tuple[GroupSpec, ...]) -> int:
    """Blocks the longest request needs alone: its whole sequence in every attention group,
    two mamba states, and one pinned store source per group."""
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    need = 0
    for g in groups:
        need += 2 if g.kind is GroupKind.MAMBA else cdiv(longest, g.block_size)
    return need + len(groups)


requests_strategy = st.lists(
    st.tuples(
        st.integers(0, len(PROMPTS) - 1),
        st.sampled_from([None, "tenant-b"]),
        st.integers(1, MAX_TOKENS),
    ),
    min_size=NUM_REQUESTS,
    max_size=NUM_REQUESTS,
)


class EngineMachine(RuleBasedStateMachine):
    """The engine under random events; see the module docstring."""

    vllm_exact = False
    liveness_bound: int | None = None
    modes: tuple[RecoveryMode, ...] = tuple(RecoveryMode)

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.model = EngineModel(())

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        mode_index=st.integers(0, len(RecoveryMode) - 1),
        extra_blocks=st.integers(0, 4),
        budget=st.sampled_from([2, 4, 8, 16]),
        deadline=st.sampled_from([None, 1, 2, 4]),
        capacity=st.integers(4, 32),
        requests=requests_strategy,
        seeds=st.lists(
            st.tuples(st.integers(0, NUM_REQUESTS - 1), st.integers(2, 8)), min_size=1, max_size=3
        ),
    )
    def build(  # noqa: PLR0917 - one argument per drawn field
        self,
        layout: str,
        mode_index: int,
        extra_blocks: int,
        budget: int,
        deadline: int | None,
        capacity: int,
        requests: list[tuple[int, str | None, int]],
        seeds: list[tuple[int, int]],
    ) -> None:
        groups = LAYOUTS[layout]
        mode = self.modes[mode_index % len(self.modes)]
        specs = tuple(
            RequestSpec(RequestId(f"r{i}"), PROMPTS[p], n, salt)
            for i, (p, salt, n) in enumerate(requests)
        )
        scheduler = SchedulerConfig(
            groups=groups,
            num_blocks=_blocks_alone(groups) + 1 + extra_blocks,
            max_num_batched_tokens=budget,
            max_num_running=3,
            hash_block_size=2,
            recovery=mode,
            load_deadline_steps=None if self.vllm_exact else deadline,
            vllm_exact=self.vllm_exact,
            liveness_bound_steps=self.liveness_bound,
        )
        config = EngineConfig(
            scheduler, specs, chunk_size=2, store_capacity=capacity, max_model_len=64
        )
        self.engine = Engine.create(config)
        for index, tokens in seeds:
            spec = specs[index]
            num_tokens = min(tokens, len(spec.prompt) - 1)
            units = len(parts.connector_of(self.engine.scheduler).geometry.kinds) * num_tokens
            if num_tokens > 0 and units <= capacity - len(self.engine.host):
                self.engine.seed_host(spec.request_id, num_tokens)
        event(f"layout {layout}, recovery {mode.value}")

    # ----------------------------------------------------------------- helpers
    @property
    def _engine(self) -> Engine:
        assert self.engine is not None
        return self.engine

    def _unarrived(self) -> list[RequestId]:
        e = self._engine
        return [r.request_id for r in e.config.requests if r.request_id not in e.arrived]

    def _unfinished(self) -> list[RequestId]:
        return [rid for rid, s in self._engine.statuses().items() if not s.startswith("FINISHED")]

    # ----------------------------------------------------------------- rules
    @precondition(lambda self: bool(self._unarrived()))
    @rule(index=st.integers(0, NUM_REQUESTS - 1))
    def arrive(self, index: int) -> None:
        waiting = self._unarrived()
        self._engine.arrive(waiting[index % len(waiting)])

    @rule()
    def step(self) -> None:
        self._engine.step()
        output = self._engine.last_output
        if output.preempted_ids:
            event("preemption")
        if output.abandoned_ids:
            event("load abandoned at its deadline")
        if self._engine.last_kv_output.failed_recving:
            event("failed load recovered")

    @precondition(lambda self: bool(self._engine.in_flight))
    @rule(index=st.integers(0, 15), ok=st.booleans())
    def complete(self, index: int, ok: bool) -> None:
        jobs = sorted(self._engine.in_flight)
        job_id = jobs[index % len(jobs)]
        kind = self._engine.in_flight[job_id].job.kind.value
        event(f"{kind} {'ok' if ok else 'fails'}")
        self._engine.complete(job_id, ok)

    @precondition(lambda self: bool(self._unfinished()))
    @rule(index=st.integers(0, NUM_REQUESTS - 1))
    def abort(self, index: int) -> None:
        live = self._unfinished()
        rid = live[index % len(live)]
        if self._engine.jobs_of(rid):
            event("abort during a transfer")
        self._engine.abort(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        self._engine.reset_prefix_cache()

    # ----------------------------------------------------------------- checks
    @invariant()
    def every_invariant_holds(self) -> None:
        if self.engine is None:
            return
        broken = dict(self.model.violations(self.engine))
        assert broken == {}, broken

    def teardown(self) -> None:
        """Drain: every job completes, then a step, until nothing is left (invariants held)."""
        if self.engine is None:
            return
        for _ in range(60):
            if self._quiet():
                break
            for job_id in sorted(self._engine.in_flight):
                self._engine.complete(job_id, True)
            self._engine.step()
            self.every_invariant_holds()
        self._after_drain()

    def _quiet(self) -> bool:
        e = self._engine
        return not e.in_flight and not e.pending and not parts.has_work(e.scheduler)

    def _after_drain(self) -> None:
        """Liveness is the subclass's business (the module docstring says why)."""


class LivenessMachine(EngineMachine):
    """The same machine, and after the drain every arrived request has finished (SC-3 with a
    bound: a request unfinished past it is a violation at every step of the drain)."""

    liveness_bound = 100

    def _after_drain(self) -> None:
        unfinished = self._unfinished()
        assert unfinished == [], f"not finished after the drain: {self._engine.statuses()}"


def _settings(**kw: Any) -> settings:
    """The loaded profile (derandomized under ``ci``), at least 200 machines of 50 steps."""
    chosen: dict[str, Any] = {"max_examples": max(200, settings().max_examples)}
    chosen.update(kw)
    return settings(settings(), stateful_step_count=50, **chosen)


EngineMachine.TestCase.settings = _settings()
LivenessMachine.TestCase.settings = _settings()

test_engine_machine = EngineMachine.TestCase
test_liveness_under_the_spec_rules = LivenessMachine.TestCase


class _UnpinnedStoreSources(ReferenceConnector):
    """A broken connector: an in-flight store's source blocks are not held (TR-1)."""

    def bind_gpu_block_pool(self, pool: object) -> None:
        return None

    def held_blocks(self) -> tuple[BlockId, ...]:
        return ()


@pytest.mark.mutation("TR-1")
def test_the_machine_catches_a_connector_that_does_not_pin_store_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guard: the machine is not vacuous. With the store-source pin removed it finds a state in
    which a block is freed under an in-flight store (generation only, no shrinking)."""
    monkeypatch.setattr(parts, "ReferenceConnector", _UnpinnedStoreSources)

    class Broken(EngineMachine):
        pass

    Broken.TestCase.settings = settings(
        EngineMachine.TestCase.settings,
        phases=[Phase.explicit, Phase.generate],
        print_blob=False,
        report_multiple_bugs=False,
        max_examples=200,
    )
    with pytest.raises(AssertionError, match="TR-1"):
        Broken.TestCase().runTest()
