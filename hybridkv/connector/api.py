"""The connector core's boundary values, in vLLM 0.33's words (the engine-facing interface).

Field for field and method for method the twin of the reference model's ``spec.connector_api``
(never imported here): a scheduler drives a :class:`SchedulerConnector`, a worker folds job
results through a :class:`WorkerConnector`. The spec scheduler speaks these values through
``hybridkv.simulator.engine_adapter``, and the vLLM connector (``hybridkv.vllm``) speaks them
too, so the core itself never converts anything. One field has no twin: ``StepView.no_unit_ids``, a
shortcut for requests whose step stores nothing; naming a request there answers exactly as
listing it in ``scheduled`` (tests/connector/test_no_unit_steps.py), and the spec's callers
leave it empty.

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

RequestId = NewType("RequestId", str)
JobId = NewType("JobId", int)
"""A connector job id (``TransferJob.job_id``); a transfer engine numbers its own jobs apart."""

BlockTable = tuple[tuple[int, ...], ...]
"""A request's block ids per KV cache group, position-indexed; 0 is the null block."""


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a connector may read of a request.

    Attributes:
        request_id: the scheduler's id.
        token_ids: prompt tokens followed by the output tokens produced so far; a request's
            tokens only ever grow (the core hashes them incrementally on that promise).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        cache_salt: the isolation domain; requests with different salts never share KV.
        block_hashes: the engine's own chained hashes, one per full ``hash_block_size`` block
            of ``token_ids`` (vLLM's ``request.block_hashes``, which fold in multimodal
            inputs, LoRA and the salt); None: the core hashes ``token_ids`` itself. Given, the
            offload keys are read off them, so requests that differ only in what the engine
            hashes beside the tokens never share a key.
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    cache_salt: str | None = None
    block_hashes: tuple[bytes, ...] | None = None


class ClaimKind(Enum):
    """The answer of ``get_num_new_matched_tokens`` (vLLM's ``(n | None, is_async)``).

    ``DEFER`` ``(None, False)``: ask again next step; ``NONE`` ``(0, False)``: nothing to load;
    ``SYNC`` ``(n, False)``: loaded before this step's forward; ``ASYNC`` ``(n, True)``: the
    request waits in WAITING_FOR_REMOTE_KVS.
    """

    DEFER = "defer"
    NONE = "none"
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True, slots=True)
class Claim:
    """A connector's claim: ``num_tokens`` > 0 exactly when ``kind`` is SYNC or ASYNC."""

    kind: ClaimKind
    num_tokens: int = 0

    def __post_init__(self) -> None:
        loads = self.kind in (ClaimKind.SYNC, ClaimKind.ASYNC)
        if loads != (self.num_tokens > 0) or self.num_tokens < 0:
            raise HybridKVConfigError(
                "num_tokens",
                self.num_tokens,
                f"a {self.kind.value} claim of {self.num_tokens} tokens",
                "SYNC and ASYNC claim a positive number of tokens, DEFER and NONE claim 0",
            )

    def as_vllm(self) -> tuple[int | None, bool]:
        """vLLM's tuple form."""
        if self.kind is ClaimKind.DEFER:
            return None, False
        return self.num_tokens, self.kind is ClaimKind.ASYNC


class TransferKind(Enum):
    """LOAD moves host chunks into GPU blocks; STORE moves GPU blocks into host chunks."""

    LOAD = "load"
    STORE = "store"


class TransferItem(NamedTuple):
    """One block moved by a job.

    Attributes:
        group_idx: the KV cache group (``kv_cache_group_id``).
        block_id: the GPU block (never 0).
        key: the host store's offload key (block hash + 4-byte big-endian group index).
        end_token: the token position the block's content represents the prefix up to (for a
            mamba group, the exact position of the recurrent state).
    """

    group_idx: int
    block_id: int
    key: bytes
    end_token: int


