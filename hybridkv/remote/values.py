"""Values of the remote tier: chunks, their outcomes, and what a client call returned.

Names follow the two-tier contract (REMOTE-CONTRACT, issue 12): a chunk is the host keys of one
prefix step of one request, in group order; a promotion resolves PROMOTED, MISSING, FAULT,
TIMEOUT or CORRUPT; a queued write resolves WRITTEN or FAILED.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "AUTH_REFUSALS",
    "REMOTE_COUNTER_NAMES",
    "Admission",
    "Chunk",
    "ClientFault",
    "Corruption",
    "Fetched",
    "PromoteOutcome",
    "PromoteRefusal",
    "WriteOutcome",
]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk: its key (SHA-256, :func:`hybridkv.remote.codec.chunk_key`) and its members.

    Attributes:
        key: the chunk key, 32 bytes.
        members: the host keys the chunk holds, in group order, distinct and non-empty.
    """

    key: bytes
    members: tuple[bytes, ...]

    def plain(self) -> tuple[str, tuple[str, ...]]:
        """The snapshot's form: ``(chunk_key_hex, (member_key_hex, ...))``."""
        return self.key.hex(), tuple(member.hex() for member in self.members)


class PromoteOutcome(Enum):
    """How a promotion resolved: exactly one of these (contract, promote)."""

    PROMOTED = "promoted"
    MISSING = "missing"
    FAULT = "fault"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"


REMOTE_COUNTER_NAMES: tuple[str, ...] = (
    "promotions_started",
    *(outcome.value for outcome in PromoteOutcome),
    "writes_enqueued",
    "written",
    "writes_failed",
    "writes_dropped",
    "lookups",
    "lookup_faults",
)
"""The snapshot's ``counters`` keys, in the contract's order (TT-8 adds them up).

A resolved promotion counts under its outcome's value (``RemoteTier`` does
``counters[outcome.value]``), so those five keys are read off :class:`PromoteOutcome` rather
than spelled a second time."""


class PromoteRefusal(Enum):
    """A promotion that never started; the refused call changed nothing.

    NO_SPACE: the host tier cannot reserve the members. PRESENT: a member already has a host
    entry (a promotion is a read-through on a host miss: every member must be absent, so each
    STORING entry belongs to exactly one operation, TT-3). FAILED: the chunk is remembered as
    failed, and claims end before it.
    """

    NO_SPACE = "no_space"
    PRESENT = "present"
    FAILED = "failed"


class WriteOutcome(Enum):
    """How a queued write resolved."""

    WRITTEN = "written"
    FAILED = "failed"


class Admission(Enum):
    """What :meth:`RemoteTier.write_behind` did with a chunk; it never blocks.

    ENQUEUED: copied and queued. DROPPED: the queue was full (``writes_dropped``). KNOWN: the
    tier already holds it whole (written by this tier, not seen vanish): not re-written.
    PENDING: a write of it is already queued or in flight.
    """

    ENQUEUED = "enqueued"
    DROPPED = "dropped"
    KNOWN = "known"
    PENDING = "pending"


class ClientFault(Enum):
    """Why a client call failed: the server is gone or reset (FAULT), past the deadline
    (TIMEOUT), or not asked at all because the circuit breaker is open (SKIPPED,
    :mod:`hybridkv.remote.breaker`; no server wait)."""

    FAULT = "fault"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"


class Corruption(Enum):
    """What verification found wrong in a chunk value (any of them: CORRUPT, nothing loaded).

    KEYING: the value is sealed another way than the reader expects (unkeyed where the reader
    holds a fleet key, or keyed where it holds none). MAC: its MAC or AES-GCM tag does not
    verify under the reader's fleet key (forged, tampered, another secret, another chunk key).
    Both are authentication refusals (:data:`AUTH_REFUSALS`).
    """

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    MEMBERS = "members"
    LENGTHS = "lengths"
    DIGEST = "digest"
    KEYING = "keying"
    MAC = "mac"


AUTH_REFUSALS = frozenset({Corruption.KEYING, Corruption.MAC})
"""Refusals that mean a writer without this engine's fleet key, or a value altered since."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """A fetch's resolution: ``payloads`` (one per member, in order) only when PROMOTED."""

    outcome: PromoteOutcome
    payloads: tuple[bytes, ...] = ()
