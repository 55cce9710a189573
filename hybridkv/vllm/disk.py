"""The disk tier inside :class:`~hybridkv.vllm.connector.HybridKVConnector` (issue 31): chunks in
files under ``disk_dir``, below the host tier, that outlive the engine.

The disk is one more :class:`~hybridkv.remote.ChunkClient` (:class:`hybridkv.disk.DiskClient`),
so the remote tier's machinery runs it end to end (:mod:`hybridkv.vllm.remote`): write orders
when a store reports, the worker's copy of the slots and its write-behind queue, lookups off the
scheduler thread, verified fetches into reserved host slots, the all-ranks rule under tensor
parallelism, the model identity and weights version in every chunk key. What this module adds
is where the files live and who may touch them:

- Directory (the restart rule). Each shard of each model identity has its own directory,
  ``<disk_dir>/<hex SHA-256 of the shard's identity>`` (:func:`disk_directory`): the identity
  of :func:`hybridkv.vllm.remote.model_identity` (model, revision, dtypes, KV layout, TP size,
  the shard's rank, vLLM's config hashes), without the weights version and epoch. A restart of
  the same model on the same directory finds its files and serves them from its first request;
  another model (or another TP size) never opens them. After a connector reset the chunk keys
  move to the engine's own epoch (:mod:`hybridkv.remote.identity`), so the files written
  before are never read again by this process; the index evicts them like any cold file.
- Roles. The worker of the rank that writes a shard (:meth:`hybridkv.remote.ShardPlan.writes`)
  holds the shard's :attr:`~hybridkv.disk.DiskRole.OWNER` client: it rebuilds the index from
  the directory at start-up, reserves, evicts and writes. The scheduler (another process)
  only asks which chunks exist: a :attr:`~hybridkv.disk.DiskRole.READER` per shard, which
  stats files and never writes (:class:`ShardReaders`). A rank that fetches a shard another
  rank writes (replicated KV in private host memory) reads it as a READER.
- Bytes. ``disk_bytes`` is all shards together: each shard's directory gets
  ``disk_bytes // shards`` (:func:`disk_share`), so the tier never takes more than the key
  says, whatever the TP size.
- No breaker, no TTL. A local disk does not go down as a server does: each call's fault is
  returned and counted (a full disk refuses writes while reads go on serving), so the remote
  tier's circuit breaker, which would also skip every lookup, is left off. Every fetch is
  bounded by :data:`DISK_DEADLINE_S` (a slow shared filesystem: TIMEOUT, recomputed).

Counters: the disk tier reports under the remote tier's names (``remote_written``,
``promoted``, ...: docs/howto/disk-tier.md), the disk client's own in its ``snapshot()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from hybridkv.disk import DirectIO, DiskClient, DiskConfig, DiskRole, FsyncPolicy
from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import ClientFault, ModelIdentity, RemoteConfig, ShardPlan, shard_identity
from hybridkv.vllm.config import DiskSettings

__all__ = [
    "DISK_DEADLINE_S",
    "DISK_INDEX_ENTRIES",
    "DISK_MAX_PENDING",
    "DISK_NAMESPACE",
    "ShardReaders",
    "disk_config",
    "disk_directory",
    "disk_remote_config",
    "disk_share",
    "scheduler_disk_client",
    "worker_disk_client",
]

DISK_DEADLINE_S = 1.0
"""The longest one disk fetch may take (a chunk is a few MB: milliseconds on a local NVMe,
tens on a shared filesystem); past it the fetch is TIMEOUT and vLLM recomputes."""
DISK_MAX_PENDING = 64
"""Write-behinds queued or in flight per worker; beyond it a write is dropped (counted)."""
DISK_NAMESPACE = b"hybridkv"
"""The namespace of the disk tier's chunk keys (scoped by the identity like the remote's)."""
DISK_INDEX_ENTRIES = 1
"""Chunks the write-behind remembers having written (:class:`hybridkv.remote.RemoteConfig`
``index_entries``), with a disk below the host: one, so it trusts nothing. A chunk is stored
again only when the host lacked it and no lookup promoted it, which with a disk below mostly
means the disk evicted it: remembered as written, it would never be written back, and a hot
chunk the disk's policy aged out (its disk reads are rare while the host holds it) would be
lost for good. Forgotten, it is written again; a chunk the disk still holds costs one encode
and no I/O (the disk client skips it and renews its recency, ``set_present``)."""

_FSYNC = {"file": FsyncPolicy.FILE, "never": FsyncPolicy.NEVER}
_DIRECT = {"auto": DirectIO.AUTO, "on": DirectIO.ON, "off": DirectIO.OFF}


def disk_directory(root: str, identity: ModelIdentity, plan: ShardPlan, shard: int) -> Path:
    """``<root>/<hex SHA-256 of shard's identity>``: where ``shard``'s files live (module
    docstring, "Directory"). Pure: equal on the scheduler and on the worker of one engine, and
    on every engine of the same model, TP size and shard."""
    scoped = shard_identity(identity, plan, shard)
    return Path(root) / hashlib.sha256(scoped.encoded()).hexdigest()


def disk_share(settings: DiskSettings, plan: ShardPlan) -> int:
    """Each shard's bytes: ``disk_bytes`` split over the shards; refused below one byte."""
    share = settings.capacity_bytes // plan.shards
    if share < 1:
        raise HybridKVConfigError(
            "kv_connector_extra_config.disk_bytes",
            settings.capacity_bytes,
            f"leaves nothing for each of the {plan.shards} tensor-parallel shards",
            f"give at least {plan.shards} bytes per shard's worth of chunks",
        )
    return share


