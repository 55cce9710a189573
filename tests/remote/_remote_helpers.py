"""Chunks with content a function of their keys, a GPU-like store, the TT-8 check, and the
logins a locked server must refuse."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.remote import Chunk, Credentials, TwoTierStore, make_chunk
from hybridkv.store import Refusal

SLOT = 8

# Logins a server with a password and an ACL must refuse, and the words of each refusal: one
# start-up error each, on one server and on a cluster.
WRONG_LOGINS = pytest.mark.parametrize(
    ("credentials", "problem"),
    [
        (Credentials(password="not-the-password-1234"), "refused the password"),
        (Credentials(), "requires a password"),
        (Credentials("nobody", "not-the-password-1234"), "refused ACL user 'nobody'"),
    ],
    ids=["wrong password", "no password", "unknown user"],
)


def chunk_of(step: int, groups: int = 2, salt: bytes = b"", slot: int = SLOT) -> Chunk:
    """Chunk ``step`` of one request under ``salt``: one member per group, keys salted."""
    return make_chunk(b"test", [b"%s/g%d/u%d/%d" % (salt, g, step, slot) for g in range(groups)])


def content(key: bytes, size: int = SLOT) -> bytes:
    """The bytes stored for ``key``: a function of the key (content addressing)."""
    return (key * (size // len(key) + 1))[-size:]


def store_from_gpu(store: TwoTierStore, chunk: Chunk) -> None:
    """What a GPU store does: reserve the members, write their slots, complete."""
    out = store.host.prepare_store(chunk.members)
    assert not isinstance(out, Refusal)
    size = store.slots.slot_bytes
    for key, slot in zip(chunk.members, store.host.slots(chunk.members), strict=True):
        store.slots.view(slot)[:] = content(key, size)
    store.host.complete_store(chunk.members, True)


def host_bytes(store: TwoTierStore, chunk: Chunk) -> list[bytes]:
    """The host slots' bytes of ``chunk``'s members (each must be resident)."""
    return [bytes(store.slots.view(s)) for s in store.host.slots(chunk.members)]


def check_counters(snap: dict[str, Any]) -> None:
    """TT-8 on a two-tier snapshot."""
    c = snap["counters"]
    resolved = c["promoted"] + c["missing"] + c["fault"] + c["timeout"] + c["corrupt"]
    assert c["promotions_started"] == resolved + len(snap["promotions"])
    assert c["writes_enqueued"] == c["written"] + c["writes_failed"] + len(snap["writes"])
