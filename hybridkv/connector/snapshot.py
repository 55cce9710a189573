"""The core's state as plain values: the reference connector's snapshot schema.

``spec.connector.scheduler_side`` defines the schema (never imported here); the MB-* and SEC-1
predicates read it, and the differential tests compare the optimized core's snapshot with the
reference's after every call. Everything is tuples, ints, strings and hex keys, so two
snapshots compare equal exactly when the states they describe do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Any

from hybridkv.connector.api import JobId, RequestId, TransferItem, TransferJob
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.loads import LoadRecord

__all__ = ["plain_core"]


def _plain_item(item: TransferItem) -> tuple[int, int, str, int]:
    """An item as (group, block, key hex, end token)."""
    return item.group_idx, item.block_id, item.key.hex(), item.end_token


def _ids(jobs: Iterable[JobId]) -> tuple[int, ...]:
    return tuple(sorted(map(int, jobs)))


def _plain_job(job: TransferJob, salt: str | None) -> tuple[Any, ...]:
    head = (int(job.job_id), job.kind.value, job.request_id, salt, job.sync)
    return (*head, tuple(map(_plain_item, job.items)))


def _plain_load(rid: RequestId, load: LoadRecord) -> tuple[Any, ...]:
    claim = (rid, load.start, load.end, load.num_tokens, load.sync, load.cache_salt)
    outcome = (tuple(map(int, load.jobs)), _ids(load.reported), _ids(load.failed))
    return (*claim, *outcome, tuple(map(_plain_item, load.items)))


# A checkpoint rule's fields in the schema's order.
_RULE = attrgetter(
    "alignment", "hash_block_size", "cache_hit_alignment", "drop_eagle_block", "hash_lookahead"
)


def _plain_geometry(geometry: ConnectorGeometry) -> dict[str, Any]:
    rules = tuple(map(_RULE, geometry.checkpoints))
    kinds = tuple(kind.value for kind in geometry.kinds)
    return {"kinds": kinds, "units": geometry.units, "align": geometry.align, "checkpoints": rules}


def plain_core(
    geometry: ConnectorGeometry,
    *,
    next_job: int,
    jobs: Mapping[JobId, tuple[TransferJob, str | None]],
    loads: Mapping[RequestId, LoadRecord],
    delayed: Iterable[RequestId],
    store_spans: Mapping[JobId, tuple[int, int]],
    memory: Mapping[str, Any],
    store: Mapping[str, Any],
) -> dict[str, Any]:
    """The snapshot of a core with these parts (``memory``: the failure memory's own
    snapshot; ``store``: the host store's)."""
    plain = _plain_geometry(geometry)
    plain["next_job_id"] = next_job
    plain["jobs"] = tuple(_plain_job(*jobs[j]) for j in sorted(jobs))
    plain["loads"] = tuple(_plain_load(rid, loads[rid]) for rid in sorted(loads))
    plain["delayed"] = tuple(sorted(delayed))
    plain["store_spans"] = tuple((int(j), *store_spans[j]) for j in sorted(store_spans))
    plain["store"] = store
    plain.update(memory)
    return plain
