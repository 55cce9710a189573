"""hybridkv's load admission rule (:mod:`hybridkv.vllm.admission`) agrees with the spec's
(:mod:`spec.connector.admission`) on every async claim of random sequences.

Each sequence draws a layout (full, sliding and mamba groups), a pool, a step budget and a few
requests over two prompt families (equal block hashes within a family: shared prefixes), then
plays claims, vLLM admitting the load (WAITING_FOR_REMOTE_KVS), landings (WAITING with the
loaded tokens computed), runs and finishes. Both rules see the same requests: hybridkv's reads
vLLM-like request objects and keeps its own record of the requests it admitted; the spec's is
handed the loads those requests hold (``HeldLoad``) and each request's need from
:func:`spec.connector.admission.blocks_to_run`. Their answers must be equal, DEFER's reason
included.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.request", reason="vLLM 0.33 is not installed")

from vllm.v1.request import RequestStatus  # noqa: E402

from hybridkv.kinds import GroupKind as HKind  # noqa: E402
from hybridkv.vllm.admission import GroupNeed, LoadAdmission  # noqa: E402
from spec.connector.admission import (  # noqa: E402
    Admission,
    AsyncClaim,
    GroupHold,
    HeldLoad,
    admit,
    blocks_to_run,
)
from spec.kinds import GroupKind  # noqa: E402

H = 16  # tokens per block hash
# Admitted, not run since: loading, or landed and waiting to run.
_HOLDING = (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)


@dataclass
class _Request:
    """The fields of vLLM's ``Request`` the rule reads."""

    request_id: str
    num_tokens: int
    block_hashes: list[bytes]
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    claim_start: int = 0
    claimed: bool = field(default=False)


def _groups(rng: random.Random) -> tuple[tuple[GroupHold, ...], tuple[GroupNeed, ...]]:
    holds = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(list(GroupKind))
        block = H * rng.choice((1, 2, 4))
        reach = rng.choice((31, 63, 127)) if kind is GroupKind.SLIDING else 0
        states = rng.choice((2, 3)) if kind is GroupKind.MAMBA else 0
        holds.append(GroupHold(kind, block, reach, states))
    needs = tuple(GroupNeed(HKind(h.kind.value), h.block_size, h.reach, h.states) for h in holds)
    return tuple(holds), needs


def _play(seed: int) -> tuple[int, int]:
    """Play sequence ``seed``; the DEFER answers for a shared load and for room."""
    rng = random.Random(seed)
    holds, needs = _groups(rng)
    chunk = rng.choice((32, 64, 256))
    families = [[rng.randbytes(8) for _ in range(40)] for _ in range(2)]
    requests = []
    for i in range(rng.randint(2, 5)):
        n = rng.randint(2, 30) * H + rng.randint(0, H - 1)
        requests.append(_Request(f"r{i}", n, rng.choice(families)[: n // H]))
    need = lambda r, at: blocks_to_run(holds, r.num_tokens, at, chunk)  # noqa: E731
    capacity = max(need(r, 0) for r in requests) + rng.randint(0, 60)
    rule = LoadAdmission(needs, H, capacity, chunk)
    for _ in range(40):
        r = rng.choice(requests)
        if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0:
            start = rng.randint(0, (r.num_tokens - 1) // H) * H
            tokens = rng.randint(1, max(1, (r.num_tokens - start) // H)) * H
            tokens = min(tokens, r.num_tokens - start)
            held = [
                HeldLoad(
                    o.request_id,
                    o.status is RequestStatus.WAITING_FOR_REMOTE_KVS,
                    o.claim_start,
                    o.num_computed_tokens,
                    need(o, o.num_computed_tokens),
                    tuple(o.block_hashes),
                )
                for o in requests
                if o.claimed and o is not r and o.num_computed_tokens and o.status in _HOLDING
            ]
            claim = AsyncClaim(
                r.request_id, start, start + tokens, need(r, start + tokens), tuple(r.block_hashes)
            )
            expected = admit(claim, held, capacity, H)
            before = (rule.shared, rule.room)
            got = rule.defers(r, start, tokens)
            reason = {
                (before[0] + 1, before[1]): Admission.DEFER_SHARED,
                (before[0], before[1] + 1): Admission.DEFER_ROOM,
                before: Admission.ADMIT,
            }[(rule.shared, rule.room)]
            assert got is expected.defers, (seed, expected, claim, held)
            assert reason is expected, (seed, reason, expected)
            if not got:
                r.claimed, r.claim_start = True, start
                if rng.random() < 0.8:  # vLLM admits the load (else: no room, it waits)
                    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    r.num_computed_tokens = start + tokens
        elif r.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            r.status = RequestStatus.WAITING  # the load landed; it holds its blocks
        elif r.status is RequestStatus.WAITING:
            r.status = RequestStatus.RUNNING
        elif r.status is RequestStatus.RUNNING:
            r.status = rng.choice((RequestStatus.FINISHED_STOPPED, RequestStatus.PREEMPTED))
            if r.status is RequestStatus.FINISHED_STOPPED:
                rule.finished(r.request_id)
            r.claimed = False  # neither rule counts it once it ran
        elif r.status is RequestStatus.PREEMPTED:
            r.status, r.num_computed_tokens = RequestStatus.WAITING, 0
    return rule.shared, rule.room


def test_hybridkv_and_the_spec_answer_every_claim_alike() -> None:
    shared = room = 0
    for seed in range(200):
        s, r = _play(seed)
        shared, room = shared + s, room + r
    # Both reasons to defer were met, not only admissions.
    assert shared > 20
    assert room > 20
