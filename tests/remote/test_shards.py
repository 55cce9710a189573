"""A chunk's tensor-parallel shards on the shared tier (issue 30 item 4,
:mod:`hybridkv.remote.shards`): one key per shard naming its rank and the TP size, the TP 1 key
unchanged, one shard per group of replicas written by its first rank, the all-ranks rule over
one pipelined EXISTS, and a promotion's outcome over its ranks."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fake_chunk_client import FakeClient

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    ClientFault,
    ModelIdentity,
    PromoteOutcome,
    ShardPlan,
    chunk_key,
    combined_outcome,
    held_on_every_shard,
    redis_key,
    scoped_namespace,
    shard_keys,
    shard_namespaces,
)

MEMBERS = (b"k1", b"k2")


def _identity(tp: int) -> ModelIdentity:
    return ModelIdentity("org/model", "", "torch.bfloat16/auto", "hash=16;full:16", tp, 0)


def test_at_tp_1_the_one_shard_is_the_key_of_before() -> None:
    (namespace,) = shard_namespaces(b"prod", _identity(1), ShardPlan(), 0)
    assert namespace == scoped_namespace(b"prod", _identity(1), 0)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_has_its_own_key_and_another_tp_size_shares_none(tp: int) -> None:
    spaces = shard_namespaces(b"prod", _identity(tp), ShardPlan(tp), 3, b"e" * 16)
    keys = shard_keys(spaces, MEMBERS)
    assert len(set(keys)) == tp
    for rank, key in enumerate(keys):  # the key names the rank (the identity's tp_rank)
        named = dataclasses.replace(_identity(tp), tp_rank=rank)
        assert key == chunk_key(scoped_namespace(b"prod", named, 3, b"e" * 16), MEMBERS)
    other = shard_keys(shard_namespaces(b"prod", _identity(2 * tp), ShardPlan(2 * tp), 3), MEMBERS)
    assert not set(keys) & set(other)
    assert not set(keys) & set(
        shard_keys(shard_namespaces(b"prod", _identity(1), ShardPlan(), 3), MEMBERS)
    )


@pytest.mark.parametrize(
    ("plan", "shards", "writers", "fetchers"),
    [
        (ShardPlan(2, 1, False), 2, [0, 1], [0, 1]),
        (ShardPlan(4, 1, False), 4, [0, 1, 2, 3], [0, 1, 2, 3]),
        (ShardPlan(2, 2, True), 1, [0], [0]),
        (ShardPlan(4, 2, True), 2, [0, 2], [0, 2]),
        # Replicas on several machines: each rank its own host copy, so each fetches.
        (ShardPlan(4, 4, False), 1, [0], [0, 1, 2, 3]),
    ],
)
def test_replicated_kv_is_one_shard_per_group_written_by_its_first_rank(
    plan: ShardPlan, shards: int, writers: list[int], fetchers: list[int]
) -> None:
    tp, replicas = plan.tp_size, plan.replicas
    assert plan.shards == shards
    assert [r for r in range(tp) if plan.writes(r)] == writers
    assert [r for r in range(tp) if plan.fetches(r)] == fetchers
    assert plan.fetchers == len(fetchers)
    # Every rank of a group reads the shard its first rank wrote, named by that rank.
    assert [plan.shard_of(r) for r in range(tp)] == [r // replicas for r in range(tp)]
    assert [plan.owner(plan.shard_of(r)) for r in range(tp)] == [
        r - r % replicas for r in range(tp)
    ]
    assert len(shard_namespaces(b"p", _identity(tp), plan, 0)) == shards


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": True}, "tp_size"),
        ({"tp_size": 4, "replicas": 3}, "replicas"),
        ({"tp_size": 2, "replicas": 0}, "replicas"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        ShardPlan(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_an_identity_of_another_tp_size_is_refused() -> None:
    with pytest.raises(HybridKVConfigError, match="identity"):
        shard_namespaces(b"p", _identity(2), ShardPlan(4), 0)


def test_a_chunk_is_held_only_if_every_shard_is_in_one_round_trip() -> None:
    server = FakeClient()
    chunks = [(b"a0", b"a1"), (b"b0", b"b1"), (b"c0", b"c1")]
    for key in (b"a0", b"a1", b"b0", b"c1"):  # b's rank 1 shard and c's rank 0 shard missing
        server.data[redis_key(key)] = b"v"
    assert held_on_every_shard(server, chunks) == (True, False, False)
    assert server.calls["exists"] == 1
    server.fail_next["exists"] = ClientFault.TIMEOUT
    assert held_on_every_shard(server, chunks) is ClientFault.TIMEOUT


def test_a_promotion_is_promoted_only_if_every_rank_promoted_its_shard() -> None:
    P, M = PromoteOutcome.PROMOTED, PromoteOutcome.MISSING
    assert combined_outcome([P, P, P]) is P
    assert combined_outcome([P, M, P]) is M
    assert combined_outcome([M, PromoteOutcome.FAULT]) is PromoteOutcome.FAULT
    assert combined_outcome([PromoteOutcome.TIMEOUT, PromoteOutcome.CORRUPT]) is (
        PromoteOutcome.CORRUPT
    )
    with pytest.raises(HybridKVConfigError):
        combined_outcome([])
