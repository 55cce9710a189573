"""The remote tier inside :class:`~hybridkv.vllm.connector.HybridKVConnector` (issue 12): two
vLLM engines, each with its own host tier, share one Redis/Valkey server under the CPU tier.

vLLM runs the scheduler and the workers in separate processes, so the two sides share no
Python object: each side opens its own connection to the server, and everything else crosses
in the connector metadata (scheduler -> worker, :class:`RemoteOrders`) and the worker metadata
(worker -> scheduler, :class:`FetchReport` in ``HybridKVWorkerMeta.fetches``).

One idea per module: :mod:`.orders` (what the two sides exchange), :mod:`.scheduler`
(:class:`SchedulerRemote`: lookups, promotions, write orders), :mod:`.worker`
(:class:`WorkerRemote`: writes and verified fetches), :mod:`.settings` (the parsed keys as the
library's configs, the hash refusal) and :mod:`.identity` (the model identity and the TP shards
that scope every chunk key). Every name is importable from this package as before the split.

Chunks. A chunk is one prefix step: the host keys of every group's unit that ends at the same
token ``end`` (attention blocks of full and sliding groups and the mamba state ending there),
in group order (:meth:`hybridkv.connector.ConnectorCore.chunk_members`). vLLM keeps a mamba
state only at the end of each scheduled step, so a host often holds the attention units ending
at ``end`` without the state there; such a step is written as its attention-only variant (the
same rule without the mamba members: other members, so another chunk key), and a reader asks
for the whole chunk first, then that variant (a claim may pass an end without its state, never
end there). Each variant is still written and read whole. The chunk key is the
contract's chunk key over those host keys (:func:`hybridkv.remote.chunk_key`) under
``remote_namespace`` scoped by the model identity and the weights version
(:func:`hybridkv.remote.scoped_namespace`, :func:`model_identity`): model name or path,
revision, dtypes, a fingerprint of the KV cache layout, TP size and rank, a digest of vLLM's
own config hashes and the model's config, and after a connector reset the engine's own epoch.
Member keys come from vLLM's block hashes, which know nothing of the model, so without the
scope two deployments of different models with equal geometry would read each other's KV; with
it they never share a key. A reset may or may not come with new weights (a sleep, a training
step), so after one the engine reads and writes a namespace no other engine uses, failing
closed (:meth:`SchedulerRemote.reset`, :mod:`hybridkv.remote.identity`). The cache salt and
vLLM's extra keys, already chained into the host keys, separate tenants by content addressing
alone (TT-6). Each member travels as its whole host slot (``slot_bytes``, the largest group's
block), so every group's layout in the slot is carried as is.

Write-behind (:class:`SchedulerRemote.store_reported`): when a store job reports success, each
chunk it touched whose members are all READY in the host becomes a write order. Orders are
re-checked (every member still READY, slots read afresh) when the next metadata is built, after
the core reserved that step's stores, so no order names a slot that step's stores or
promotions reuse. The worker (:class:`WorkerRemote`) copies the members' slot bytes at the
start of its step, before it writes any slot (fetches, then the step's stores in
``wait_for_save``), and queues one SET on :class:`hybridkv.remote.RemoteTier`'s background
writer: bounded, never blocking (a full queue drops the write, counted).

Read-through (:class:`SchedulerRemote.before_claim`): before the core answers a claim, the
chunks ending in ``(num_computed_tokens, claimable end]`` whose members are all absent from the
host are asked of the server (one pipelined EXISTS over every end's variants, bounded by
``remote_timeout_ms``; a fault answers none present). The EXISTS never runs on the scheduler
thread (issue 30): it is queued to the lookup threads (:class:`hybridkv.remote.LookupBook`),
and until its answer is in the request waits (vLLM's None) for at most
``remote_lookup_wait_ms`` and 16 steps in all, then goes on without the remote hit; an answer,
once in, is the request's answer for every chunk it covers. A circuit breaker on each side
(:mod:`hybridkv.remote.breaker`) skips a server seen down: lookups answer no hit at once,
fetches resolve FAULT at once, writes are dropped, until a probe after the backoff succeeds.
In prefix order, the ends the server holds up to the first it lacks are promoted (per end, the
whole chunk if present, else the attention-only one): their members are reserved STORING
through the core (:meth:`~hybridkv.connector.ConnectorCore.reserve_promotion`), so the claim
DEFERs on them like on any STORING key, and the next metadata orders the fetch.
The worker GETs each chunk (bounded by the same timeout), verifies it against the expected
members (:func:`hybridkv.remote.decode_chunk`: magic, version, member keys, lengths, digest
or, with a fleet key, the MAC or AES-GCM tag over the key the value is stored under (this
rank's shard key) and the value, and each payload exactly one slot), writes the payloads into
the reserved slots and reports the outcome: PROMOTED (members READY) or MISSING / FAULT /
TIMEOUT / CORRUPT (members dropped; the chunk is remembered failed, so the claim ends before it
and vLLM recomputes exactly what is missing). A step's fetches run side by side on a few threads
inside ``start_load_kv`` (:class:`hybridkv.remote.FetchPool`); a result past the deadline is
TIMEOUT, and the bytes of those in time are copied into their slots on the worker's thread
before it reports, so a report never precedes its writes and a late fetch writes nothing.

Termination (TT-4): a promotion not reported within ``PROMOTION_DEADLINE_STEPS`` engine steps
(it cannot be, with vLLM's in-order outputs; the bound guards against a lost report) resolves
TIMEOUT and its members are dropped; a late report of it is ignored (counted). Each chunk is
promoted at most once per request, so read-through cannot loop evicting what it promoted.
Failed chunks are remembered (at most ``FAILED_MEMORY`` of them, oldest forgotten first).

Tensor parallelism (:mod:`hybridkv.remote.shards`): each rank holds its own shard of every
chunk, so a chunk is one server value per shard, each under its own key (the namespace scoped
by an identity naming the shard's rank and the TP size). Orders carry every shard's key
(``FetchOrder.shard_keys``); each rank's worker writes and fetches only its own. A lookup asks
every shard's key in the same pipelined EXISTS and counts a chunk only if all are there, so a
shard missing on one rank is a miss. A promotion resolves once every fetching rank reported it
(vLLM's aggregator hands the scheduler every rank's worker metadata), PROMOTED only if each
rank promoted its shard; a shard gone between the lookup and one rank's fetch fails the
promotion, its members are dropped on every rank, and the claim ends before the chunk, before
vLLM ever counted it: never a partial load. Replicated KV (MLA, ``kv_tp_replicas``) is one
shard per group of replicas, written by the group's first rank only.

Not built: writes on host eviction (writes happen on store).
"""

