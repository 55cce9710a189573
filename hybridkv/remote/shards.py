"""Tensor-parallel shards of a chunk on the shared tier: one key per shard, and a chunk held
only when every shard is (issue 30, item 4).

Under tensor parallelism each rank holds its own slice of every layer (a slice of the KV heads,
of the mamba heads), so a rank's host slot holds that rank's shard of a block, and a chunk is
one server value per shard. A shard's key is the contract's chunk key over the same members
under a namespace scoped by an identity that names the rank holding the shard
(:class:`~hybridkv.remote.identity.ModelIdentity` ``tp_rank``) and the TP size
(:func:`shard_namespaces`): no rank reads another's shard, and engines of another TP size
share no key with these. At TP 1 the one shard's key is the chunk key of rank 0, as before.

Replicated KV (vLLM's ``kv_tp_replicas``: an MLA model's latent cache is the same bytes on each
of ``replicas`` consecutive ranks) is one shard per group of replicas: its key names the group's
first rank, that rank alone writes it (:meth:`ShardPlan.writes`), every rank of the group reads
it. Where the group shares one host region (:class:`hybridkv.vllm.ranks.HostSharding`), only
the first rank fetches into it (:meth:`ShardPlan.fetches`), as only it stores into it.

The all-ranks rule, in one place (:func:`held_per_chunk`, over the answer of
:func:`held_on_every_shard` or of a lookup asked off the scheduler thread,
:mod:`hybridkv.remote.lookup_book`): a chunk counts as held only if the server holds every
shard's key; one pipelined EXISTS asks them all, so a shard missing on
one rank is a miss for the chunk, never a partial claim. A shard that vanishes after the lookup
fails that rank's fetch; the promotion resolves only once every fetching rank reported it,
PROMOTED only if all did (:func:`combined_outcome`), so a failure on one rank drops the members
on every rank before any claim covers them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.client import ChunkClient
from hybridkv.remote.codec import chunk_key, redis_key
from hybridkv.remote.identity import ModelIdentity, scoped_namespace
from hybridkv.remote.values import ClientFault, PromoteOutcome

__all__ = [
    "ShardPlan",
    "combined_outcome",
    "held_on_every_shard",
    "held_per_chunk",
    "shard_identity",
    "shard_keys",
    "shard_namespaces",
]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """How ``tp_size`` ranks map onto a chunk's shards on the server.

    Attributes:
        tp_size: tensor-parallel ranks.
        replicas: consecutive ranks holding identical KV (vLLM's ``kv_tp_replicas``; 1: every
            rank its own shard); divides ``tp_size``.
        shared_host: each group of replicas maps one host region (only its first rank
            writes it); False: every rank keeps its own host copy.
    """

    tp_size: int = 1
    replicas: int = 1
    shared_host: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HybridKVConfigError(name, value, "must be an int >= 1", "pass one")
        if self.tp_size % self.replicas:
            raise HybridKVConfigError(
                "replicas",
                self.replicas,
                f"does not divide the {self.tp_size} tensor-parallel ranks",
                "pass vLLM's kv_tp_replicas, a divisor of tensor_parallel_size",
            )

    @property
    def shards(self) -> int:
        """Server values per chunk: one per group of replicas."""
        return self.tp_size // self.replicas

    @property
    def fetchers(self) -> int:
        """Ranks that fetch each promoted chunk, so reports a promotion waits for."""
        return self.shards if self.shared_host else self.tp_size

    def shard_of(self, rank: int) -> int:
        """The shard ``rank`` writes and reads (the index into a chunk's shard keys)."""
        return rank // self.replicas

    def owner(self, shard: int) -> int:
        """The rank a shard's key names: the first rank of its group."""
        return shard * self.replicas

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes its shard to the server (one writer per group)."""
        return rank % self.replicas == 0

    def fetches(self, rank: int) -> bool:
        """Whether ``rank`` fetches its shard into host memory (a shared region is filled by
        its first rank; private memory by every rank)."""
        return self.writes(rank) or not self.shared_host


def shard_namespaces(
    namespace: bytes,
    identity: ModelIdentity,
    plan: ShardPlan,
    weights_version: int,
    epoch: bytes = b"",
) -> tuple[bytes, ...]:
    """Per shard, ``namespace`` scoped by ``identity`` naming the shard's first rank (its
    ``tp_rank``) and the replica count (replicated and sharded KV never share a key), the
    weights version and the epoch (:func:`scoped_namespace`).

    Pure. Pre: ``identity.tp_size == plan.tp_size`` (field ``identity``).
    """
    if identity.tp_size != plan.tp_size:
        raise HybridKVConfigError(
            "identity",
            identity.tp_size,
            f"names {identity.tp_size} tensor-parallel ranks, the shard plan {plan.tp_size}",
            "build both from vLLM's tensor_parallel_size",
        )
    return tuple(
        scoped_namespace(namespace, shard_identity(identity, plan, s), weights_version, epoch)
        for s in range(plan.shards)
    )


def shard_identity(identity: ModelIdentity, plan: ShardPlan, shard: int) -> ModelIdentity:
    """``identity`` naming ``shard``'s first rank (its ``tp_rank``) and the replica count: whose
    bytes that shard's values hold (its namespace's, and the disk tier's directory's).

    Pure. Pre: ``0 <= shard < plan.shards`` (field ``shard``)."""
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < plan.shards:
        raise HybridKVConfigError(
            "shard", shard, f"must be an int in [0, {plan.shards})", "pass plan.shard_of(rank)"
        )
    return replace(identity, tp_rank=plan.owner(shard), kv_replicas=plan.replicas)


def shard_keys(namespaces: Sequence[bytes], members: Sequence[bytes]) -> tuple[bytes, ...]:
    """Every shard's chunk key of ``members``, in shard order."""
    return tuple(chunk_key(namespace, members) for namespace in namespaces)


