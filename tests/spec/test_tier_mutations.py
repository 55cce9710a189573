"""Mutation evidence for TT-*: each test breaks one part of the two-tier model on purpose,
runs :func:`spec.explorer.explore` over :class:`spec.tiers.model.TierModel` (every TT-* and
ST-* invariant checked in every state) and asserts the shortest trace that names the id.

tests/test_mutation_evidence.py reads this file beside test_explorer_mutations.py, and
docs/explanation/mutations.md tabulates the same depths and traces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import pytest
import tiers_harness
from tiers_harness import CONTROLS, EMPTY, SHARED

from spec.explorer import explore
from spec.store import HostStore
from spec.tiers import two_tier
from spec.tiers.chunk import ChunkValue, Verdict, encode
from spec.tiers.model import TierModel, TierScenario
from spec.tiers.two_tier import Injection, PromotionStarted, Resolved, TwoTierStore, _Promotion

_complete_promotion = TwoTierStore.complete_promotion
_write_behind = TwoTierStore.write_behind


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_correct_model_breaks_nothing(name: str) -> None:
    scenario, depth = CONTROLS[name]
    result = explore(TierModel(scenario), depth, stop_at_first=False)
    assert result.violations == ()
    assert result.states > 1000


def _vanish_one_member(self: TwoTierStore, chunk_key: bytes) -> bool:
    value = self.remote.get(chunk_key)
    if value is None:
        return False
    # One server key per member: maxmemory drops them one at a time.
    half = replace(
        value, members=value.members[:1], lengths=value.lengths[:1], payloads=value.payloads[:1]
    )
    self.remote.put(chunk_key, half)
    return True


@pytest.mark.mutation("TT-1")
def test_tt1_members_vanish_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk kept as one server key per member: the server drops one member and the rest of
    the chunk stays readable."""
    monkeypatch.setattr(TwoTierStore, "vanish", _vanish_one_member)
    found = tiers_harness.caught("TT-1", SHARED, 2)
    assert found.trace == "claim s0 | vanish s0@1"
    assert found.messages[0].startswith("remote chunk ")
    assert "lacks members" in found.messages[0]


@pytest.mark.mutation("TT-2")
def test_tt2_reader_skips_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader trusts what GET returns: a flipped byte on the wire is loaded."""
    monkeypatch.setattr(two_tier, "verify", lambda value, expected: Verdict.PROMOTED)
    found = tiers_harness.caught("TT-2", SHARED, 2)
    assert found.trace == "claim s0 | fetch s0@1 corrupted"
    assert found.messages[0].endswith("holds '~~~~~~', not 's0|1|0'")


def _promote_unreserved(self: TwoTierStore, members: Sequence[bytes]) -> object:
    key = self.chunk_key(members)
    if key in self._promotions:
        return two_tier.PromoteRefusal.IN_FLIGHT
    checked = tuple(members)
    self._promotions[key] = _Promotion(checked, checked)  # the host is never asked
    self._counters["promotions_started"] += 1
    return PromotionStarted(key, checked, ())


@pytest.mark.mutation("TT-3")
def test_tt3_promotion_without_a_host_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch targets slots the host tier never reserved: nothing stops an eviction or a
    second writer from taking them."""
    monkeypatch.setattr(TwoTierStore, "promote", _promote_unreserved)
    found = tiers_harness.caught("TT-3", SHARED, 1)
    assert found.trace == "claim s0"
    assert all(m.endswith("is absent, not storing") for m in found.messages)


def _complete_promotion_abandoning(
    self: TwoTierStore, chunk_key: bytes, injection: Injection
) -> Resolved:
    if injection is Injection.NONE and self.remote.get(chunk_key) is not None:
        return _complete_promotion(self, chunk_key, injection)
    promotion = self._promotions.pop(chunk_key)  # retired, its reservation never dropped
    self._failed.add(chunk_key)
    self._counters["fault"] += 1
    return Resolved(chunk_key, two_tier.Resolution.FAULT, promotion.reserved, ())


