"""Host capacity from a byte budget: how many whole chunks fit, and the exact bytes they take.

The store counts chunks (one entry = one chunk of every group's bytes); users size the tier
in bytes (``--host-bytes``). The chunk count is ``host_bytes // chunk_bytes``: a partial chunk
cannot hold an entry, so the remainder is left unallocated and :attr:`HostCapacity.total_bytes` is
the exact size the host allocation needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError

__all__ = ["HostCapacity"]


def _positive_int(field: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridKVConfigError(field, value, "must be an int >= 1", fix)
    return value


@dataclass(frozen=True, slots=True)
class HostCapacity:
    """``chunks`` entries of ``chunk_bytes`` bytes each.

    Attributes:
        chunks: entries the store holds (its ``capacity``), >= 1.
        chunk_bytes: bytes of one chunk (every group's pages of one chunk together), >= 1.
    """

    chunks: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        _positive_int("num_chunks", self.chunks, "give the tier at least one chunk")
        _positive_int("chunk_bytes", self.chunk_bytes, "pass the bytes of one offload chunk")

    @property
    def total_bytes(self) -> int:
        """Bytes the chunks take: the exact size of the host allocation."""
        return self.chunks * self.chunk_bytes

    def slot_offset(self, slot: int) -> int:
        """Byte offset of host slot ``slot`` (``0 <= slot < chunks``) in that allocation."""
        return slot * self.chunk_bytes

    @classmethod
    def from_budget(cls, host_bytes: object, chunk_bytes: object) -> HostCapacity:
        """The whole chunks of ``chunk_bytes`` that fit in ``host_bytes``.

        Pre: both ints >= 1 (bool refused) and ``host_bytes >= chunk_bytes``; otherwise
        :class:`HybridKVConfigError` with field ``chunk_bytes`` or ``host_bytes``.
        Post: ``chunks = host_bytes // chunk_bytes`` >= 1.
        """
        chunk = _positive_int("chunk_bytes", chunk_bytes, "pass the bytes of one offload chunk")
        budget = _positive_int("host_bytes", host_bytes, "give the host tier a positive size")
        if budget < chunk:
            raise HybridKVConfigError(
                "host_bytes",
                host_bytes,
                f"is smaller than one chunk ({chunk} bytes)",
                f"give at least {chunk} bytes or use a smaller chunk_size",
            )
        return cls(budget // chunk, chunk)
