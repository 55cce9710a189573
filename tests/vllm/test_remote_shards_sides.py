"""The remote tier's two sides under tensor parallel 2 and 4 (issue 30 item 4), without vLLM's
scheduler and without a server: one scheduler side (:class:`SchedulerRemote` over a core) and
one :class:`WorkerRemote` per rank, each with its own host memory holding its own shard (bytes
salted by rank), an in-memory server between them, the orders and reports passed by hand as
the metadata carries them (every rank gets the same orders; the reports are concatenated, as
vLLM's aggregator folds the workers' metadata).

- Each rank SETs its own shard under its own key; engine B's ranks each fetch their own shard,
  byte-equal to A's same rank.
- A shard missing on one rank before the lookup: the chunk is a miss (never promoted), the claim
  ends before it. Missing between the lookup and that rank's fetch: the other ranks promote
  their shards, the promotion resolves MISSING only once every rank reported, its members are
  dropped, the claim ends before it: never a partial load.
- Replicated KV (``kv_tp_replicas`` = the TP size): one SET per chunk, by rank 0; with a shared
  host region only rank 0 fetches, without one every rank reads rank 0's shard.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))

import torch  # noqa: E402
from _fake_chunk_client import FakeClient  # noqa: E402
from small_core import mamba_full_core  # noqa: E402

from hybridkv.connector import (  # noqa: E402
    ClaimKind,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.hostmem import HostMemory, PinMode  # noqa: E402
from hybridkv.remote import (  # noqa: E402
    ModelIdentity,
    RemoteConfig,
    ShardPlan,
    redis_key,
    shard_keys,
)
from hybridkv.store import LookupResult  # noqa: E402
from hybridkv.vllm.remote import (  # noqa: E402
    FetchReport,
    RemoteOrders,
    SchedulerRemote,
    WorkerRemote,
)

TOKENS = tuple(range(1, 34))  # 33 tokens: 32 claimable, 8 chunks of 4
SLOT = 64
CONFIG = RemoteConfig(namespace=b"t")


def _identity(tp: int) -> ModelIdentity:
    return ModelIdentity("org/model", "", "torch.bfloat16/auto", "small", tp, 0)


def _view(rid: str) -> RequestView:
    return RequestView(RequestId(rid), TOKENS, len(TOKENS))


def _content(key: bytes, shard: int) -> bytes:
    """A rank's shard of a block: other bytes on every shard."""
    return (hashlib.sha256(key + bytes([shard])).digest() * (SLOT // 32))[:SLOT]


class TPEngine:
    """One engine: a scheduler side and ``plan.tp_size`` worker sides over one fake server;
    ranks of a group of replicas share one host region when ``plan.shared_host``."""

    def __init__(self, server: FakeClient, plan: ShardPlan) -> None:
        self.plan = plan
        self.core = mamba_full_core(64)
        identity = _identity(plan.tp_size)
        self.remote = SchedulerRemote(self.core, CONFIG, server, identity=identity, shards=plan)
        hosts: dict[int, HostMemory] = {}
        self.hosts = []
        for rank in range(plan.tp_size):
            group = plan.shard_of(rank) if plan.shared_host else rank
            self.hosts.append(hosts.setdefault(group, HostMemory(64 * SLOT, SLOT, PinMode.OFF)))
        self.workers = [
            WorkerRemote(
                CONFIG, self.hosts[r], client=server, background=False, rank=r, shards=plan
            )
            for r in range(plan.tp_size)
        ]

    def run(self, orders: RemoteOrders) -> tuple[FetchReport, ...]:
        """Every rank runs the same orders (writes flushed); their reports, concatenated."""
        reports: list[FetchReport] = []
        for worker in self.workers:
            reports.extend(worker.run(orders))
            worker.tier.write_pending()
        return tuple(reports)

    def step(self) -> None:
        orders = self.remote.orders()
        self.remote.fold(() if orders is None else self.run(orders))


def _serve_and_write(a: TPEngine) -> None:
    """A computes the 32 claimable tokens one chunk a step; each rank fills its own host slots
    with its shard's bytes (a store job), reported done, then the write orders run."""
    view = _view("a")
    table = tuple(tuple(1 + g * 100 + i for i in range(9)) for g in range(2))
    for step, start in enumerate(range(0, 32, 4), start=1):
        meta = a.core.build_connector_meta(
            StepView(step, (ScheduledRequest(view, table, start, 4),))
        )
        a.remote.stores_emitted(meta.store_jobs, {"a": view})
        (job,) = meta.store_jobs
        slots = a.core.store.slots([i.key for i in job.items])
        for rank, host in enumerate(a.hosts):
            for item, slot in zip(job.items, slots, strict=True):
                data = bytearray(_content(item.key, a.plan.shard_of(rank)))
                host.slot(slot).copy_(torch.frombuffer(data, dtype=torch.uint8))
        a.core.update_connector_output(
            KVConnectorOutput(completed_jobs=(JobResult(job.job_id, True),))
        )
        a.remote.store_reported(int(job.job_id), True)
        a.step()


def _b_holds_a_shards(b: TPEngine, view: RequestView, ends: range) -> None:
    for end in ends:
        members = b.core.chunk_members(view, end)
        for rank, host in enumerate(b.hosts):
            for key, slot in zip(members, b.core.store.slots(members), strict=True):
                assert bytes(host.slot(slot).numpy()) == _content(key, b.plan.shard_of(rank))


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_writes_and_fetches_its_own_shard(tp: int) -> None:
    server = FakeClient()
    a, b = TPEngine(server, ShardPlan(tp)), TPEngine(server, ShardPlan(tp))
    _serve_and_write(a)
    assert a.remote.count["writes_ordered"] == 8
    assert server.calls["set"] == len(server.data) == 8 * tp  # one key per rank per chunk
    for worker in a.workers:
        assert worker.counters()["remote_written"] == 8
    view = _view("b")
    b.remote.before_claim(view, 0)
    assert b.remote.count["remote_lookups"] == 1
    assert server.calls["exists"] == 1  # every shard of every chunk in one round trip
    assert b.remote.count["promotions_started"] == 8
    b.step()
    assert b.remote.count["promoted"] == 8
    assert [w.outcomes["promoted"] for w in b.workers] == [8] * tp
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 32)
    _b_holds_a_shards(b, view, range(4, 33, 4))


def _delete_shard(server: FakeClient, order_keys: tuple[bytes, ...], rank: int) -> None:
    del server.data[redis_key(order_keys[rank])]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_shard_missing_on_one_rank_before_the_lookup_is_a_miss(tp: int) -> None:
    server = FakeClient()
    a, b = TPEngine(server, ShardPlan(tp)), TPEngine(server, ShardPlan(tp))
    _serve_and_write(a)
    view = _view("b")
    members = b.core.chunk_members(view, 12)  # the third chunk
    keys = shard_keys(b.remote.namespaces, members)  # every rank's key of that chunk
    _delete_shard(server, keys, tp - 1)  # the last rank's shard only
    b.remote.before_claim(view, 0)
    assert b.remote.count["remote_chunks_found"] == 2  # the first two; the third is a miss
    assert b.remote.count["promotions_started"] == 2
    b.step()
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 8)  # ends before token 12
    assert all(b.core.store.status(k) is LookupResult.MISS for k in members)
    assert [w.count["remote_fetches"] for w in b.workers] == [2] * tp  # nothing else fetched


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gone_on", ["first", "last"])
def test_a_shard_gone_between_lookup_and_fetch_fails_the_chunk_on_every_rank(
    tp: int, gone_on: str
) -> None:
    server = FakeClient()
    a, b = TPEngine(server, ShardPlan(tp)), TPEngine(server, ShardPlan(tp))
    _serve_and_write(a)
    view = _view("b")
    b.remote.before_claim(view, 0)
    assert b.remote.count["promotions_started"] == 8
    orders = b.remote.orders()
    assert orders is not None
    third = orders.fetches[2]  # the chunk ending at token 12
    assert len(third.shard_keys) == tp
    rank = 0 if gone_on == "first" else tp - 1
    _delete_shard(server, third.shard_keys, rank)
    # The ranks report one by one: the promotion waits for every rank before it resolves.
    per_rank = [b.workers[r].run(orders) for r in range(tp)]
    for r in range(tp - 1):
        b.remote.fold(per_rank[r])
        assert b.remote.in_flight() == 8
        assert b.remote.count["promoted"] == 0
    b.remote.fold(per_rank[-1])
    assert b.remote.in_flight() == 0
    assert b.remote.count["missing"] == 1
    assert b.remote.count["promoted"] == 7
    assert b.workers[rank].outcomes["missing"] == 1
    assert [w.outcomes["promoted"] for w in b.workers].count(8) == tp - 1  # the others did
    members = b.core.chunk_members(view, 12)
    assert all(b.core.store.status(k) is LookupResult.MISS for k in members)  # dropped
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 8)  # ends before token 12
    _b_holds_a_shards(b, view, range(4, 9, 4))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("shared_host", [True, False])