@dataclass(frozen=True, slots=True)
class TransferJob:
    """A load or store job handed to the worker in one step's connector metadata.

    ``sync`` (loads only) marks a load the worker finishes before this step's forward (vLLM's
    ``TransferJob.sync``): its request already runs, so it never appears in
    ``finished_recving``.
    """

    job_id: JobId
    kind: TransferKind
    request_id: RequestId
    items: tuple[TransferItem, ...]
    sync: bool = False


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """What ``build_connector_meta`` hands to the worker for one step.

    ``delayed_free_ids``: the requests that finished since the last metadata and whose block
    free the connector delayed; the worker reports each in ``finished_sending`` once all its
    store jobs reported.
    """

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    delayed_free_ids: frozenset[RequestId] = frozenset()


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request scheduled in a step; after the forward it has KV for
    ``num_computed_tokens + num_scheduled_tokens`` tokens."""

    request: RequestView
    block_ids: BlockTable
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True, slots=True)
class StepView:
    """The parts of vLLM's ``SchedulerOutput`` a connector reads in ``build_connector_meta``.

    ``no_unit_ids``: requests scheduled in this step whose computed range completes no unit of
    any group (``ConnectorGeometry.completes_a_unit`` is false), named here instead of listed
    in ``scheduled``. Such a request stores nothing, so no view or block table is needed for
    it: on a decode step that is most requests, and building their views and tables was most
    of the adapter's per-step cost. Listing one in ``scheduled`` instead answers the same.
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_ids: frozenset[RequestId] = frozenset()
    preempted_ids: frozenset[RequestId] = frozenset()
    no_unit_ids: frozenset[RequestId] = frozenset()


class JobResult(NamedTuple):
    """The worker's report for one job: it completed, successfully or not."""

    job_id: JobId
    success: bool


@dataclass(frozen=True, slots=True)
class KVConnectorOutput:
    """vLLM's ``KVConnectorOutput`` as the scheduler consumes it.

    ``failed_recving`` is a subset of ``finished_recving``; ``finished_sending`` names requests
    whose delayed block free may now happen; ``completed_jobs`` carries every job result the
    worker folded, in report order (vLLM's ``kv_connector_worker_meta.completed_jobs``).
    """

    finished_recving: frozenset[RequestId] = frozenset()
    failed_recving: frozenset[RequestId] = frozenset()
    finished_sending: frozenset[RequestId] = frozenset()
    completed_jobs: tuple[JobResult, ...] = ()

    def __post_init__(self) -> None:
        if not self.failed_recving <= self.finished_recving:
            raise HybridKVConfigError(
                "failed_recving",
                sorted(self.failed_recving - self.finished_recving),
                "is not a subset of finished_recving",
                "report a failed load as finished and failed (vLLM 0.33)",
            )


class GpuBlockPool(Protocol):
    """The two calls the core makes on the scheduler's GPU block pool to pin store sources.

    ``spec.block_pool.BlockPool`` and vLLM's ``BlockPool`` (through an adapter) both fit.
    """

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one reference on each block (the core's pin)."""
        ...

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop one reference per block, in eviction-priority order."""
        ...


class SchedulerConnector(Protocol):
    """The scheduler-side contract (vLLM's ``KVConnectorBase_V1`` + ``SupportsHMA``)."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """Claim external tokens beyond ``num_computed_tokens``; may be asked repeatedly."""
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """Record the allocation; load ``num_external_tokens`` into ``block_ids`` if > 0."""
        ...

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """The load and store jobs to start this step (once per ``schedule()``)."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which jobs finished or failed."""
        ...

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """Called once when a request finishes; True keeps its blocks until finished_sending."""
        ...


class WorkerConnector(Protocol):
    """The worker-side contract: accept the jobs, report request-level outcomes."""

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs (they are now in flight)."""
        ...

    def get_transfer_results(self, results: tuple[JobResult, ...]) -> KVConnectorOutput:
        """Fold job results into request-level finished/failed receives and finished sends."""
        ...
