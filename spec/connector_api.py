"""The boundary between the scheduler model and a connector model, in vLLM 0.33's words.

The scheduler (:mod:`spec.scheduler`) drives any object that satisfies
:class:`SchedulerConnector`, exactly as vLLM's ``Scheduler`` drives a ``KVConnectorBase_V1`` that
is ``SupportsHMA``; the reference connector (:mod:`spec.connector`) is one such object and the
optimized connector core of hybridkv another. The worker side (:class:`WorkerConnector`) turns
transfer-job results into the request-level ``KVConnectorOutput`` the scheduler consumes.

Values only: every type here is frozen. vLLM's ``(int | None, bool)`` claim tuple becomes a
:class:`Claim` with a :class:`ClaimKind`, so "ask again" is a named case, not ``None``.

vLLM 0.33 references (``vllm/`` relative): the connector base
``distributed/kv_transfer/kv_connector/v1/base.py`` (``get_num_new_matched_tokens`` 515-548,
``update_state_after_alloc`` 568-592, ``build_connector_meta`` 594-611,
``update_connector_output`` 621-629, ``SupportsHMA.request_finished_all_groups`` 101-129), the
transfer results dataclass (88-98: a failed receive is also a finished receive).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NewType, Protocol

__all__ = [
    "BlockTable",
    "Claim",
    "ClaimKind",
    "ConnectorMeta",
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

BlockTable = tuple[tuple[int, ...], ...]
"""A request's block ids per KV cache group, position-indexed; 0 is the null block."""


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a connector may read of a request.

    Attributes:
        request_id: the scheduler's id.
        token_ids: prompt tokens followed by the output tokens produced so far.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        cache_salt: the isolation domain; requests with different salts never share KV.
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    cache_salt: str | None = None


class ClaimKind(Enum):
    """The answer of ``get_num_new_matched_tokens`` (vLLM's ``(n | None, is_async)``).

    - ``DEFER``: ``(None, False)``, the connector needs more time; ask again next step.
    - ``NONE``: ``(0, False)``, nothing to load.
    - ``SYNC``: ``(n, False)`` with n > 0, loaded before this step's forward.
    - ``ASYNC``: ``(n, True)`` with n > 0, the request waits in WAITING_FOR_REMOTE_KVS.
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
            raise ValueError(
                f"Claim(kind={self.kind.value}, num_tokens={self.num_tokens}): SYNC and ASYNC "
                "claim a positive number of tokens, DEFER and NONE claim 0"
            )

    def as_vllm(self) -> tuple[int | None, bool]:
        """vLLM's tuple form.

        Pure: DEFER is ``(None, False)``, NONE ``(0, False)``, SYNC ``(n, False)`` and ASYNC
        ``(n, True)``, with ``n`` = ``num_tokens``.
        """
        if self.kind is ClaimKind.DEFER:
            return None, False
        return self.num_tokens, self.kind is ClaimKind.ASYNC


class TransferKind(Enum):
    """LOAD moves host chunks into GPU blocks; STORE moves GPU blocks into host chunks."""

    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class TransferItem:
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

    ``sync`` (loads only) marks a load the worker finishes before this step's forward, as
    vLLM's ``TransferJob.sync`` (``offloading/worker.py`` ``start_kv_transfers``): its request
    already runs this step, so it never appears in ``finished_recving``.
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
    free the connector delayed (``request_finished_all_groups`` returned True); the worker
    reports each in ``finished_sending`` once all its store jobs reported (vLLM hands the
    worker ``finished_req_ids`` in ``get_finished`` for the same purpose).
    """

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    delayed_free_ids: frozenset[RequestId] = frozenset()


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request scheduled in a step, as the connector sees it in the scheduler output.

    ``num_computed_tokens`` is the count before this step; after the forward the request has
    KV for ``num_computed_tokens + num_scheduled_tokens`` tokens. ``store_limit``: no unit ending
    past it is stored (``None``: no limit). The step's range still says where its mamba states
    sit (MB-8): a limit never moves the step's end, which would key a state by a position it
    does not hold (a recompute of prompt and output with only the prompt stored).
    """

    request: RequestView
    block_ids: BlockTable
    num_computed_tokens: int
    num_scheduled_tokens: int
    store_limit: int | None = None


@dataclass(frozen=True, slots=True)
class StepView:
    """The parts of vLLM's ``SchedulerOutput`` a connector reads in ``build_connector_meta``."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_ids: frozenset[RequestId] = frozenset()
    preempted_ids: frozenset[RequestId] = frozenset()


@dataclass(frozen=True, slots=True)
class JobResult:
    """The worker's report for one job: it completed, successfully or not."""

    job_id: JobId
    success: bool