@pytest.mark.mutation("TT-3")
def test_tt3_failed_promotion_abandons_its_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed promotion is retired but its STORING entries are never dropped: they belong
    to no operation (the half of TT-3 the model checks, knowing its GPU store jobs) and hold
    host slots for ever. TT-5 names the kept members in the same state."""
    monkeypatch.setattr(TwoTierStore, "complete_promotion", _complete_promotion_abandoning)
    found = tiers_harness.caught("TT-3", SHARED, 2)
    assert found.trace == "claim s0 | fetch s0@1 faults"
    assert all(m.endswith("owned by no operation") for m in found.messages)
    assert found.ids == ("TT-3", "TT-5")


def _complete_promotion_kept(
    self: TwoTierStore, chunk_key: bytes, injection: Injection
) -> Resolved:
    promotion = self._promotions[chunk_key]
    done = _complete_promotion(self, chunk_key, injection)
    if done.loaded == ():
        self._promotions[chunk_key] = promotion  # the failure path forgets to retire it
    return done


@pytest.mark.mutation("TT-4")
def test_tt4_failed_promotion_left_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A promotion that fails stays listed in flight: the request waiting on it never ends."""
    monkeypatch.setattr(TwoTierStore, "complete_promotion", _complete_promotion_kept)
    found = tiers_harness.caught("TT-4", SHARED, 2)
    assert found.trace == "claim s0 | fetch s0@1 faults"
    assert found.messages[0].startswith("resolved promotion ")


def _complete_promotion_forgetful(
    self: TwoTierStore, chunk_key: bytes, injection: Injection
) -> Resolved:
    done = _complete_promotion(self, chunk_key, injection)
    if done.resolution is two_tier.Resolution.MISSING:
        self._failed.discard(chunk_key)  # a vanished chunk is not remembered
    return done


@pytest.mark.mutation("TT-5")
def test_tt5_vanished_chunk_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that vanished between lookup and fetch is not remembered as failed: the next
    claim counts it again, and the scheduler does not recompute what is missing."""
    monkeypatch.setattr(TwoTierStore, "complete_promotion", _complete_promotion_forgetful)
    found = tiers_harness.caught("TT-5", SHARED, 3)
    assert found.trace == "claim s0 | vanish s0@1 | fetch s0@1"
    assert found.messages[0].endswith("is not a remembered miss")


def _positional_chunk_key(namespace: bytes, members: Sequence[bytes]) -> bytes:
    # The token position's groups, not the content keys: the salt is lost.
    return hashlib.sha256(namespace + b"".join(key[8:] for key in members)).digest()


def _verify_count(value: ChunkValue, expected: Sequence[bytes]) -> Verdict:
    ok = len(value.members) == len(expected)
    return Verdict.PROMOTED if ok else Verdict.CORRUPT


@pytest.mark.mutation("TT-6")
def test_tt6_chunk_key_without_the_content_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk key hashes the groups, not the member keys, and the reader checks only the
    member count: tenant s1 loads what tenant s0 wrote. The keys of every chunk collide, so
    the trace names the fetched chunk by the first chunk of that key (s0@1). TT-1 sees the
    foreign members a level earlier; the search goes on to the load."""
    monkeypatch.setattr(two_tier, "chunk_key", _positional_chunk_key)
    monkeypatch.setattr(two_tier, "verify", _verify_count)
    found = tiers_harness.caught("TT-6", SHARED, 2, every_level=True)
    assert found.trace == "claim s1 | fetch s0@1"
    assert found.messages == (found.messages[0],)
    assert found.messages[0].endswith("under salt 's1' loaded content of ['s0']")


def _queued_by_reference(self: TwoTierStore, chunk_key: bytes) -> ChunkValue:
    members = self._writes[chunk_key].members
    # Reads the host slots at SET time instead of the copy taken at enqueue.
    return encode(members, tuple(self._slots.get(key, "freed") for key in members))


@pytest.mark.mutation("TT-7")
def test_tt7_write_reads_the_host_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queued write holds references to host slots, not a copy: evicting the entries
    changes what the server will store."""
    monkeypatch.setattr(TwoTierStore, "_queued", _queued_by_reference)
    found = tiers_harness.caught("TT-7", EMPTY, 3)
    assert found.trace == "store s0@1 | store s0@1 completes | evict s0@1"
    key = TwoTierStore(HostStore(4)).chunk_key(EMPTY.members("s0", 1)).hex()
    assert found.messages == (f"writes chunk {key} carries ('freed', 'freed')",)


def _write_behind_counting_drops(self: TwoTierStore, members: Sequence[bytes]) -> object:
    outcome = _write_behind(self, members)
    if outcome is two_tier.WriteOutcome.DROPPED:
        self._counters["writes_enqueued"] += 1  # a drop counted as a write too
    return outcome


@pytest.mark.mutation("TT-8")
def test_tt8_dropped_write_counted_as_enqueued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the full queue drops is also counted enqueued: the ledger no longer adds up."""
    monkeypatch.setattr(TwoTierStore, "write_behind", _write_behind_counting_drops)
    found = tiers_harness.caught("TT-8", TierScenario(), 4)
    assert found.trace == ("store s0@1 | store s0@1 completes | store s0@2 | store s0@2 completes")
    assert found.messages == ("writes_enqueued 2 != landed+failed+queued 1",)
