"""The two sides of the connector's remote tier (:mod:`hybridkv.vllm.remote`) without vLLM's
scheduler and without a server: a :class:`ConnectorCore` each, an in-memory server
(tests/remote/_fake_client.py) between them, the orders and reports passed by hand as the
connector metadata and worker metadata carry them.

- Engine A's store reports become write orders; its worker copies the host slots and SETs one
  chunk per prefix step; engine B's claim promotes them, its worker fetches and verifies them
  into B's own slots (byte-equal to A's), and B's claim then covers them.
- A promotion never reported resolves TIMEOUT after ``PROMOTION_DEADLINE_STEPS`` (no wedge); a
  late report is ignored. Each fetch fault (MISSING, FAULT, TIMEOUT, CORRUPT, a wrong length)
  drops the members and ends B's claim before the chunk; a lookup fault promotes nothing.
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

from _fake_chunk_client import FakeClient  # noqa: E402
from small_core import mamba_full_core  # noqa: E402

from hybridkv.connector import (  # noqa: E402
    ClaimKind,
    ConnectorCore,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.hostmem import HostMemory, PinMode  # noqa: E402
from hybridkv.kinds import GroupKind  # noqa: E402
from hybridkv.remote import (  # noqa: E402
    Admission,
    Chunk,
    ClientFault,
    ModelIdentity,
    RemoteConfig,
    redis_key,
)
from hybridkv.store import LookupResult  # noqa: E402
from hybridkv.vllm.remote import (  # noqa: E402
    PROMOTION_DEADLINE_STEPS,
    FetchOrder,
    FetchReport,
    RemoteOrders,
    SchedulerRemote,
    WorkerRemote,
)

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
TOKENS = tuple(range(1, 34))  # 33 tokens: 32 claimable, 8 units of 4 per group
SLOT = 64
CONFIG = RemoteConfig(namespace=b"t")
IDENTITY = ModelIdentity("org/model", "", "torch.bfloat16/auto", "small", 1, 0)


def _core() -> ConnectorCore:
    return mamba_full_core(64)


def _view(rid: str) -> RequestView:
    return RequestView(RequestId(rid), TOKENS, len(TOKENS))


def _content(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * (SLOT // 32))[:SLOT]


class Engine:
    """One engine's scheduler side and worker side over one fake server."""

    def __init__(self, server: FakeClient, identity: ModelIdentity = IDENTITY) -> None:
        self.core = _core()
        self.remote = SchedulerRemote(self.core, CONFIG, server, identity=identity)
        self.host = HostMemory(64 * SLOT, SLOT, PinMode.OFF)
        self.worker = WorkerRemote(CONFIG, self.host, client=server, background=False)

    def step(self, reports: tuple[FetchReport, ...] = ()) -> tuple[FetchReport, ...]:
        """Build the orders, run them on the worker (writes flushed), fold the reports."""
        orders = self.remote.orders()
        fetched = () if orders is None else self.worker.run(orders)
        self.worker.tier.write_pending()
        self.remote.fold((*reports, *fetched))
        return fetched


def _serve_and_write(a: Engine) -> None:
    """A computes the request's 32 claimable tokens one unit a step (as mamba align mode
    splits a prefill: each step ends where it writes a state, MB-8), each step's store job
    filled and reported done."""
    view = _view("a")
    table = tuple(tuple(1 + g * 100 + i for i in range(9)) for g in range(2))
    for step, start in enumerate(range(0, 32, 4), start=1):
        scheduled = ScheduledRequest(view, table, start, 4)
        meta = a.core.build_connector_meta(StepView(step, (scheduled,)))
        assert len(meta.store_jobs) == 1
        a.remote.stores_emitted(meta.store_jobs, {"a": view})
        job = meta.store_jobs[0]
        slots = a.core.store.slots([i.key for i in job.items])
        for item, slot in zip(job.items, slots, strict=True):
            a.host.slot(slot).copy_(bytes_tensor(_content(item.key)))
        done = KVConnectorOutput(completed_jobs=(JobResult(job.job_id, True),))
        a.core.update_connector_output(done)
        a.remote.store_reported(int(job.job_id), True)
        a.step()