from __future__ import annotations

# Every name importable here before the split stays so (`X as X`: module constants that are
# not public names).
from hybridkv.vllm.remote.identity import config_digest, model_identity, remote_shards
from hybridkv.vllm.remote.orders import FetchOrder, FetchReport, RemoteOrders
from hybridkv.vllm.remote.scheduler import FAILED_MEMORY, PROMOTION_DEADLINE_STEPS, SchedulerRemote
from hybridkv.vllm.remote.scheduler import SCHEDULER_COUNTERS as SCHEDULER_COUNTERS
from hybridkv.vllm.remote.settings import (
    DEFAULT_BREAKER,
    DEFAULT_LOOKUPS,
    breaker_config,
    lookup_policy,
    refuse_unshared_hashes,
    remote_config,
)
from hybridkv.vllm.remote.worker import FETCH_WORKERS as FETCH_WORKERS
from hybridkv.vllm.remote.worker import WORKER_COUNTERS as WORKER_COUNTERS
from hybridkv.vllm.remote.worker import WorkerRemote

__all__ = [
    "DEFAULT_BREAKER",
    "DEFAULT_LOOKUPS",
    "FAILED_MEMORY",
    "PROMOTION_DEADLINE_STEPS",
    "FetchOrder",
    "FetchReport",
    "RemoteOrders",
    "SchedulerRemote",
    "WorkerRemote",
    "breaker_config",
    "config_digest",
    "lookup_policy",
    "model_identity",
    "refuse_unshared_hashes",
    "remote_config",
    "remote_shards",
]