@dataclass(frozen=True, slots=True)
class KVConnectorOutput:
    """vLLM's ``KVConnectorOutput`` as the scheduler consumes it.

    ``failed_recving`` is a subset of ``finished_recving`` (vLLM 0.33 emits a failed receive only
    together with a finished one). ``finished_sending`` names requests whose delayed block free
    may now happen. ``completed_jobs`` carries every job result the worker folded, in report
    order: the channel through which the scheduler-side connector learns job-level outcomes
    (store completions, which load job failed), as vLLM's ``kv_connector_worker_meta``
    (``OffloadingWorkerMetadata.completed_jobs``) does.
    """

    finished_recving: frozenset[RequestId] = frozenset()
    failed_recving: frozenset[RequestId] = frozenset()
    finished_sending: frozenset[RequestId] = frozenset()
    completed_jobs: tuple[JobResult, ...] = ()

    def __post_init__(self) -> None:
        if not self.failed_recving <= self.finished_recving:
            raise ValueError(
                "KVConnectorOutput.failed_recving must be a subset of finished_recving "
                "(vLLM 0.33 reports a failed load as finished and failed)"
            )


class SchedulerConnector(Protocol):
    """The scheduler-side connector contract (vLLM's ``KVConnectorBase_V1`` + ``SupportsHMA``).

    The scheduler calls, per ``schedule()``: ``get_num_new_matched_tokens`` for a waiting
    request, ``update_state_after_alloc`` after each successful allocation, then
    ``build_connector_meta`` once; per ``update_from_output``: ``update_connector_output``;
    and ``request_finished_all_groups`` whenever a request finishes (an abort included).
    """

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """Claim external tokens beyond ``num_computed_tokens`` (scheduler-block aligned).

        Pre: ``num_computed_tokens`` is the request's local hit aligned down to the scheduler
        block (the lcm of the group block sizes), >= 0. Post: DEFER asks to be asked again next
        step; a SYNC or ASYNC claim ends within ``request.token_ids`` (vLLM asserts it,
        ``scheduler.py:1217-1220``: ``ConnectorContractError`` under ``vllm_exact``). Frame: no
        observable change: the scheduler may ask again, or drop the answer (a refused
        allocation), and asking again with no event in between gives the same claim. An
        implementation may remember the asked position for the ``update_state_after_alloc``
        of the same ``schedule()`` (the reference does, and clears it in
        ``build_connector_meta``).
        """
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """Record the allocation; load ``num_external_tokens`` into ``block_ids`` if > 0.

        May be called twice for one async request (at allocation and after the transfer).

        Pre: the allocation succeeded in this ``schedule()``; ``block_ids`` is the request's
        table after it; ``num_external_tokens`` is 0 or the accepted part of the claim this
        ``schedule()`` asked for (at most the claim). Post: the loads of those tokens into the
        real blocks of ``block_ids`` are planned and go out in the next
        ``build_connector_meta``; with 0, nothing needs to change. Refusal: a broken
        pre-condition raises and changes nothing (the reference: ``ConfigError``).
        """
        ...

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """The load and store jobs to start this step (called once per ``schedule()``).

        Pre: every ``update_state_after_alloc`` of this ``schedule()`` came first; ``step``
        lists the step's scheduled requests with their counts before the forward. Post: the
        loads planned since the last call and this step's stores, each with a fresh job id and
        handed out once; the requests whose free was delayed since the last call. Never
        refuses: a store the host has no room for is left out, not refused.
        """
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which loads finished or failed and which delayed frees may proceed.

        Pre: ``output`` is the worker's fold of results of jobs this connector handed out,
        each job reported once. Post: every reported job is finished for the connector (its
        host keys released; a failed load's keys counted as absent if the implementation
        remembers failures); an unreported job stays in flight. Refusal: a result naming no
        job in flight raises (the reference: ``ConfigError``; results before it are folded).
        """
        ...

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """Called once when a request finishes; True keeps its blocks until finished_sending.

        Pre: ``request`` just finished (stopped, aborted or failed), reported once;
        ``block_ids`` are its blocks of the computed tokens (vLLM's
        ``get_block_ids_for_computed_tokens``). Post: True when a store still reads the
        blocks (vLLM: the request is saved asynchronously): the scheduler frees them only once
        ``finished_sending`` names the request; False lets it free them now (a load still in
        flight is the scheduler's own hold). The connector may forget the request's other
        state. Never refuses.
        """
        ...


class WorkerConnector(Protocol):
    """The worker-side contract: run the jobs, report request-level outcomes."""

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs (they are now in flight).

        Pre: ``meta`` came from this step's ``build_connector_meta``; no job id in it is in
        flight. Post: its jobs are in flight; its delayed requests await
        ``finished_sending``. Refusal: a job id already in flight raises and changes nothing
        (the reference: ``ConfigError``).
        """
        ...

    def get_transfer_results(self, results: tuple[JobResult, ...]) -> KVConnectorOutput:
        """Fold job results into request-level finished/failed receives and finished sends.

        Pre: each result names a job in flight, once. Post: the reported jobs left flight;
        ``finished_recving`` names each request whose last async load job reported
        (``failed_recving``: those with a failed job; a sync load never appears);
        ``finished_sending`` names each delayed request with no store left in flight;
        ``completed_jobs`` carries ``results`` in order. Refusal: a result naming no job in
        flight raises and changes nothing (the reference: ``ConfigError``).
        """
        ...