def bytes_tensor(data: bytes):  # type: ignore[no-untyped-def]
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_b_promotes_what_a_wrote_byte_for_byte() -> None:
    server = FakeClient()
    a, b = Engine(server), Engine(server)
    _serve_and_write(a)
    assert a.remote.count["writes_ordered"] == 8  # one chunk per unit end: 4, 8, ..., 32
    assert a.worker.counters()["remote_written"] == 8
    assert len(server.data) == 8
    view = _view("b")
    b.remote.before_claim(view, 0)
    assert b.remote.count["promotions_started"] == 8
    assert b.core.get_num_new_matched_tokens(view, 0).kind is ClaimKind.DEFER
    b.step()
    assert b.remote.count["promoted"] == 8
    assert b.worker.outcomes["promoted"] == 8
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 32)
    for end in range(4, 33, 4):
        members = b.core.chunk_members(view, end)
        for key, slot in zip(members, b.core.store.slots(members), strict=True):
            assert bytes(b.host.slot(slot).numpy()) == _content(key)
    # Asked again with nothing changed: no second lookup.
    lookups = b.remote.count["remote_lookups"]
    b.remote.before_claim(view, 0)
    assert b.remote.count["remote_lookups"] == lookups


def test_an_unreported_promotion_times_out_and_a_late_report_is_ignored() -> None:
    server = FakeClient()
    a, b = Engine(server), Engine(server)
    _serve_and_write(a)
    view = _view("b")
    b.remote.before_claim(view, 0)
    orders = b.remote.orders()  # sent, never run: the report is lost
    assert orders is not None
    assert len(orders.fetches) == 8
    for _ in range(PROMOTION_DEADLINE_STEPS - 1):  # steps after the one that sent them
        b.step()
        assert b.remote.in_flight() == 8
    b.step()  # the deadline-th step after: resolved TIMEOUT
    assert b.remote.in_flight() == 0
    assert b.remote.count["promotion_deadlines"] == b.remote.count["timeout"] == 8
    assert b.core.promotions_in_flight() == 0
    assert b.core.store.stats().storing == 0
    b.step((FetchReport(orders.fetches[0].chunk_key, "promoted"),))
    assert b.remote.count["late_reports"] == 1
    assert b.core.get_num_new_matched_tokens(view, 0).kind is ClaimKind.NONE
    # Failed chunks are remembered: the same request never promotes them again.
    b.remote.before_claim(view, 0)
    assert b.remote.count["promotions_started"] == 8


@pytest.mark.parametrize(
    "field",
    ["model", "revision", "dtype", "layout", "tp_size"],
)
def test_another_model_identity_finds_none_of_the_chunks(field: str) -> None:
    """Equal prompts give equal member keys (vLLM's block hashes know no model): only the
    identity scoped into the chunk key keeps another model's engine from A's chunks."""
    server = FakeClient()
    a = Engine(server)
    _serve_and_write(a)
    other = {"model": "org/other", "revision": "v2", "dtype": "torch.float16/auto"}
    other |= {"layout": "wide", "tp_size": 2}
    fields = {f: getattr(IDENTITY, f) for f in IDENTITY.__slots__}  # type: ignore[attr-defined]
    b = Engine(server, ModelIdentity(**{**fields, field: other[field]}))
    view = _view("b")
    assert b.core.chunk_members(view, 32) == a.core.chunk_members(view, 32)
    b.remote.before_claim(view, 0)
    assert b.remote.count["remote_lookups"] == 1
    assert b.remote.count["remote_chunks_found"] == 0
    assert b.remote.count["promotions_started"] == 0
    assert b.core.get_num_new_matched_tokens(view, 0).kind is ClaimKind.NONE


