"""Content addressing: what recomputation would write, so wrong data is visible byte for byte.

The simulator has no model weights. It writes, instead of real KV, bytes that are a
deterministic function of exactly what real KV depends on:

- the attention K (or V) row of token position ``t`` in layer ``l`` of group ``g`` depends on
  the prefix ``tokens[:t + 1]``;
- a mamba state after exactly ``p`` tokens depends on the prefix ``tokens[:p]``.

Each prefix gets a 64-bit rolling hash (:class:`PrefixHashes`); each (group, layer, plane)
mixes it into a 64-bit word (:func:`words`), and the row or state is that word repeated. A block
loaded from the host then equals what recomputation would write if and only if it holds the
right group's, layer's and plane's KV of the right prefix, at the right position: a block of
another request, another position, another group, K for V, a stale or half-written block, or a
state of another length all differ. Salt is not part of the content (KV does not depend on it;
isolation is the claim rule's business).

The rolling hash is sequential and computed once per token in Python; the mixing runs as
tensor ops on the caches' device. Bytes that carry no KV (page padding, rows past the
computed tokens) are never written or checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import torch

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.testbed.caches import SimCaches

__all__ = ["BlockTags", "ContentCodec", "PrefixHashes", "words"]

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3
_BASIS = 0xCBF29CE484222325


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class PrefixHashes:
    """The rolling hash of every prefix of one request's tokens, extended as tokens arrive.

    ``hashes[t]`` summarises ``tokens[:t + 1]`` (FNV-1a over token ids); prefixes that differ
    anywhere differ here except with probability about 2**-64 per pair.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        """Pre: token ids are ints >= 0. Post: hashes of every prefix of ``tokens``."""
        self._hashes: list[int] = []
        self._last = _BASIS
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens. Post: one more hash per token; earlier hashes are kept."""
        h = self._last
        out = self._hashes
        for token in tokens:
            h = ((h ^ (token + 1)) * _PRIME) & _MASK
            out.append(_signed(h))
        self._last = h

    def __len__(self) -> int:
        return len(self._hashes)

    def span(self, start: int, end: int) -> list[int]:
        """Hashes of the prefixes ending at positions ``start .. end - 1`` (signed 64-bit)."""
        if not 0 <= start <= end <= len(self._hashes):
            raise HybridKVConfigError(
                "end", end, f"outside the {len(self._hashes)} hashed tokens", "extend first"
            )
        return self._hashes[start:end]


def words(prefix_hashes: torch.Tensor, group: int, layer: int, plane: int) -> torch.Tensor:
    """The 64-bit word each row holds, for prefixes with the given rolling hashes.

    A splitmix64-style finalizer of ``hash ^ salt(group, layer, plane)``: every input bit moves
    every output bit, so neighbouring prefixes, groups, layers and planes give unrelated words.
    Integer tensor ops wrap and are exact on every device, so expected and written words agree.
    """
    salt = _signed(
        ((group + 1) * 0x9E3779B97F4A7C15 ^ (layer + 1) << 20 ^ (plane + 1) << 40) & _MASK
    )
    x = prefix_hashes ^ salt
    x = (x ^ (x >> 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * _signed(0x94D049BB133111EB)
    return x ^ (x >> 31)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as 64-bit words along its last dim (int8 bytes when rows are not whole)."""
    if (t.shape[-1] * t.element_size()) % 8 == 0:
        return t.view(torch.int64)
    return t.view(torch.int8)


