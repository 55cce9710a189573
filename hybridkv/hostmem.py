"""Exact-size host memory for offloaded KV blocks, pinned by registration when CUDA is present.

torch's pinned caching allocator rounds every request up to a power of two (60 GB asked,
80 GB used). We allocate one plain tensor of exactly ``num_slots * slot_bytes`` bytes and, on a
CUDA machine, register it with the driver (``cudaHostRegister``), which pins exactly those
pages. Registration goes in chunks of at most 64 GiB and is rolled back if any chunk fails.
Host slots are fixed-size chunks of the allocation: slot ``i`` is bytes
``[i * slot_bytes, (i + 1) * slot_bytes)``.
"""

from __future__ import annotations

import os
import weakref
from enum import Enum
from typing import Any

import torch

from hybridkv.errors import HybridKVConfigError

__all__ = ["HostMemory", "PinMode"]

_REGISTER_CHUNK = 64 << 30  # cudaHostRegister is given at most this many bytes per call


class PinMode(Enum):
    """``AUTO`` pins when CUDA is available; ``OFF`` never; ``REQUIRED`` refuses without CUDA."""

    AUTO = "auto"
    OFF = "off"
    REQUIRED = "required"


class HostMemory:
    """One host allocation cut into ``num_slots`` slots of ``slot_bytes`` each.

    Attributes:
        tensor: the whole allocation, uint8, ``num_slots * slot_bytes`` bytes.
        slot_bytes: bytes per slot.
        num_slots: ``host_bytes // slot_bytes``; the remainder (less than a slot) is not allocated.
        pinned: whether the allocation is registered with the CUDA driver.
    """

    def __init__(self, host_bytes: int, slot_bytes: int, pin: PinMode = PinMode.AUTO) -> None:
        """Allocate (and maybe pin) the slots.

        Pre: ``host_bytes`` and ``slot_bytes`` are ints, ``slot_bytes <= host_bytes``, and
        ``host_bytes`` fits in physical memory.
        Post: ``num_slots >= 1`` slots exist; their bytes are unspecified until written.
        Frame: a refused call (HybridKVConfigError) allocates and registers nothing.
        """
        _check_size("slot_bytes", slot_bytes)
        _check_size("host_bytes", host_bytes)
        if slot_bytes > host_bytes:
            raise HybridKVConfigError(
                "host_bytes",
                host_bytes,
                f"is smaller than one slot ({slot_bytes} bytes)",
                "give at least one slot's worth of host memory",
            )
        physical = _physical_bytes()
        if host_bytes > physical:
            raise HybridKVConfigError(
                "host_bytes",
                host_bytes,
                f"exceeds this machine's memory ({physical} bytes)",
                "lower host_bytes below physical memory, leaving room for the process",
            )
        if pin is PinMode.REQUIRED and not torch.cuda.is_available():
            raise HybridKVConfigError(
                "pin", pin.value, "pinning needs CUDA and none is available", "use PinMode.AUTO"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = host_bytes // slot_bytes
        try:
            self.tensor = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise HybridKVConfigError(
                "host_bytes", host_bytes, f"cannot be allocated ({exc})", "lower host_bytes"
            ) from exc
        self.pinned = pin is not PinMode.OFF and torch.cuda.is_available()
        self._unpin: weakref.finalize[[int, int, torch.Tensor], HostMemory] | None = None
        if self.pinned:
            ptr, size = self.tensor.data_ptr(), self.tensor.numel()
            _register(ptr, size)
            self._unpin = weakref.finalize(self, _unregister, ptr, size, self.tensor)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: exactly ``num_slots * slot_bytes``."""
        return self.num_slots * self.slot_bytes

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index`` as a uint8 view of ``slot_bytes`` bytes (refuses out-of-range)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_slots:
            raise HybridKVConfigError(
                "slot",
                index,
                f"is outside host memory (slots 0..{self.num_slots - 1})",
                "name a slot the host store allocated",
            )
        return self.tensor[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def close(self) -> None:
        """Unregister the allocation (if pinned). Idempotent; the memory stays readable."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
            self.pinned = False


def _check_size(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridKVConfigError(
            field, value, "must be a positive int of bytes", f"pass {field} >= 1"
        )


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown platform: let the allocation itself decide


def _cudart() -> Any:
    """torch's CUDA runtime bindings (untyped in torch's stubs)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _register(ptr: int, size: int) -> None:
    """cudaHostRegister in chunks; on failure unregister what was registered and refuse."""
    cudart = _cudart()
    done: list[int] = []
    for start in range(0, size, _REGISTER_CHUNK):
        n = min(_REGISTER_CHUNK, size - start)
        err = cudart.cudaHostRegister(ptr + start, n, 0)
        if int(getattr(err, "value", err)) != 0:
            for p in done:
                cudart.cudaHostUnregister(p)
            raise HybridKVConfigError(
                "host_bytes",
                size,
                f"cudaHostRegister failed ({err}) at byte {start}",
                "lower host_bytes (the driver could not pin that much) or use PinMode.OFF",
            )
        done.append(ptr + start)


def _unregister(ptr: int, size: int, keep_alive: torch.Tensor) -> None:
    cudart = _cudart()
    for start in range(0, size, _REGISTER_CHUNK):
        cudart.cudaHostUnregister(ptr + start)
    del keep_alive
