"""The connector core's boundary values, in vLLM 0.33's words (the engine-facing interface).

Written from the connector contract (docs/explanation/connector-core.md); the reference model
``spec.connector_api`` states the same contract on its own (never imported here), and the
differential tests hold the two to the same names, fields and answers. A scheduler drives a
:class:`SchedulerConnector`, a worker folds job results through a :class:`WorkerConnector`.
The spec scheduler speaks these values through ``hybridkv.simulator.engine_adapter``, and the
vLLM connector (``hybridkv.vllm``) speaks them too, so the core itself never converts
anything. One field is the library's own: ``StepView.no_unit_ids``, a shortcut for requests
whose step stores nothing; naming a request there answers exactly as listing it in
``scheduled`` (tests/connector/test_no_unit_steps.py), and the spec's callers leave it empty.

Values only: every type is immutable. :class:`TransferItem` and :class:`JobResult` are
``NamedTuple`` rather than frozen dataclasses because the core builds one per moved block and
per reported job: a NamedTuple is built in about a third of the time, with the same fields.

vLLM 0.33 references (``vllm/`` relative): ``distributed/kv_transfer/kv_connector/v1/base.py``
``get_num_new_matched_tokens`` 515-548, ``update_state_after_alloc`` 568-592,
``build_connector_meta`` 594-611, ``update_connector_output`` 621-629,
``SupportsHMA.request_finished_all_groups`` 101-129, ``bind_gpu_block_pool`` 490-503.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, NewType, Protocol

from hybridkv.errors import HybridKVConfigError

__all__ = [
    "BlockTable",
    "Claim",
    "ClaimKind",
    "ConnectorMeta",
    "GpuBlockPool",
    "JobId",
    "JobResult",
    "KVConnectorOutput",
    "RequestId",
    "RequestView",
    "ScheduledRequest",
    "SchedulerConnector",
    "StepView",
    "TransferItem",
    "TransferJob",
    "TransferKind",
    "WorkerConnector",
]

# --- shapes and ids -----------------------------------------------------------------------------

BlockTable = tuple[tuple[int, ...], ...]
"""Block ids of one request: one row per KV cache group, indexed by block position; 0 is null."""

RequestId = NewType("RequestId", str)
"""The scheduler's request id, as vLLM's ``request.request_id``."""

JobId = NewType("JobId", int)
"""A connector job id (``TransferJob.job_id``); a transfer engine numbers its own jobs apart."""


# --- what the scheduler shows the connector -------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestView:
    """The read-only slice of a vLLM request the core works from.

    Attributes:
        request_id: the scheduler's id.
        token_ids: the prompt, then every output token so far. It only grows, which is what
            lets the core extend its hashes instead of recomputing them.
        num_prompt_tokens: the length of the prompt prefix of ``token_ids``.
        cache_salt: the sharing domain: two requests share KV only under the same salt.
        block_hashes: vLLM's ``request.block_hashes`` (one chained hash per full
            ``hash_block_size`` block, with multimodal inputs, LoRA and the salt folded in),
            or None for the core to hash ``token_ids`` itself. When given, offload keys derive
            from them, so requests that differ only beside their tokens never share a key.
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    cache_salt: str | None = None
    block_hashes: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class StepView:
    """What ``build_connector_meta`` reads of vLLM's ``SchedulerOutput``.

    ``no_unit_ids`` is the library's shortcut (no spec counterpart): scheduled requests whose
    computed range completes no unit of any group (``ConnectorGeometry.completes_a_unit`` is
    false). They store nothing, so the adapter names them instead of building a view and a
    block table each; on a decode step that is most requests. Listing such a request in
    ``scheduled`` instead gives the same answer.
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_ids: frozenset[RequestId] = frozenset()
    preempted_ids: frozenset[RequestId] = frozenset()
    no_unit_ids: frozenset[RequestId] = frozenset()


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One row of a step: the request, its block table, and the token range this step computes.

    KV exists for the first ``num_computed_tokens`` tokens before the forward and for
    ``num_computed_tokens + num_scheduled_tokens`` after it. ``store_limit``: no unit ending
    past it is stored (``None``: none). It never stands in for the step's end, which places the
    step's mamba states (MB-8): the step that recomputes a preempted request's prompt and
    output leaves its states where its whole range puts them, prompt-only storage or not.
    """

    request: RequestView
    block_ids: BlockTable
    num_computed_tokens: int
    num_scheduled_tokens: int
    store_limit: int | None = None


# --- the claim ------------------------------------------------------------------------------


class ClaimKind(Enum):
    """The four answers ``get_num_new_matched_tokens`` can give.

    In vLLM's ``(num_tokens | None, is_async)`` form: DEFER ``(None, False)`` asks to be asked
    again next step, NONE ``(0, False)`` loads nothing, SYNC ``(n, False)`` loads before this
    step's forward, ASYNC ``(n, True)`` parks the request in WAITING_FOR_REMOTE_KVS.
    """

    DEFER = "defer"
    NONE = "none"
    SYNC = "sync"
    ASYNC = "async"


class _ClaimForm(NamedTuple):
    loads: bool  # the claim names a positive token count
    is_async: bool  # vLLM's second element: the request waits in WAITING_FOR_REMOTE_KVS


# One row per kind: the validation and vLLM's tuple both read this table. DEFER and NONE both
# load nothing; they differ only in DEFER's ``None`` ("ask again next step").
_CLAIM_FORMS: dict[ClaimKind, _ClaimForm] = {
    ClaimKind.DEFER: _ClaimForm(loads=False, is_async=False),
    ClaimKind.NONE: _ClaimForm(loads=False, is_async=False),
    ClaimKind.SYNC: _ClaimForm(loads=True, is_async=False),
    ClaimKind.ASYNC: _ClaimForm(loads=True, is_async=True),
}


