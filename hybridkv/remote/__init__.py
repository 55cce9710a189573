"""The remote tier (issue 12): content-addressed chunks on a shared Redis/Valkey server under
the host store. One idea per module: :mod:`.values`, :mod:`.config`, :mod:`.codec` (chunk keys
and verified values), :mod:`.security` (credentials, TLS files, the fleet key that MACs or
encrypts values), :mod:`.client` (redis-py, faults returned), :mod:`.cluster` (the same on a
Redis/Valkey Cluster), :mod:`.tier` (write-behind, lookups, fetches, counters), :mod:`.slots`
(host slot bytes), :mod:`.identity` (the model identity and weights version scoped into chunk
keys), :mod:`.shards` (a chunk's tensor-parallel shards: one key each, held only when all are),
:mod:`.two_tier` (the host store composed with the tier), :mod:`.stacked` (a near store, the
disk tier, over the server: issue 31), and, so that a slow or dead server
never stalls vLLM's scheduler (issue 30): :mod:`.lookups` (EXISTS asked off the caller's
thread), :mod:`.lookup_book` (per request, the lookup asked and the bounded wait for it),
:mod:`.fetches` (fetches side by side, a late one a miss) and :mod:`.breaker` (a circuit
breaker that skips a server seen down). Needs the ``remote`` extra (redis-py).
"""

from __future__ import annotations

from hybridkv.remote.breaker import (
    BreakerConfig,
    BreakerCounts,
    BreakerState,
    CircuitBreaker,
    GuardedClient,
    Permit,
    breaker_counters,
)
from hybridkv.remote.client import ChunkClient, RedisClient, fault_of
from hybridkv.remote.cluster import ClusterClient, client_for
from hybridkv.remote.codec import (
    FORMAT_VERSION,
    MAGIC,
    Decoded,
    ValueFormat,
    chunk_key,
    decode_chunk,
    encode_chunk,
    make_chunk,
    redis_key,
)
from hybridkv.remote.config import RemoteConfig
from hybridkv.remote.fetches import LATE, FetchPool, Late
from hybridkv.remote.identity import EPOCH_BYTES, ModelIdentity, scoped_namespace
from hybridkv.remote.lookup_book import Consult, Consulted, LookupBook, LookupMode, LookupPolicy
from hybridkv.remote.lookups import Lookup, LookupCounts, LookupQueue
from hybridkv.remote.security import Credentials, FleetKey, Refusals, TlsFiles, read_secret
from hybridkv.remote.shards import (
    ShardPlan,
    combined_outcome,
    held_on_every_shard,
    held_per_chunk,
    shard_identity,
    shard_keys,
    shard_namespaces,
)
from hybridkv.remote.slots import SlotBuffer
from hybridkv.remote.stacked import STACK_COUNTER_NAMES, StackedClient
from hybridkv.remote.tier import RemoteTier
from hybridkv.remote.two_tier import Promotion, TwoTierStore
from hybridkv.remote.values import (
    AUTH_REFUSALS,
    REMOTE_COUNTER_NAMES,
    Admission,
    Chunk,
    ClientFault,
    Corruption,
    Fetched,
    PromoteOutcome,
    PromoteRefusal,
    WriteOutcome,
)

__all__ = [
    "AUTH_REFUSALS",
    "EPOCH_BYTES",
    "FORMAT_VERSION",
    "LATE",
    "MAGIC",
    "REMOTE_COUNTER_NAMES",
    "STACK_COUNTER_NAMES",
    "Admission",
    "BreakerConfig",
    "BreakerCounts",
    "BreakerState",
    "Chunk",
    "ChunkClient",
    "CircuitBreaker",
    "ClientFault",
    "ClusterClient",
    "Consult",
    "Consulted",
    "Corruption",
    "Credentials",
    "Decoded",
    "FetchPool",
    "Fetched",
    "FleetKey",
    "GuardedClient",
    "Late",
    "Lookup",
    "LookupBook",
    "LookupCounts",
    "LookupMode",
    "LookupPolicy",
    "LookupQueue",
    "ModelIdentity",
    "Permit",
    "PromoteOutcome",
    "PromoteRefusal",
    "Promotion",
    "RedisClient",
    "Refusals",
    "RemoteConfig",
    "RemoteTier",
    "ShardPlan",
    "SlotBuffer",
    "StackedClient",
    "TlsFiles",
    "TwoTierStore",
    "ValueFormat",
    "WriteOutcome",
    "breaker_counters",
    "chunk_key",
    "client_for",
    "combined_outcome",
    "decode_chunk",
    "encode_chunk",
    "fault_of",
    "held_on_every_shard",
    "held_per_chunk",
    "make_chunk",
    "read_secret",
    "redis_key",
    "scoped_namespace",
    "shard_identity",
    "shard_keys",
    "shard_namespaces",
]
