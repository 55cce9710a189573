"""What the remote tier's two sides exchange each step (the package docstring says how):
the scheduler's orders to the workers (:class:`RemoteOrders` in the connector metadata) and each
rank's fetch outcomes back (:class:`FetchReport` in ``HybridKVWorkerMeta.fetches``). Frozen
values: they cross between processes inside vLLM's metadata."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FetchOrder", "FetchReport", "RemoteOrders"]


@dataclass(frozen=True, slots=True)
class FetchOrder:
    """One chunk's members and their host slots (a write copies from them, a fetch into them).

    ``chunk_key`` names the chunk (its first shard's key: what reports name); ``shard_keys``
    is every shard's server key in shard order (:mod:`hybridkv.remote.shards`; one at TP 1,
    equal to ``chunk_key``), of which each rank writes or fetches its own."""

    chunk_key: bytes
    members: tuple[bytes, ...]
    slots: tuple[int, ...]
    shard_keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class RemoteOrders:
    """What the worker's remote side does this step: copy and queue ``writes``, then fetch
    ``fetches`` (metadata, scheduler -> worker)."""

    writes: tuple[FetchOrder, ...] = ()
    fetches: tuple[FetchOrder, ...] = ()


@dataclass(frozen=True, slots=True)
class FetchReport:
    """One rank's fetch outcome (worker metadata, worker -> scheduler): ``outcome`` is a
    :class:`hybridkv.remote.PromoteOutcome` value. Under tensor parallelism every fetching rank
    reports each chunk; vLLM's aggregator concatenates them."""

    chunk_key: bytes
    outcome: str
