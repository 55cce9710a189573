"""The host store over the remote tier: write-behind of READY chunks, read-through on a miss.

Composition, not a new store: :class:`TwoTierStore` drives a
:class:`hybridkv.store.HostStore` (accounting of host entries and slots) and a
:class:`~hybridkv.remote.tier.RemoteTier` (the server), and moves bytes between the host slots
(:class:`~hybridkv.remote.slots.SlotBuffer`) and the tier. A promotion is two-phase like
vLLM's loads: :meth:`TwoTierStore.prepare_promote` reserves every member STORING through the
host store's own ``prepare_store`` (which may evict READY unpinned entries like any store), and
:meth:`TwoTierStore.complete_promote` fetches, verifies, writes the slots and completes the
store (READY) or drops the members (REMOVED) - never anything between (TT-2, TT-3, TT-5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError, HybridKVError
from hybridkv.remote.slots import SlotBuffer
from hybridkv.remote.tier import RemoteTier
from hybridkv.remote.values import Admission, Chunk, PromoteOutcome, PromoteRefusal
from hybridkv.store import HostStore, LookupResult, Refusal

__all__ = ["Promotion", "TwoTierStore"]


@dataclass(frozen=True, slots=True)
class Promotion:
    """A promotion in flight: ``chunk``'s members are STORING in ``slots`` (same order)."""

    chunk: Chunk
    slots: tuple[int, ...]


class TwoTierStore:
    """A host store with a remote tier under it; the host's bytes live in ``slots``."""

    def __init__(self, host: HostStore, tier: RemoteTier, slots: SlotBuffer) -> None:
        """Pre: ``slots`` has a slot for each of ``host``'s entries (field ``slots``)."""
        if slots.num_slots < host.capacity:
            raise HybridKVConfigError(
                "slots",
                slots.num_slots,
                f"fewer slots than host entries ({host.capacity})",
                "allocate one slot per entry",
            )
        self.host = host
        self.tier = tier
        self.slots = slots

    def write_behind(self, chunk: Chunk) -> Admission | Refusal:
        """Queue a copy of ``chunk``'s host bytes for the server (see ``RemoteTier``).

        Refusal NOT_READY (nothing changes) unless every member is READY in the host.
        """
        if self.host.lookup(chunk.members).hits != len(chunk.members):
            return Refusal.NOT_READY
        views = [self.slots.view(slot) for slot in self.host.slots(chunk.members)]
        return self.tier.write_behind(chunk, views)

    def remote_lookup(self, chunks: Sequence[Chunk]) -> int:
        """How many leading ``chunks`` the server holds (one round trip; 0 on a fault)."""
        return self.tier.lookup(chunks)

    def prepare_promote(self, chunk: Chunk) -> Promotion | PromoteRefusal:
        """Reserve ``chunk``'s members STORING for a fetch, and count the promotion started.

        Refusals change nothing: FAILED (remembered as failed), PRESENT (a member has a host
        entry, or the chunk is being promoted through the tier already: no read-through
        needed, and a STORING member belongs to another operation),
        NO_SPACE (the host cannot make room).
        """
        if self.tier.is_failed(chunk):
            return PromoteRefusal.FAILED
        if self.tier.in_flight(chunk) or any(
            self.host.status(key) is not LookupResult.MISS for key in chunk.members
        ):
            return PromoteRefusal.PRESENT
        reserved = self.host.prepare_store(chunk.members)
        if isinstance(reserved, Refusal):
            return PromoteRefusal.NO_SPACE
        if not self.tier.begin_promotion(chunk):
            # Checked above; only a second thread promoting through the same tier gets here.
            self.host.complete_store(chunk.members, False)
            raise HybridKVError(
                f"TT-3: a promotion of chunk {chunk.key.hex()} is already in flight"
            )
        return Promotion(chunk, self.host.slots(chunk.members))

    def complete_promote(self, promotion: Promotion) -> PromoteOutcome:
        """Fetch and verify ``promotion``'s chunk into its slots, then READY or REMOVED.

        PROMOTED: every member's slot holds its verified payload and is READY (one STORED
        event). Otherwise the members are dropped (one REMOVED event) and the slots' bytes
        are never read. Never raises on a server failure (TT-5).
        """
        size = self.slots.slot_bytes
        fetched = self.tier.fetch(
            promotion.chunk, accept=lambda payloads: all(len(p) == size for p in payloads)
        )
        members = promotion.chunk.members
        if fetched.outcome is PromoteOutcome.PROMOTED:
            for slot, payload in zip(promotion.slots, fetched.payloads, strict=True):
                self.slots.view(slot)[:] = payload
        self.host.complete_store(members, fetched.outcome is PromoteOutcome.PROMOTED)
        return fetched.outcome

    def promote(self, chunk: Chunk) -> PromoteOutcome | PromoteRefusal:
        """:meth:`prepare_promote` then :meth:`complete_promote`."""
        promotion = self.prepare_promote(chunk)
        if isinstance(promotion, PromoteRefusal):
            return promotion
        return self.complete_promote(promotion)

    def snapshot(self) -> dict[str, Any]:
        """The contract's two-tier snapshot: the tier's, with ``host`` the host store's."""
        return {"host": self.host.snapshot(), **self.tier.snapshot()}
