"""Content tags: what the stand-in forward writes into the KV cache and checks when it reads.

A position ``p`` of a request "computes" to the tag of the token prefix ``tokens[: p + 1]``
salted by the layer, so a slot holds the right content exactly when it holds the tag recomputed
from the request's own tokens. Attention layers get the tag in token slot ``p % block_size`` of
the block their group's table names for ``p`` (in the first and the last head, so a copy that
moves half a page is caught); a mamba layer's state page gets the tag of the prefix it has
consumed (at both ends of the unpadded page).

The tag views are ``int64`` views of vLLM's own per-layer cache views (``[B, H, N, C]``, N the
token slots for attention), so whatever a connector copies by bytes is what is checked.

Under tensor parallel each rank's caches get tags salted by the rank too (rank 0: unchanged), so
a rank that ends up holding another rank's shard reads wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LayerTags", "TagCounts", "layer_tags", "prefix_tags"]

_MOD = (1 << 61) - 1
_MUL = 1_000_003
_LIVE = 1 << 62  # set in every tag: a zeroed (never written) slot can never verify
_SALT = 0x9E3779B97F4A7C15
_RANK_SALT = 0xC2B2AE3D27D4EB4F


def prefix_tags(tokens: list[int], start: list[int]) -> list[int]:
    """Extend ``start`` (the prefix hashes of ``tokens[: len(start)]``) to all of ``tokens``.

    ``start[i]`` is a rolling hash of ``tokens[: i + 1]``; the caller keeps the list per request
    so each token is hashed once.
    """
    h = start[-1] if start else 0
    for tok in tokens[len(start) :]:
        h = (h * _MUL + tok + 1) % _MOD
        start.append(h)
    return start


def _salt(layer_index: int, rank: int = 0) -> int:
    return (((layer_index + 1) * _SALT) ^ (rank * _RANK_SALT)) & ((1 << 61) - 1)


@dataclass(frozen=True, slots=True)
class TagCounts:
    """Slots checked and slots that held something else (a wrong-content read)."""

    checked: int
    wrong: int


class LayerTags:
    """The tag views of one layer: ``views`` are ``int64`` tensors indexed ``[block, slot]``
    (attention) or ``[block, 0]`` (mamba state); ``rank``: the tensor-parallel rank whose
    shard the views cover."""

    def __init__(
        self,
        name: str,
        index: int,
        is_mamba: bool,
        views: tuple[torch.Tensor, ...],
        rank: int = 0,
    ):
        self.name = name
        self.index = index
        self.is_mamba = is_mamba
        self.views = views
        self.salt = _salt(index, rank)

    def expected(self, hashes: list[int], positions: range) -> torch.Tensor:
        """The tags of ``positions`` (each the prefix ending there) for this layer."""
        values = [(hashes[p] ^ self.salt) | _LIVE for p in positions]
        return torch.tensor(values, dtype=torch.int64)

    def write(self, blocks: torch.Tensor, slots: torch.Tensor, tags: torch.Tensor) -> None:
        # Indices and tags are built on the CPU; the caches may live on a GPU (tests/gpu).
        device = self.views[0].device
        blocks, slots, tags = blocks.to(device), slots.to(device), tags.to(device)
        for view in self.views:
            view[blocks, slots] = tags

    def check(self, blocks: torch.Tensor, slots: torch.Tensor, tags: torch.Tensor) -> TagCounts:
        device = self.views[0].device
        blocks, slots, tags = blocks.to(device), slots.to(device), tags.to(device)
        wrong = 0
        for view in self.views:
            wrong += int((view[blocks, slots] != tags).sum())
        return TagCounts(checked=len(self.views) * int(tags.numel()), wrong=wrong)

    def copy_state(self, src: int, dst: int, cache: torch.Tensor) -> None:
        """The runner's mamba state copy: the whole page of block ``src`` to block ``dst``."""
        cache[dst].copy_(cache[src])


def _int64_slots(view: torch.Tensor, head: int, last: bool) -> torch.Tensor:
    """An ``int64`` view ``[block, slot]`` over 8 bytes of each token slot of one head."""
    per = 8 // view.element_size()
    if view.stride(-1) != 1 or view.shape[-1] < per:
        raise ValueError(
            f"cache view {tuple(view.shape)} stride {view.stride()}: the last dim must be "
            "contiguous and hold 8 bytes to carry a content tag"
        )
    cols = slice(view.shape[-1] - per, view.shape[-1]) if last else slice(0, per)
    return view[:, head, :, cols].view(torch.int64)[..., 0]


def layer_tags(name: str, index: int, is_mamba: bool, view: Any, rank: int = 0) -> LayerTags:
    """The tag views over vLLM's per-layer cache view ``view`` (``[B, H, N, C]``) of
    tensor-parallel rank ``rank``."""
    if view.dim() != 4:
        raise ValueError(f"{name}: cache view of shape {tuple(view.shape)} is not [B, H, N, C]")
    if is_mamba:
        flat = view.reshape(view.shape[0], -1).view(torch.int8)
        first = flat[:, :8].view(torch.int64)
        last = flat[:, -8:].view(torch.int64)
        return LayerTags(name, index, True, (first, last), rank)
    heads = view.shape[1]
    return LayerTags(
        name,
        index,
        False,
        (_int64_slots(view, 0, False), _int64_slots(view, heads - 1, True)),
        rank,
    )