def test_replicated_kv_is_written_once_and_read_by_every_rank(tp: int, shared_host: bool) -> None:
    server = FakeClient()
    plan = ShardPlan(tp, replicas=tp, shared_host=shared_host)
    a, b = TPEngine(server, plan), TPEngine(server, plan)
    _serve_and_write(a)
    assert a.remote.count["writes_ordered"] == 8
    assert server.calls["set"] == len(server.data) == 8  # once per chunk, not once per rank
    assert [w.counters()["remote_written"] for w in a.workers] == [8] + [0] * (tp - 1)
    view = _view("b")
    b.remote.before_claim(view, 0)
    b.step()
    assert b.remote.count["promoted"] == 8
    fetched = [w.count["remote_fetches"] for w in b.workers]
    # One shared region is filled by rank 0 alone; private memory by every rank.
    assert fetched == ([8] + [0] * (tp - 1) if shared_host else [8] * tp)
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 32)
    _b_holds_a_shards(b, view, range(4, 33, 4))


def test_engines_of_other_tp_sizes_share_no_chunk() -> None:
    server = FakeClient()
    _serve_and_write(TPEngine(server, ShardPlan(2)))
    for plan in (ShardPlan(1), ShardPlan(4), ShardPlan(2, 2, True)):
        other = TPEngine(server, plan)
        other.remote.before_claim(_view("b"), 0)
        assert other.remote.count["remote_chunks_found"] == 0
        assert other.remote.count["promotions_started"] == 0