@dataclass(frozen=True, slots=True)
class Claim:
    """The core's answer to ``get_num_new_matched_tokens``.

    ``num_tokens`` is positive for SYNC and ASYNC and 0 for DEFER and NONE; any other pairing
    raises :class:`~hybridkv.errors.HybridKVConfigError` on construction.
    """

    kind: ClaimKind
    num_tokens: int = 0

    def __post_init__(self) -> None:
        form = _CLAIM_FORMS.get(self.kind)
        if form is None:
            raise HybridKVConfigError(
                "kind", self.kind, "is not a ClaimKind", "pass hybridkv.connector.ClaimKind"
            )
        tokens = self.num_tokens
        if tokens < 0 or form.loads is not (tokens > 0):
            raise HybridKVConfigError(
                "num_tokens",
                tokens,
                f"a {self.kind.value} claim of {tokens} tokens",
                "SYNC and ASYNC claim a positive number of tokens, DEFER and NONE claim 0",
            )

    def as_vllm(self) -> tuple[int | None, bool]:
        """The ``(num_tokens | None, is_async)`` pair vLLM's scheduler expects (the table's
        ``is_async`` is true for ASYNC only: compared by identity, asked every lookup)."""
        kind = self.kind
        if kind is ClaimKind.DEFER:
            return None, False
        return self.num_tokens, kind is ClaimKind.ASYNC


# --- jobs -----------------------------------------------------------------------------------


class TransferKind(Enum):
    """The direction of a job: LOAD copies host chunks to GPU blocks, STORE the reverse."""

    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One load or store job, shipped to the worker inside a step's :class:`ConnectorMeta`.

    ``sync`` is set only on loads the worker must finish before this step's forward (vLLM's
    ``TransferJob.sync``); their request is already running, so it is never reported in
    ``finished_recving``.
    """

    job_id: JobId
    kind: TransferKind
    request_id: RequestId
    items: tuple[TransferItem, ...]
    sync: bool = False


class TransferItem(NamedTuple):
    """One GPU block a job copies, and the host key it copies to or from.

    Attributes:
        group_idx: ``kv_cache_group_id`` of the block.
        block_id: the GPU block id; never the null block 0.
        key: the host offload key: the block hash followed by the group index as 4 big-endian
            bytes.
        end_token: the prefix length the block's content stands for; for a mamba group the
            exact token position of the saved recurrent state.
    """

    group_idx: int
    block_id: int
    key: bytes
    end_token: int


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """The worker's instructions for one step, as ``build_connector_meta`` returns them.

    ``delayed_free_ids`` lists requests finished since the previous step whose block free the
    core held back; the worker names each in ``finished_sending`` once every store job of it
    has reported.
    """

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    delayed_free_ids: frozenset[RequestId] = frozenset()


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVConnectorOutput:
    """The part of vLLM's ``KVConnectorOutput`` the scheduler side reads after a step.

    Every failed receive is also a finished one (checked on construction, as vLLM 0.33 reports
    them); ``finished_sending`` releases delayed block frees; ``completed_jobs`` holds each
    folded job result in report order (vLLM's ``kv_connector_worker_meta.completed_jobs``).
    """

    finished_recving: frozenset[RequestId] = frozenset()
    failed_recving: frozenset[RequestId] = frozenset()
    finished_sending: frozenset[RequestId] = frozenset()
    completed_jobs: tuple[JobResult, ...] = ()

    def __post_init__(self) -> None:
        stray = self.failed_recving - self.finished_recving
        if stray:
            raise HybridKVConfigError(
                "failed_recving",
                sorted(stray),
                "is not a subset of finished_recving",
                "report a failed load as finished and failed (vLLM 0.33)",
            )


class JobResult(NamedTuple):
    """The worker's report that job ``job_id`` is over, and whether it succeeded."""

    job_id: JobId
    success: bool


# --- the two sides' interfaces ----------------------------------------------------------------


class SchedulerConnector(Protocol):
    """The hooks vLLM's scheduler calls (``KVConnectorBase_V1`` with ``SupportsHMA``)."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """How many tokens past ``num_computed_tokens`` the connector can supply; asking
        again without an event in between gives the same answer."""
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """The allocation succeeded: plan loads of ``num_external_tokens`` (0: none) into
        ``block_ids``."""
        ...

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """Hand out the jobs that start in this step; called once per ``schedule()``."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Take in the finished and failed jobs of the last step."""
        ...

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """The request is done (or aborted); True asks vLLM to keep its blocks until the
        request appears in ``finished_sending``."""
        ...


class GpuBlockPool(Protocol):
    """What the core needs of the scheduler's GPU block pool: a reference up and down per block,
    which is how it keeps a store job's source blocks alive.

    Fitted by ``spec.block_pool.BlockPool`` and, through an adapter, by vLLM's ``BlockPool``.
    """

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block: the core's pin on a store source."""
        ...

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Remove a reference from each block, given in eviction-priority order."""
        ...


class WorkerConnector(Protocol):
    """The worker's half: it takes each step's jobs and folds their results per request."""

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Take this step's jobs; from here on they are in flight."""
        ...

    def get_transfer_results(self, results: tuple[JobResult, ...]) -> KVConnectorOutput:
        """Turn job results into finished/failed receives and finished sends per request."""
        ...
