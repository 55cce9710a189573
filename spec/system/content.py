"""The content model: what a GPU block or a host chunk holds, as an abstract value.

Real KV bytes are a function of the model weights, the KV cache group and the tokens that led to
them. The model keeps only that dependency: a :class:`Content` is ``(group_idx, prefix)``, the
group and the exact token prefix the bytes were computed from.

- An attention block at table index ``i`` (block size ``bs``) holds, after computing up to token
  ``n``, the KV of positions ``[i*bs, min((i+1)*bs, n))``; its content is
  ``(g, tokens[:min((i+1)*bs, n)])``: the prefix up to its last written position. KV at a
  position depends on every token before it, so the whole prefix is the value.
- A mamba state block holds the recurrent state after EXACTLY ``p`` tokens: ``(g, tokens[:p])``.
- :class:`Garbage` is what a block holds when nothing trustworthy was written to it (never
  written, a failed load): it equals no true content.

Computing writes the TRUE content; a load writes the host entry's content; a store copies the GPU
block's content into the host entry when the store completes. DATA-1 compares what a forward
reads with the true content for the reading request's tokens (:func:`attention_holds`,
:func:`state_holds`). Salt is not part of content: KV does not depend on it (isolation is SEC-1's
business, not DATA-1's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from spec.errors import ConfigError

__all__ = [
    "Content",
    "Garbage",
    "Value",
    "attention_holds",
    "decode",
    "describe",
    "encode",
    "state_holds",
    "true_attention",
    "true_state",
]


class Content(NamedTuple):
    """Bytes computed for group ``group_idx`` from exactly the tokens ``prefix``."""

    group_idx: int
    prefix: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Garbage:
    """Bytes nothing trustworthy wrote; ``reason`` says why (``"unwritten"``, ``"failed load"``)."""

    reason: str


Value = Content | Garbage
"""What a block or a host entry holds."""


def _check_count(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, value, "must be an int >= 0", "pass a non-negative int")


def true_attention(
    group_idx: int, tokens: Sequence[int], block_index: int, block_size: int, upto: int
) -> Content:
    """The content an attention block at ``block_index`` holds once tokens ``[0, upto)`` ran.

    Pre: ``block_size > 0``, ``block_index*block_size < upto <= len(tokens)`` (the block holds
    at least one computed position). Post: ``(g, tokens[:min((i+1)*bs, upto)])``. Pure.
    """
    _check_count("block_index", block_index)
    _check_count("upto", upto)
    if block_size <= 0 or not block_index * block_size < upto <= len(tokens):
        raise ConfigError(
            "upto", upto, "the block holds no computed position", "ask for a written block"
        )
    return Content(group_idx, tuple(tokens[: min((block_index + 1) * block_size, upto)]))


def true_state(group_idx: int, tokens: Sequence[int], position: int) -> Content:
    """The recurrent state after exactly ``position`` tokens: ``(g, tokens[:position])``.

    Pre: ``0 < position <= len(tokens)``. Pure.
    """
    _check_count("position", position)
    if not 0 < position <= len(tokens):
        raise ConfigError("position", position, "outside the tokens", "pass 1..len(tokens)")
    return Content(group_idx, tuple(tokens[:position]))


def attention_holds(
    value: Value,
    group_idx: int,
    tokens: Sequence[int],
    *,
    block_index: int,
    block_size: int,
    need_end: int,
) -> bool:
    """Does ``value`` hold the true KV of positions ``[i*bs, need_end)`` for ``tokens``?

    True iff the value was computed for this group, ends inside this block (a block of another
    index or group never passes, even with a matching prefix) at or after ``need_end``, and its
    prefix agrees with ``tokens`` up to ``need_end``. Positions past ``need_end`` are not read,
    so what they hold does not matter. Pre: ``i*bs < need_end <= (i+1)*bs``. Pure.
    """
    if not isinstance(value, Content) or value.group_idx != group_idx:
        return False
    start, end = block_index * block_size, (block_index + 1) * block_size
    written = len(value.prefix)
    if not (start < written <= end and written >= need_end):
        return False
    return value.prefix[:need_end] == tuple(tokens[:need_end])


def state_holds(value: Value, group_idx: int, tokens: Sequence[int], position: int) -> bool:
    """Does ``value`` hold the recurrent state after exactly ``position`` of ``tokens``? Pure."""
    return value == Content(group_idx, tuple(tokens[:position]))


def encode(value: Value) -> tuple[Any, ...]:
    """The tagged plain form of a value: ``("computed", g, prefix)`` or ``("garbage", why)``.

    Pure; :func:`decode` inverts it.
    """
    if isinstance(value, Garbage):
        return ("garbage", value.reason)
    return ("computed", value.group_idx, value.prefix)


def decode(raw: Sequence[Any]) -> Value:
    """The inverse of :func:`encode`. Pre: ``raw`` came from :func:`encode`."""
    if raw[0] == "garbage":
        return Garbage(str(raw[1]))
    return Content(int(raw[1]), tuple(raw[2]))


def describe(value: Value) -> str:
    """A short readable form for counterexample messages.

    Pure.
    """
    if isinstance(value, Garbage):
        return f"garbage({value.reason})"
    return f"g{value.group_idx}:{list(value.prefix)}"