def held_on_every_shard(
    client: ChunkClient, chunks: Sequence[Sequence[bytes]]
) -> tuple[bool, ...] | ClientFault:
    """Per chunk (its shard keys), whether the server holds every shard: the all-ranks rule.

    One pipelined EXISTS over all the keys (one round trip, as for one shard). A fault answers
    for all of them (the caller treats it as none present). Frame: nothing changes.
    """
    found = client.exists([redis_key(key) for keys in chunks for key in keys])
    if isinstance(found, ClientFault):
        return found
    return held_per_chunk(found, chunks)


def held_per_chunk(found: Sequence[bool], chunks: Sequence[Sequence[bytes]]) -> tuple[bool, ...]:
    """Per chunk (its shard keys), whether every shard is held, from ``found``: the EXISTS
    answer over all the chunks' keys flattened in order (one pipelined round trip, asked here
    by :func:`held_on_every_shard` or off the scheduler thread by
    :class:`~hybridkv.remote.lookup_book.LookupBook`). The all-ranks rule.

    Pure. Pre: ``len(found)`` is the number of keys (field ``found``)."""
    total = sum(len(keys) for keys in chunks)
    if len(found) != total:
        raise HybridKVConfigError(
            "found",
            len(found),
            f"answers {len(found)} keys, the chunks have {total}",
            "pass the EXISTS answer over every chunk's shard keys, in order",
        )
    held = []
    at = 0
    for keys in chunks:
        held.append(all(found[at : at + len(keys)]))
        at += len(keys)
    return tuple(held)


# A promotion's outcome over its ranks: the first of these that any rank reported (a
# server-side fault outranks the shard merely being gone, so the counters name the cause).
_PRECEDENCE = (
    PromoteOutcome.CORRUPT,
    PromoteOutcome.FAULT,
    PromoteOutcome.TIMEOUT,
    PromoteOutcome.MISSING,
    PromoteOutcome.PROMOTED,
)


def combined_outcome(outcomes: Iterable[PromoteOutcome]) -> PromoteOutcome:
    """The outcome of a chunk whose ranks fetched ``outcomes``: PROMOTED only if every rank
    promoted its shard, else the gravest failure (CORRUPT, FAULT, TIMEOUT, MISSING)."""
    seen = set(outcomes)
    if not seen:
        raise HybridKVConfigError("outcomes", (), "is empty", "pass every rank's outcome")
    return next(o for o in _PRECEDENCE if o in seen)