class ContentCodec:
    """Writes and checks content in :class:`~hybridkv.testbed.caches.SimCaches`."""

    def __init__(self, caches: SimCaches) -> None:
        """Pre: caches built by :func:`~hybridkv.testbed.caches.build_sim_caches`."""
        self.caches = caches
        self.kinds = tuple(g.kind for g in caches.groups)
        self.device = caches.buffers[0].device

    def _hashes(self, hashes: PrefixHashes, start: int, end: int) -> torch.Tensor:
        return torch.tensor(hashes.span(start, end), dtype=torch.int64, device=self.device)

    # ----------------------------------------------------------------- attention rows

    def write_rows(
        self, group: int, table: Sequence[int], hashes: PrefixHashes, start: int, end: int
    ) -> None:
        """A forward over positions ``[start, end)`` of an attention group: write K and V rows.

        Pre: ``table`` covers every position (its slots there hold real blocks; null slots
        are skipped, as a sliding window's are).
        """
        self._rows(group, table, hashes, start, end, check=False)

    def check_rows(
        self, group: int, table: Sequence[int], hashes: PrefixHashes, start: int, end: int
    ) -> int:
        """How many blocks of ``table`` hold a wrong row in ``[start, end)`` (0: all right)."""
        return self._rows(group, table, hashes, start, end, check=True)

    def _rows(
        self,
        group: int,
        table: Sequence[int],
        hashes: PrefixHashes,
        start: int,
        end: int,
        *,
        check: bool,
    ) -> int:
        if end <= start:
            return 0
        spec = self.caches.groups[group]
        if spec.kind is GroupKind.MAMBA:
            raise HybridKVConfigError("group", group, "is a mamba group", "use write_state")
        bs = spec.block_size
        prefix = self._hashes(hashes, start, end)
        wrong = 0
        for layer, planes in enumerate(self.caches.planes[group]):
            for plane_idx, plane in enumerate(planes):
                expected = words(prefix, group, layer, plane_idx)
                for index in range(start // bs, -(-end // bs)):
                    block = table[index] if index < len(table) else 0
                    if block == 0:
                        continue
                    lo, hi = max(start, index * bs), min(end, (index + 1) * bs)
                    rows = _as_words(plane[block, lo - index * bs : hi - index * bs])
                    want = expected[lo - start : hi - start].to(rows.dtype)
                    want = want.view(-1, *([1] * (rows.dim() - 1))).expand_as(rows)
                    if check:
                        wrong += int(not torch.equal(rows, want))
                    else:
                        rows.copy_(want)
        return wrong

    # ----------------------------------------------------------------- mamba states

    def write_state(self, group: int, block: int, hashes: PrefixHashes, position: int) -> None:
        """Write the state after exactly ``position`` tokens into ``block`` (every layer)."""
        self._state(group, block, hashes, position, check=False)

    def check_state(self, group: int, block: int, hashes: PrefixHashes, position: int) -> bool:
        """Does ``block`` hold the state after exactly ``position`` tokens, in every layer?"""
        return self._state(group, block, hashes, position, check=True) == 0

    def _state(
        self, group: int, block: int, hashes: PrefixHashes, position: int, *, check: bool
    ) -> int:
        if self.caches.groups[group].kind is not GroupKind.MAMBA:
            raise HybridKVConfigError("group", group, "is not a mamba group", "use write_rows")
        if position < 1 or block == 0:
            raise HybridKVConfigError(
                "position",
                position,
                f"a state needs a real block (not the null block 0, got {block}) and >= 1 token",
                "write the state of a prefix of at least one token into a block id >= 1",
            )
        prefix = self._hashes(hashes, position - 1, position)
        wrong = 0
        for layer, states in enumerate(self.caches.planes[group]):
            for plane_idx, state in enumerate(states):
                target = _as_words(state[block])
                want = words(prefix, group, layer, plane_idx).to(target.dtype)
                if check:
                    wrong += int(not bool((target == want).all()))
                else:
                    target.fill_(want.item())
        return wrong


class BlockTags:
    """Tags written into a block's canonical bytes and read back from the bytes alone.

    For tests of data paths that move whole canonical blocks (a transfer engine, a worker):
    every byte of group ``g``'s block derives from the tag written there (a SHA-256 stream of
    the tag's ``repr``), so the bytes found in a block, wherever they travelled, name the tag
    that produced them, or nothing when no tag produced them (a torn copy, the wrong slot).
    """

    def __init__(self, caches: CanonicalCaches) -> None:
        """Pre: ``caches`` built by :func:`hybridkv.canonical.build_canonical_caches`."""
        self.caches = caches
        self._known: dict[tuple[int, bytes], Hashable] = {}

    def _views(self, group: int, block: int) -> list[torch.Tensor]:
        views: list[torch.Tensor] = []
        for ref in self.caches.group_refs[group]:
            row = self.caches.tensors[ref.tensor_index].view[block]
            views.extend(row[offset : offset + length] for offset, length in ref.runs)
        return views

    def write(self, group: int, block: int, tag: Hashable) -> None:
        """Fill group ``group``'s block ``block`` (every layer) with ``tag``'s bytes."""
        size = self.caches.group_bytes(group)
        seed = hashlib.sha256(repr(tag).encode()).digest()
        raw = (seed * (size // len(seed) + 1))[:size]
        self._known[(group, hashlib.sha256(raw).digest())] = tag
        data = torch.frombuffer(bytearray(raw), dtype=torch.int8).to(self.caches.device)
        at = 0
        for view in self._views(group, block):
            view.copy_(data[at : at + view.numel()])
            at += view.numel()

    def read(self, group: int, block: int, default: Hashable = None) -> Hashable:
        """The tag whose bytes group ``group``'s block holds, else ``default``. Pure."""
        raw = b"".join(bytes(v.view(torch.uint8).cpu().tolist()) for v in self._views(group, block))
        return self._known.get((group, hashlib.sha256(raw).digest()), default)
