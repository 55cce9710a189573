"""What the lock-step run compares after every ``schedule()`` and every ``update_from_output()``.

Every observation is a frozen value built from each side's public state, in one vocabulary:
request statuses use the spec's names (vLLM's ``FINISHED_LENGTH_CAPPED`` is ``finished_length``),
block tables are per-group tuples of block ids (0 is the null block), hook calls are
:class:`HookCall` values. :func:`differences` lists every field that differs, most telling first:
block-table patterns (which positions are null, which are real, how many real) before exact ids.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

__all__ = [
    "ClaimObs",
    "Hook",
    "HookCall",
    "Phase",
    "RecoveryObs",
    "RequestObs",
    "StepObservation",
    "differences",
    "pattern",
]

BlockTables = tuple[tuple[int, ...], ...]


class Phase(Enum):
    """Which call an observation follows."""

    SCHEDULE = "schedule"
    UPDATE = "update"


class Hook(Enum):
    """The connector hooks both schedulers call (vLLM's names)."""

    GET_NUM_NEW_MATCHED_TOKENS = "get_num_new_matched_tokens"
    UPDATE_STATE_AFTER_ALLOC = "update_state_after_alloc"
    BUILD_CONNECTOR_META = "build_connector_meta"
    UPDATE_CONNECTOR_OUTPUT = "update_connector_output"
    REQUEST_FINISHED_ALL_GROUPS = "request_finished_all_groups"


@dataclass(frozen=True, slots=True)
class HookCall:
    """One connector call with its arguments and the connector's answer, normalized.

    - get_num_new_matched_tokens: ``args = (num_computed_tokens,)``,
      ``answer = (mode, tokens)``.
    - update_state_after_alloc: ``args = (num_external_tokens,)``, ``tables`` = the blocks.
    - build_connector_meta: ``args = (scheduled (id, n) pairs in order, finished ids,
      preempted ids)``.
    - update_connector_output: ``args = (finished_recving, failed_recving, finished_sending)``.
    - request_finished_all_groups: ``tables`` = the blocks, ``answer = (delay_free,)``.
    """

    hook: Hook
    request_id: str | None
    args: tuple[object, ...] = ()
    tables: BlockTables | None = None
    answer: tuple[object, ...] = ()

    def shape(self) -> HookCall:
        """The call with block tables reduced to their patterns."""
        if self.tables is None:
            return self
        return HookCall(self.hook, self.request_id, self.args, pattern(self.tables), self.answer)


@dataclass(frozen=True, slots=True)
class RequestObs:
    """One request as its scheduler sees it now."""

    request_id: str
    status: str
    num_computed_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class ClaimObs:
    """An admission after a connector answer: the local hit asked with, the tokens claimed and
    the external tokens the scheduler took (``update_state_after_alloc``'s count)."""

    request_id: str
    num_computed_tokens: int
    claimed: int
    accepted: int


@dataclass(frozen=True, slots=True)
class RecoveryObs:
    """A failed load's recovery: the computed count before it and what became of the request
    (``recompute`` from ``resume_at`` tokens, or ``error``); ``recomputed`` tokens are lost."""

    request_id: str
    computed_before: int
    outcome: str
    resume_at: int

    @property
    def recomputed(self) -> int:
        """Tokens that have to be computed again because of the failure."""
        return self.computed_before - self.resume_at


@dataclass(frozen=True, slots=True)
class StepObservation:
    """Everything compared after one call (``phase``) of one step."""

    step: int
    phase: Phase
    scheduled: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]
    finished_ids: tuple[str, ...]
    requests: tuple[RequestObs, ...]
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_holding: tuple[str, ...]
    tables: tuple[tuple[str, BlockTables], ...]
    num_free_blocks: int
    hooks: tuple[HookCall, ...]
    claims: tuple[ClaimObs, ...]
    recoveries: tuple[RecoveryObs, ...]

    @property
    def table_patterns(self) -> tuple[tuple[str, BlockTables], ...]:
        """The block tables as patterns (see :func:`pattern`)."""
        return tuple((rid, pattern(t)) for rid, t in self.tables)

    @property
    def hook_shapes(self) -> tuple[HookCall, ...]:
        """The hook calls with their tables as patterns."""
        return tuple(h.shape() for h in self.ordered_hooks)

    @property
    def ordered_hooks(self) -> tuple[HookCall, ...]:
        """The hook calls, with one order vLLM leaves to a set made canonical.

        vLLM finishes the requests whose loads failed under the ``fail`` policy through
        ``finish_requests(error_req_ids, FINISHED_ERROR)`` (``scheduler.py:2557-2566``), which
        iterates ``set(request_ids)`` (2986): its ``request_finished_all_groups`` calls come in
        string-hash order, which ``PYTHONHASHSEED`` decides. The spec finishes them in id order.
        A run of consecutive such calls for requests that ended ``finished_error`` is sorted by
        id; every other call keeps its place. Their blocks are freed later, in the order of
        ``finished_recving`` (which the harness fixes), so block ids stay comparable.
        """
        errored = {r.request_id for r in self.requests if r.status == "finished_error"}
        calls = list(self.hooks)
        start = 0
        while start < len(calls):
            end = start
            while (
                end < len(calls)
                and calls[end].hook is Hook.REQUEST_FINISHED_ALL_GROUPS
                and calls[end].request_id in errored
            ):
                end += 1
            if end - start > 1:
                calls[start:end] = sorted(calls[start:end], key=lambda c: str(c.request_id))
            start = max(end, start + 1)
        return tuple(calls)


def pattern(tables: BlockTables) -> BlockTables:
    """A table's shape: 0 where the null block is, 1 where a real block is (same length), so
    equal patterns mean the same null positions, real positions and count of real blocks."""
    return tuple(tuple(int(b != 0) for b in t) for t in tables)


# Order in which differing fields are reported: the shape of the run first, exact ids last.
_DERIVED = ("table_patterns", "hook_shapes", "ordered_hooks")
_ORDER = (
    "scheduled",
    "preempted",
    "finished_ids",
    "requests",
    "running",
    "waiting",
    "kv_holding",
    "claims",
    "recoveries",
    "num_free_blocks",
    "table_patterns",
    "hook_shapes",
    "tables",
    "ordered_hooks",
)


def differences(spec: StepObservation, vllm: StepObservation) -> list[str]:
    """Every field on which the two observations differ, as ``field: spec=... vllm=...``."""
    names = {f.name for f in fields(StepObservation)} | set(_DERIVED)
    # ``hooks`` is compared as ``ordered_hooks`` (the same calls, one set-decided order fixed).
    missing = names - set(_ORDER) - {"step", "phase", "hooks"}
    if missing:  # a new field must be compared, never silently skipped
        raise AssertionError(f"observation fields not compared: {sorted(missing)}")
    found = []
    for name in ("step", "phase", *_ORDER):
        a, b = getattr(spec, name), getattr(vllm, name)
        if a != b:
            found.append(f"{name}:\n    spec = {a}\n    vllm = {b}")
    return found
