"""Host slot bytes as the two-tier store sees them: one writable buffer cut into equal slots.

The host store hands out slot numbers (:meth:`hybridkv.store.HostStore.slots`); the bytes live
in one allocation where slot ``i`` is ``[i * slot_bytes, (i + 1) * slot_bytes)`` (the layout
of :class:`hybridkv.hostmem.HostMemory`). Any writable buffer works: a ``bytearray``, or
``HostMemory.tensor.numpy()`` on the CPU tier, so this module needs no torch.
"""

from __future__ import annotations

from hybridkv.errors import HybridKVConfigError

__all__ = ["SlotBuffer"]


class SlotBuffer:
    """``num_slots`` slots of ``slot_bytes`` bytes over one writable buffer."""

    def __init__(self, buffer: object, slot_bytes: int) -> None:
        """Slots over ``buffer`` (writable, C-contiguous); its size need be a whole number of
        slots (field ``slot_bytes`` otherwise)."""
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise HybridKVConfigError("slot_bytes", slot_bytes, "must be an int >= 1", "pass one")
        try:
            view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
        except TypeError as error:
            raise HybridKVConfigError(
                "buffer", buffer, f"is not a contiguous buffer ({error})", "pass a bytearray"
            ) from error
        if view.readonly or not view.nbytes or view.nbytes % slot_bytes:
            raise HybridKVConfigError(
                "buffer",
                view.nbytes,
                f"must be writable and a whole, non-zero number of {slot_bytes}-byte slots",
                "size it num_slots * slot_bytes",
            )
        self._view = view
        self.slot_bytes = slot_bytes
        self.num_slots = view.nbytes // slot_bytes

    @classmethod
    def allocate(cls, num_slots: int, slot_bytes: int) -> SlotBuffer:
        """Zeroed slots in a fresh ``bytearray``."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise HybridKVConfigError("num_slots", num_slots, "must be an int >= 1", "pass one")
        return cls(bytearray(num_slots * slot_bytes), slot_bytes)

    def view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes, writable, no copy (field ``slot`` when out of range)."""
        if not 0 <= slot < self.num_slots:
            raise HybridKVConfigError("slot", slot, f"not in [0, {self.num_slots})", "ask one")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]
