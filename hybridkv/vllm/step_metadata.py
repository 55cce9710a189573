"""What crosses between ``HybridKVConnector``'s two roles each step, through vLLM.

Scheduler to workers: :class:`HybridKVMetadata`, the step's jobs with the host slot of every key
they name (a worker has no store) and the late loads to abandon; a worker reads the slots
through :class:`MetaSlots`. Workers to scheduler: :class:`HybridKVWorkerMeta`, the job results
each worker folded (``KVConnectorOutput.kv_connector_worker_meta``), merged across ranks by
vLLM's aggregator before the scheduler side's quorum reads them (:mod:`hybridkv.vllm.ranks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.connector import ConnectorMeta, TransferKind
from hybridkv.store import LookupResult
from hybridkv.vllm.ranks import RankReport, merge_reports
from hybridkv.vllm.remote import FetchReport, RemoteOrders

__all__ = ["HybridKVMetadata", "HybridKVWorkerMeta", "MetaSlots"]


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    """One step's jobs, the host slot of every key they name (the worker has no store), the
    load jobs past their deadline, to abandon, and whether the step runs no forward
    (``no_forward``: vLLM schedules no token, so the worker's hooks are all its step does and
    it may give its copy thread a turn; the worker cannot tell on its own, since the runner
    calls the same hooks either way)."""

    meta: ConnectorMeta
    slots: dict[bytes, int]
    abandon: tuple[int, ...] = ()
    remote: RemoteOrders | None = None
    no_forward: bool = False


@dataclass
class HybridKVWorkerMeta(KVConnectorWorkerMetadata):
    """The job results workers folded this step, for the scheduler side's quorum: per job,
    how many workers reported it and whether all of them succeeded (:mod:`hybridkv.vllm.ranks`).
    """

    reports: tuple[RankReport, ...] = ()
    # Remote tier: every fetching rank's reports, concatenated (SchedulerRemote.fold waits for
    # all of a chunk's before resolving it).
    fetches: tuple[FetchReport, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Workers added, success ANDed per job (vLLM folds the workers of one step so)."""
        assert isinstance(other, HybridKVWorkerMeta)
        return HybridKVWorkerMeta(
            merge_reports(self.reports, other.reports), (*self.fetches, *other.fetches)
        )


class MetaSlots:
    """The worker's view of the store (:class:`hybridkv.connector.worker.HostSlots`): the keys
    of the metadata being bound, READY for loads and STORING for stores."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._slots: dict[bytes, int] = {}
        self._status: dict[bytes, LookupResult] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    def show(self, metadata: HybridKVMetadata) -> None:
        self._slots = metadata.slots
        self._status = {}
        for job in (*metadata.meta.load_jobs, *metadata.meta.store_jobs):
            status = LookupResult.HIT if job.kind is TransferKind.LOAD else LookupResult.HIT_PENDING
            for item in job.items:
                self._status[item.key] = status

    def status(self, key: bytes) -> LookupResult:
        return self._status.get(key, LookupResult.MISS)

    def slots(self, keys: Iterable[bytes]) -> tuple[int, ...]:
        return tuple(self._slots[key] for key in keys)
