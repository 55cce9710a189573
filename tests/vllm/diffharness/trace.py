"""A trace: the scripted world both schedulers run in, and the player each side answers from.

A trace names everything outside the scheduler: which requests arrive when (prompts with shared
prefixes and cache salts), what the connector answers each time it is asked
(``get_num_new_matched_tokens``: defer, nothing, a sync or an async claim), when each async
load reports and whether it fails, whether the connector keeps a finished request's blocks for a
store, and which requests are aborted when. The engine settings (pool size, token budget,
running cap, ``kv_load_failure_policy``) travel with it.

Each side instantiates its own :class:`ScriptPlayer` from the same trace. A player answers from
the trace and from the calls its own scheduler makes, so the two sides receive the same answers
exactly when they make the same calls, which is what the lock-step comparison checks.

A narrated scenario is written with the same values (``docs/explanation/vllm-differential.md``
shows one): a few :class:`RequestScript` rows, each with its claims, loads, hold and abort.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from diffharness.layouts import RECIPES, Layout

__all__ = [
    "AbortPhase",
    "ClaimMode",
    "ClaimScript",
    "EngineSettings",
    "FailurePolicy",
    "KVReport",
    "LoadScript",
    "RequestScript",
    "ScriptPlayer",
    "Trace",
    "TraceError",
    "prompt_repr",
    "sample_token",
]


class TraceError(ValueError):
    """A trace (or a call on a player) that cannot be run; the message names field and fix."""

    def __init__(self, field_name: str, value: object, problem: str, fix: str) -> None:
        super().__init__(f"{field_name}={value!r}: {problem}; {fix}")


class _Named(Enum):
    """An enum whose repr is the expression that names it (traces print as code)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class FailurePolicy(_Named):
    """vLLM's ``KVTransferConfig.kv_load_failure_policy`` (``config/kv_transfer.py:81-91``)."""

    RECOMPUTE = "recompute"
    FAIL = "fail"


class ClaimMode(_Named):
    """What the scripted connector answers to one ``get_num_new_matched_tokens`` call.

    - ``DEFER``: ``(None, False)``: ask again next step.
    - ``NONE``: ``(0, False)``.
    - ``SYNC``: ``(n, False)``: loaded before this step's forward.
    - ``ASYNC``: ``(n, True)``: the request waits in WAITING_FOR_REMOTE_KVS.
    """

    DEFER = "defer"
    NONE = "none"
    SYNC = "sync"
    ASYNC = "async"


class AbortPhase(_Named):
    """When an abort reaches the scheduler.

    - ``BEFORE_SCHEDULE``: between steps (the engine core's input queue, before ``schedule()``).
    - ``DURING_STEP``: while the model runs: after ``schedule()``, before
      ``update_from_output()`` (``EngineCore.step`` calls ``_process_aborts_queue`` there,
      ``v1/engine/core.py:688-693``).
    """

    BEFORE_SCHEDULE = "before_schedule"
    DURING_STEP = "during_step"


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(name, value, f"must be an int >= {low}", f"give an int >= {low}")
    return value