def test_after_a_reset_no_chunk_written_before_it_is_asked_for() -> None:
    """The weights version moves on a reset: A's own chunks, and a replica's that has not
    reset, are out of reach; after it A writes a namespace of its own, which no replica reads,
    whether it reset as often or not (issue 28: a reset may be a sleep or a training step, so
    equal reset counts do not mean equal weights). A replica that never reset still reads what
    A wrote before its reset (both on the checkpoint's weights)."""
    server = FakeClient()
    a = Engine(server)
    _serve_and_write(a)
    before = a.remote.namespace
    a.remote.reset()
    assert a.remote.weights_version == 1
    assert a.remote.namespace != before
    a.core.reset_cache()
    view = _view("again")
    a.remote.before_claim(view, 0)
    assert a.remote.count["remote_lookups"] == 1
    assert a.remote.count["remote_chunks_found"] == 0
    assert a.core.get_num_new_matched_tokens(view, 0).kind is ClaimKind.NONE
    _serve_and_write(a)  # the new weights' chunks, under version 1 in A's own epoch
    assert a.remote.epoch
    replica = Engine(server)
    replica.remote.reset()  # one reset too: perhaps a sleep, on the old weights
    assert replica.remote.weights_version == a.remote.weights_version == 1
    assert replica.remote.namespace != a.remote.namespace
    replica.remote.before_claim(_view("r"), 0)
    assert replica.remote.count["remote_chunks_found"] == 0
    assert replica.remote.count["promotions_started"] == 0
    fresh = Engine(server)  # never reset: the checkpoint's weights, like A before its reset
    assert fresh.remote.namespace == before


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        ("missing", "missing"),
        (ClientFault.FAULT, "fault"),
        (ClientFault.TIMEOUT, "timeout"),
        ("garbage", "corrupt"),
        ("short", "corrupt"),
    ],
)
def test_a_failed_fetch_ends_the_claim_before_its_chunk(fault: object, outcome: str) -> None:
    server = FakeClient()
    a, b = Engine(server), Engine(server)
    _serve_and_write(a)
    view = _view("b")
    b.remote.before_claim(view, 0)
    orders = b.remote.orders()
    assert orders is not None
    third = redis_key(orders.fetches[2].chunk_key)  # the chunk ending at token 12
    if fault == "missing":
        del server.data[third]
    elif fault == "garbage":
        server.data[third] = server.data[third][:-1] + b"\x00"
    elif fault == "short":  # a well-formed chunk of the right members, payloads too short
        from hybridkv.remote import encode_chunk

        server.data[third] = encode_chunk(orders.fetches[2].members, [b"x", b"y"])
    reports = []
    for i, order in enumerate(orders.fetches):
        if i == 2 and isinstance(fault, ClientFault):
            server.fail_next["get"] = fault
        reports.extend(b.worker.run(type(orders)((), (order,))))
    b.remote.fold(reports)
    assert b.remote.count[outcome] == 1
    assert b.remote.count["promoted"] == 7
    members = b.core.chunk_members(view, 12)
    assert all(b.core.store.status(k) is LookupResult.MISS for k in members)
    claim = b.core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 8)  # ends before token 12


def test_a_worker_that_finds_its_own_chunk_gone_writes_it_again() -> None:
    # The server lost a chunk A wrote (TTL, eviction, flush); A's worker sees it MISSING on a
    # fetch and forgets it, so the next write order of that chunk is queued, not KNOWN.
    server = FakeClient()
    a = Engine(server)
    _serve_and_write(a)
    ((key_hex, members_hex), *_) = a.worker.tier.snapshot()["remote"]
    key, members = bytes.fromhex(key_hex), tuple(bytes.fromhex(m) for m in members_hex)
    slots = a.core.store.slots(members)
    write = FetchOrder(key, members, slots, (key,))
    assert a.worker.tier.write_behind(Chunk(key, members), [b"z"]) is Admission.KNOWN
    del server.data[redis_key(key)]
    (report,) = a.worker.run(RemoteOrders((), (FetchOrder(key, members, slots, (key,)),)))
    assert report.outcome == "missing"
    assert key_hex not in {k for k, _ in a.worker.tier.snapshot()["remote"]}
    enqueued = a.worker.counters()["remote_writes_enqueued"]
    a.worker.run(RemoteOrders((write,), ()))
    assert a.worker.counters()["remote_writes_enqueued"] == enqueued + 1
    assert a.worker.tier.write_pending() == 1
    assert redis_key(key) in server.data


def test_a_lookup_fault_promotes_nothing() -> None:
    server = FakeClient()
    a, b = Engine(server), Engine(server)
    _serve_and_write(a)
    server.fail_next["exists"] = ClientFault.TIMEOUT
    b.remote.before_claim(_view("b"), 0)
    assert b.remote.count["remote_lookup_faults"] == 1
    assert b.remote.count["promotions_started"] == 0
    assert b.core.store.stats().reserved == 0


def test_orders_and_reports_cross_processes_by_pickle() -> None:
    """vLLM pickles the metadata to the workers and the worker metadata back."""
    import pickle

    from hybridkv.vllm.connector import HybridKVWorkerMeta

    server = FakeClient()
    a, b = Engine(server), Engine(server)
    _serve_and_write(a)
    b.remote.before_claim(_view("b"), 0)
    orders = b.remote.orders()
    assert orders is not None
    assert pickle.loads(pickle.dumps(orders)) == orders
    meta = HybridKVWorkerMeta((), b.worker.run(orders))
    back = pickle.loads(pickle.dumps(meta))
    assert back.fetches == meta.fetches
    assert len(back.fetches) == 8
    merged = meta.aggregate(HybridKVWorkerMeta())
    assert isinstance(merged, HybridKVWorkerMeta)
    assert merged.fetches == meta.fetches