def disk_config(settings: DiskSettings, directory: Path, capacity_bytes: int) -> DiskConfig:
    """The disk client's config of one shard's ``directory`` and byte share."""
    return DiskConfig(
        directory=directory,
        capacity_bytes=capacity_bytes,
        policy=settings.policy,
        threads=settings.threads,
        fsync=_FSYNC[settings.fsync],
        direct=_DIRECT[settings.direct],
    )


def disk_remote_config() -> RemoteConfig:
    """The remote tier machinery's config when the disk is the tier below the host: the disk's
    deadline and queue bound, no TTL, the disk's namespace (the server address is unused: the
    tier talks to the disk client it is given)."""
    return RemoteConfig(
        connect_timeout_s=DISK_DEADLINE_S,
        deadline_s=DISK_DEADLINE_S,
        ttl_s=0,
        max_pending=DISK_MAX_PENDING,
        namespace=DISK_NAMESPACE,
        index_entries=DISK_INDEX_ENTRIES,
    )


class ShardReaders:
    """The scheduler's :class:`~hybridkv.remote.ChunkClient` on every shard's directory: a key
    exists where any shard's directory holds its file. A shard's keys are scoped by that
    shard's identity (:func:`hybridkv.remote.shard_namespaces`), so a key's file can only be in
    its own shard's directory, and asking every directory finds it there (one stat each: the
    lookups run off the scheduler thread). Never writes: ``set`` answers FAULT."""

    def __init__(self, readers: Sequence[DiskClient]) -> None:
        if not readers:
            raise HybridKVConfigError("readers", readers, "is empty", "pass one per shard")
        self._readers = tuple(readers)

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """Per key, whether some shard's directory holds it whole; a reader's fault answers
        for every key (the lookup counts it and treats none as present)."""
        found = [False] * len(keys)
        for reader in self._readers:
            held = reader.exists(keys)
            if isinstance(held, ClientFault):
                return held
            found = [a or b for a, b in zip(found, held, strict=True)]
        return tuple(found)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """The first shard directory's verified value of ``key``, else None."""
        for reader in self._readers:
            value = reader.get(key)
            if value is not None:
                return value
        return None

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """The scheduler never writes (the workers' OWNER clients do): refused."""
        return ClientFault.FAULT

    def close(self) -> None:
        for reader in self._readers:
            reader.close()


def scheduler_disk_client(
    settings: DiskSettings, identity: ModelIdentity, plan: ShardPlan
) -> ShardReaders:
    """The scheduler's READER clients, one per shard's directory (module docstring)."""
    share = disk_share(settings, plan)
    return ShardReaders(
        [
            DiskClient(
                disk_config(settings, disk_directory(settings.root, identity, plan, s), share),
                role=DiskRole.READER,
            )
            for s in range(plan.shards)
        ]
    )


def worker_disk_client(
    settings: DiskSettings, identity: ModelIdentity, plan: ShardPlan, rank: int
) -> DiskClient:
    """Rank ``rank``'s client on its shard's directory: OWNER where the rank writes the shard,
    else READER (it fetches what the shard's first rank writes)."""
    shard = plan.shard_of(rank)
    config = disk_config(
        settings, disk_directory(settings.root, identity, plan, shard), disk_share(settings, plan)
    )
    return DiskClient(config, role=DiskRole.OWNER if plan.writes(rank) else DiskRole.READER)