@dataclass(frozen=True, slots=True)
class ClaimScript:
    """One scripted answer, in claim units (the scheduler block size) beyond the local hit.

    The tokens actually claimed stay inside vLLM's contract (``scheduler.py:1217-1220``,
    1286-1289, 1331): an async claim ends at most at the last token, a sync claim at most one
    token before it (the forward needs a token to compute), and both end on a claim unit
    because the local hit they extend is unit-aligned. A claim with no room left is answered
    ``NONE``.

    Two knobs step outside that contract, for the divergence tests only (random traces keep
    them off): ``offset_tokens`` adds tokens past the last whole unit (an unaligned claim, D2)
    and ``capped=False`` lets a sync claim reach the last token (vLLM asserts, D2).
    """

    mode: ClaimMode
    num_units: int = 0
    offset_tokens: int = 0
    capped: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.mode, ClaimMode):
            raise TraceError("mode", self.mode, "not a ClaimMode", "pass ClaimMode.SYNC/...")
        loads = self.mode in (ClaimMode.SYNC, ClaimMode.ASYNC)
        _count("num_units", self.num_units, 1 if loads else 0)
        _count("offset_tokens", self.offset_tokens, 0)
        if not loads and (self.num_units or self.offset_tokens or not self.capped):
            raise TraceError("num_units", self.num_units, "only SYNC/ASYNC claim tokens", "use 0")

    def resolve(
        self, num_computed_tokens: int, num_tokens: int, unit: int
    ) -> tuple[ClaimMode, int]:
        """The answer to a call with this local hit: ``(mode, tokens)``, tokens > 0 iff a load."""
        if self.mode not in (ClaimMode.SYNC, ClaimMode.ASYNC):
            return self.mode, 0
        sync_cap = self.mode is ClaimMode.SYNC and self.capped
        room = max((num_tokens - 1 if sync_cap else num_tokens) - num_computed_tokens, 0)
        tokens = min(self.num_units, room // unit) * unit
        tokens = min(tokens + self.offset_tokens, room)
        return (self.mode, tokens) if tokens else (ClaimMode.NONE, 0)


@dataclass(frozen=True, slots=True)
class LoadScript:
    """How one async load ends.

    Attributes:
        delay: steps from the step that started the load (its ``schedule()`` called
            ``update_state_after_alloc`` with external tokens) to the step whose model-runner
            output reports it in ``finished_recving``; 0 is the same step. ``None``: it never
            reports (vLLM waits forever, D3).
        fails: the report also names the request in ``failed_recving`` (a request-level
            failure; vLLM 0.33 emits ``failed_recving`` only with ``finished_recving``).
        block_level: also report the failure as block ids (``invalid_block_ids``: the load's
            real blocks past the local hit and ``valid_units`` claim units); vLLM 0.33 raises
            on that with several groups (D6). Implies ``fails``.
        valid_units: with ``block_level``, how many claim units at the start of the load
            arrived intact.
    """

    delay: int | None = 1
    fails: bool = False
    block_level: bool = False
    valid_units: int = 0

    def __post_init__(self) -> None:
        if self.delay is not None:
            _count("delay", self.delay, 0)
        for name in ("fails", "block_level"):
            if not isinstance(getattr(self, name), bool):
                raise TraceError(name, getattr(self, name), "must be a bool", "pass a bool")
        _count("valid_units", self.valid_units, 0)
        if self.valid_units and not self.block_level:
            raise TraceError("valid_units", self.valid_units, "needs block_level", "set it")


def prompt_repr(prompt: tuple[int, ...]) -> str:
    """A prompt as a tuple expression with consecutive runs as ranges (short, and evaluable)."""
    parts, start = [], 0
    for i in range(1, len(prompt) + 1):
        if i == len(prompt) or prompt[i] != prompt[i - 1] + 1:
            a, b = prompt[start], prompt[i - 1] + 1
            parts.append(f"*range({a}, {b})" if b - a > 2 else ", ".join(map(str, range(a, b))))
            start = i
    return "(" + ", ".join(parts) + ",)"


@dataclass(frozen=True, slots=True, repr=False)
class RequestScript:
    """One request of a trace and everything scripted about it.

    Attributes:
        request_id: the id both schedulers use.
        arrival_step: the step (1-based) before whose ``schedule()`` it is added.
        prompt: the prompt tokens (shared prefixes give prefix-cache hits).
        max_tokens: output tokens after which it finishes by length.
        cache_salt: the isolation domain (enters the first block hash).
        claims: the answer to the k-th ``get_num_new_matched_tokens`` call for it (``NONE`` once
            the script runs out).
        loads: how its k-th async load ends (``LoadScript()`` once the script runs out).
        store_hold: when set, ``request_finished_all_groups`` returns True (the connector keeps
            the blocks for a store) and ``finished_sending`` comes this many steps after the
            step it finished in; the connector never holds while its own load for the request
            is outstanding (vLLM 0.33 frees at the first of the two reports, D5).
        abort_step, abort_phase: when it is aborted (never, if ``abort_step`` is None).
        hold_during_load: the connector holds the blocks for a store even while its own load
            of the request is outstanding (the D5 test; random traces never do).
    """

    request_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    claims: tuple[ClaimScript, ...] = ()
    loads: tuple[LoadScript, ...] = ()
    store_hold: int | None = None
    abort_step: int | None = None
    abort_phase: AbortPhase = AbortPhase.BEFORE_SCHEDULE
    hold_during_load: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TraceError("request_id", self.request_id, "need a non-empty str", "name it")
        _count("arrival_step", self.arrival_step, 1)
        if not isinstance(self.prompt, tuple) or not self.prompt:
            raise TraceError("prompt", self.prompt, "need a non-empty tuple", "pass a tuple")
        for token in self.prompt:
            _count("prompt token", token, 0)
        _count("max_tokens", self.max_tokens, 1)
        if self.store_hold is not None:
            _count("store_hold", self.store_hold, 1)
        if self.abort_step is not None:
            _count("abort_step", self.abort_step, self.arrival_step)
        if not isinstance(self.abort_phase, AbortPhase):
            raise TraceError("abort_phase", self.abort_phase, "not an AbortPhase", "pick one")
        for name, values, kind in (
            ("claims", self.claims, ClaimScript),
            ("loads", self.loads, LoadScript),
        ):
            if not isinstance(values, tuple) or not all(isinstance(v, kind) for v in values):
                raise TraceError(name, values, f"need a tuple of {kind.__name__}", "wrap it")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis prints drawn values with this (the prompt as ranges, not token by token)."""
        del cycle
        printer.text(repr(self))

    def __repr__(self) -> str:
        return (
            f"RequestScript({self.request_id!r}, {self.arrival_step}, "
            f"{prompt_repr(self.prompt)}, {self.max_tokens}, cache_salt={self.cache_salt!r}, "
            f"claims={self.claims!r}, loads={self.loads!r}, store_hold={self.store_hold!r}, "
            f"abort_step={self.abort_step!r}, abort_phase={self.abort_phase!r}, "
            f"hold_during_load={self.hold_during_load})"
        )


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine options a trace runs under (the same on both sides).

    Attributes:
        num_blocks: GPU blocks including the null block (vLLM's ``num_gpu_blocks_override``).
        max_num_batched_tokens: the token budget of one step.
        max_num_seqs: the most running requests.
        failure_policy: ``kv_load_failure_policy``.
        retention_interval: ``prefix_cache_retention_interval``: 0 (vLLM's default, sparse
            sliding-window and mamba cache entries) or ``None`` (dense).
        reserve_full_sequence: ``scheduler_reserve_full_isl`` (vLLM's default True): admit a
            waiting request only if its whole sequence fits the free blocks.
        max_model_len: ``--max-model-len`` for this trace; ``None``: the layout recipe's.
    """

    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    retention_interval: int | None = 0
    reserve_full_sequence: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _count("num_blocks", self.num_blocks, 2)
        _count("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _count("max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.failure_policy, FailurePolicy):
            raise TraceError("failure_policy", self.failure_policy, "not a policy", "pick one")
        if self.retention_interval not in (None, 0) or isinstance(self.retention_interval, bool):
            raise TraceError(
                "retention_interval", self.retention_interval, "not modelled", "pass 0 or None"
            )
        if not isinstance(self.reserve_full_sequence, bool):
            raise TraceError(
                "reserve_full_sequence", self.reserve_full_sequence, "must be a bool", "pass one"
            )
        if self.max_model_len is not None:
            _count("max_model_len", self.max_model_len, 2)


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole scripted run: layout, settings, requests and a step cap."""

    layout: Layout
    settings: EngineSettings
    requests: tuple[RequestScript, ...]
    max_steps: int = 80

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise TraceError("layout", self.layout, "not a Layout", "pick one of Layout")
        if not isinstance(self.settings, EngineSettings):
            raise TraceError("settings", self.settings, "not EngineSettings", "build one")
        _count("max_steps", self.max_steps, 1)
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise TraceError("requests", ids, "duplicate request ids", "give each a new id")
        limit = self.max_model_len
        for r in self.requests:
            if len(r.prompt) + r.max_tokens > limit:
                raise TraceError(
                    "requests",
                    r.request_id,
                    f"prompt + max_tokens exceeds max_model_len {limit}",
                    "shorten it (vLLM stops a request at max_model_len; the spec does not)",
                )

    @property
    def max_model_len(self) -> int:
        """The longest sequence: the settings' ``max_model_len``, else the layout recipe's."""
        own = self.settings.max_model_len
        return RECIPES[self.layout].max_model_len if own is None else own

    @property
    def by_id(self) -> Mapping[str, RequestScript]:
        """The request scripts by id."""
        return {r.request_id: r for r in self.requests}

    def arrivals(self, step: int) -> tuple[RequestScript, ...]:
        """The requests added before ``step``'s ``schedule()``, in trace order."""
        return tuple(r for r in self.requests if r.arrival_step == step)

    def aborts(self, step: int, phase: AbortPhase) -> tuple[str, ...]:
        """The requests aborted at ``step`` in ``phase``, in trace order."""
        return tuple(
            r.request_id for r in self.requests if r.abort_step == step and r.abort_phase is phase
        )

    def narrate(self) -> str:
        """The trace as a few readable lines (shown when a comparison fails)."""
        s = self.settings
        lines = [
            f"layout {self.layout.value}: {s.num_blocks} blocks, budget "
            f"{s.max_num_batched_tokens}, {s.max_num_seqs} running, policy "
            f"{s.failure_policy.value}, retention {s.retention_interval}, full sequence "
            f"{'reserved' if s.reserve_full_sequence else 'not reserved'}, max_model_len "
            f"{self.max_model_len}, at most {self.max_steps} steps"
        ]
        for r in self.requests:
            claims = ", ".join(
                c.mode.value
                + (f" {c.num_units}u" if c.num_units else "")
                + (f"+{c.offset_tokens}" if c.offset_tokens else "")
                + ("" if c.capped else " uncapped")
                for c in r.claims
            )
            loads = ", ".join(
                ("never" if ld.delay is None else f"+{ld.delay}")
                + (" fails" if ld.fails else "")
                + (" blocks" if ld.block_level else "")
                for ld in r.loads
            )
            extra = []
            if r.cache_salt is not None:
                extra.append(f"salt {r.cache_salt!r}")
            if r.store_hold is not None:
                extra.append(
                    f"hold {r.store_hold}" + (" during load" if r.hold_during_load else "")
                )
            if r.abort_step is not None:
                extra.append(f"abort @{r.abort_step} {r.abort_phase.value}")
            lines.append(
                f"  {r.request_id} @{r.arrival_step}: {len(r.prompt)} tokens "
                f"(head {r.prompt[:3]}), max {r.max_tokens}; claims [{claims}]; "
                f"loads [{loads}] {'; '.join(extra)}"
            )
        return "\n".join(lines)


def sample_token(request_id: str, index: int) -> int:
    """The token the fabricated model samples as a request's ``index``-th output."""
    return 50_000 + 97 * index + sum(map(ord, request_id)) % 89


@dataclass(frozen=True, slots=True)
class KVReport:
    """What the fabricated worker reports in one step's ``KVConnectorOutput``."""

    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    finished_sending: frozenset[str] = frozenset()
    invalid_blocks: tuple[tuple[str, frozenset[int]], ...] = ()

    @property
    def empty(self) -> bool:
        """True when nothing is reported."""
        return not (self.finished_recving or self.finished_sending or self.invalid_blocks)

    @property
    def invalid_block_ids(self) -> frozenset[int]:
        """Every invalid block id, as vLLM's flat ``invalid_block_ids`` carries them."""
        return frozenset(b for _, blocks in self.invalid_blocks for b in blocks)


@dataclass
class _Load:
    request_id: str
    started: int
    script: LoadScript
    blocks: frozenset[int] = frozenset()  # its real blocks past the local hit
    reported: bool = False
    seen: bool = False  # the connector saw its finished_recving (update_connector_output)


@dataclass
class ScriptPlayer:
    """One side's view of the trace: the scripted connector's answers and the fake worker.

    The side's connector calls :meth:`answer`, :meth:`allocated`, :meth:`finished` and
    :meth:`saw_output` from its hooks; the side's driver sets :attr:`step` and asks
    :meth:`report` once per step for the worker's ``KVConnectorOutput``.
    """

    trace: Trace
    unit: int
    step: int = 0
    _asks: dict[str, int] = field(default_factory=dict)
    _last_mode: dict[str, ClaimMode] = field(default_factory=dict)
    _last_local: dict[str, int] = field(default_factory=dict)
    _loads: list[_Load] = field(default_factory=list)
    _holds: dict[str, int] = field(default_factory=dict)  # request -> step finished_sending due
    _sent: set[str] = field(default_factory=set)
    _by_id: Mapping[str, RequestScript] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.trace, Trace):
            raise TraceError("trace", self.trace, "not a Trace", "pass a Trace")
        _count("unit", self.unit, 1)
        self._by_id = self.trace.by_id

    def answer(
        self, request_id: str, num_computed_tokens: int, num_tokens: int
    ) -> tuple[ClaimMode, int]:
        """The scripted answer to this request's next ``get_num_new_matched_tokens`` call."""
        script = self._script(request_id)
        index = self._asks.get(request_id, 0)
        self._asks[request_id] = index + 1
        claim = script.claims[index] if index < len(script.claims) else ClaimScript(ClaimMode.NONE)
        mode, tokens = claim.resolve(num_computed_tokens, num_tokens, self.unit)
        self._last_mode[request_id] = mode
        self._last_local[request_id] = num_computed_tokens
        return mode, tokens

    def allocated(
        self,
        request_id: str,
        num_external_tokens: int,
        tables: tuple[tuple[int, ...], ...] = (),
        block_sizes: tuple[int, ...] = (),
    ) -> None:
        """``update_state_after_alloc``: an async claim's external tokens start a load now.

        ``tables`` and ``block_sizes`` (per group) name the blocks the load writes, for a
        block-level failure report.
        """
        if num_external_tokens <= 0 or self._last_mode.get(request_id) is not ClaimMode.ASYNC:
            return  # nothing to load, the second call after a load, or a sync load
        script = self._script(request_id)
        index = sum(1 for ld in self._loads if ld.request_id == request_id)
        load = script.loads[index] if index < len(script.loads) else LoadScript()
        first = self._last_local.get(request_id, 0) + load.valid_units * self.unit
        blocks = frozenset(
            b
            for table, size in zip(tables, block_sizes, strict=True)
            for b in table[first // size :]
            if b != 0
        )
        self._loads.append(_Load(request_id, self.step, load, blocks))
        self._last_mode[request_id] = ClaimMode.NONE  # one load per answer

    def finished(self, request_id: str) -> bool:
        """``request_finished_all_groups``: whether the connector keeps the blocks (a store)."""
        script = self._script(request_id)
        hold = script.store_hold
        outstanding = any(ld.request_id == request_id and not ld.seen for ld in self._loads)
        if hold is None or (outstanding and not script.hold_during_load):
            return False
        self._holds[request_id] = self.step + hold
        return True

    def saw_output(self, finished_recving: frozenset[str]) -> None:
        """``update_connector_output``: the connector learns which loads reported."""
        for load in self._loads:
            if load.reported and load.request_id in finished_recving:
                load.seen = True

    def report(self) -> KVReport:
        """The worker's report for the current step (each load and hold reported once)."""
        recv, failed, invalid = set(), set(), []
        for load in self._loads:
            due = load.script.delay is not None and load.started + load.script.delay <= self.step
            if due and not load.reported:
                load.reported = True
                recv.add(load.request_id)
                if load.script.block_level:
                    invalid.append((load.request_id, load.blocks))
                if load.script.fails or load.script.block_level:
                    failed.add(load.request_id)
        sending = {r for r, due in self._holds.items() if due <= self.step and r not in self._sent}
        self._sent |= sending
        return KVReport(
            frozenset(recv), frozenset(failed), frozenset(sending), tuple(sorted(invalid))
        )

    def pending(self) -> bool:
        """Whether a load or a hold has yet to report (a report is still to come)."""
        loads = any(not ld.reported and ld.script.delay is not None for ld in self._loads)
        return loads or any(r not in self._sent for r in self._holds)

    def _script(self, request_id: str) -> RequestScript:
        script = self._by_id.get(request_id)
        if script is None:
            raise TraceError("request_id", request_id, "not in the trace", "add it to the trace")
        return script
