"""Exact-size host memory for offloaded KV blocks, pinned by registration when CUDA is present.

torch's pinned caching allocator rounds every request up to a power of two (60 GB asked,
80 GB used). We allocate one plain tensor of exactly ``num_slots * slot_bytes`` bytes and, on a
CUDA machine, register it with the driver (``cuMemHostRegister``, portable), which pins exactly
those pages. The driver API, not ``cudaHostRegister``: a failed runtime registration would
leave the runtime's last error set and torch's next kernel launch would fail with it.
Registration goes in regions of whole slots, at most 64 GiB each (one slot where a slot is
larger), and is rolled back if any region fails; ``region_bytes`` tells the copy planner where
runs must not be merged across. Host slots are fixed-size chunks of the allocation: slot ``i``
is bytes ``[i * slot_bytes, (i + 1) * slot_bytes)``.

Shared host memory (``shared_path``): tensor-parallel ranks that hold identical KV (vLLM's
``kv_tp_replicas``, MLA models) keep one host copy between them. Each rank maps the same file
(under ``/dev/shm``, a tmpfs: no disk I/O) with ``MAP_SHARED`` and sizes it to exactly
``num_slots * slot_bytes``; every rank computes the same size, so whichever opens it first
creates it and the others find it sized (the size is checked). One rank writes the slots, the
others only read them, in an order the scheduler side fixes (``hybridkv.vllm.ranks``). The
file is unlinked at ``close``, or when the object is collected or the process exits; mappings
already taken stay valid.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from enum import Enum

import torch

from hybridkv import cuda_driver
from hybridkv.errors import HybridKVConfigError

__all__ = ["HostMemory", "PinMode"]

_REGISTER_CHUNK = 64 << 30  # one registration covers at most this many bytes (whole slots)


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
        region_bytes: the allocation is registered in separate regions of this many bytes (a
            whole number of slots; the last region may be shorter). Copies never cross a
            region boundary in one run.
    """

    def __init__(
        self,
        host_bytes: int,
        slot_bytes: int,
        pin: PinMode = PinMode.AUTO,
        *,
        shared_path: str | None = None,
    ) -> None:
        """Allocate (and maybe pin) the slots; with ``shared_path``, map that file instead,
        shared with every process that maps it (module docstring).

        Pre: ``host_bytes`` and ``slot_bytes`` are ints, ``slot_bytes <= host_bytes``, and
        ``host_bytes`` fits in physical memory (and, shared, in the file system's free space).
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
        self.region_bytes = max(1, _REGISTER_CHUNK // slot_bytes) * slot_bytes
        self.shared_path = shared_path
        self._unlink: weakref.finalize[[str], HostMemory] | None = None
        if shared_path is not None:
            self.tensor = _map_shared(shared_path, self.num_slots * slot_bytes)
            # Unlinked at close, or when this object is collected or the process exits
            # (a killed process leaves the file: nothing runs then).
            self._unlink = weakref.finalize(self, _unlink_file, shared_path)
        else:
            try:
                self.tensor = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8)
            except RuntimeError as exc:
                raise HybridKVConfigError(
                    "host_bytes", host_bytes, f"cannot be allocated ({exc})", "lower host_bytes"
                ) from exc
        self.pinned = pin is not PinMode.OFF and torch.cuda.is_available()
        self._unpin: weakref.finalize[[list[int], int, torch.Tensor], HostMemory] | None = None
        if self.pinned:
            device = torch.cuda.current_device()
            regions = _register(self.tensor.data_ptr(), self.nbytes, self.region_bytes, device)
            self._unpin = weakref.finalize(self, _unregister, regions, device, self.tensor)

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
        """Unregister the allocation (if pinned) and unlink a shared file. Idempotent; the
        memory stays readable."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
            self.pinned = False
        if self._unlink is not None:
            self._unlink()


def _map_shared(path: str, size: int) -> torch.Tensor:
    """``size`` bytes of file ``path``, mapped shared (created and sized if absent)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        found = os.fstat(fd).st_size
        if found not in (0, size):
            raise HybridKVConfigError(
                "shared_path",
                path,
                f"holds {found} bytes, not the {size} this rank maps (another engine's file?)",
                "give each engine its own path (the connector names it by engine_id)",
            )
        if found == 0:
            free = _free_bytes(path)
            if size > free:
                with contextlib.suppress(FileNotFoundError):  # leave no empty file behind
                    os.unlink(path)
                raise HybridKVConfigError(
                    "host_bytes",
                    size,
                    f"exceeds the {free} bytes free where {path} lives",
                    "lower host_memory_bytes or enlarge /dev/shm (docker: --shm-size)",
                )
            os.ftruncate(fd, size)  # every rank asks the same size: idempotent
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file
    return torch.frombuffer(region, dtype=torch.uint8)


def _unlink_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # another rank unlinked it first
        os.unlink(path)


def _free_bytes(path: str) -> int:
    stats = os.statvfs(os.path.dirname(path) or ".")
    return stats.f_bavail * stats.f_frsize


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


def _register(ptr: int, size: int, region: int, device: int) -> list[int]:
    """Register ``[ptr, ptr + size)`` in regions of ``region`` bytes; return their starts. On
    a failure unregister what was registered and refuse."""
    done: list[int] = []
    for start in range(0, size, region):
        try:
            cuda_driver.host_register(ptr + start, min(region, size - start), device)
        except (OSError, cuda_driver.CudaDriverError) as exc:
            _unregister(done, device, None)
            raise HybridKVConfigError(
                "host_bytes",
                size,
                f"pinning failed at byte {start} ({exc})",
                "lower host_bytes (the driver could not pin that much) or use PinMode.OFF",
            ) from exc
        done.append(ptr + start)
    return done


def _unregister(regions: list[int], device: int, keep_alive: torch.Tensor | None) -> None:
    """Unpin every region (the tensor is kept alive until then). Best effort: at interpreter
    exit the driver may already be shut down, and an unpin has no failure to recover from."""
    for start in regions:
        with contextlib.suppress(OSError, cuda_driver.CudaDriverError):
            cuda_driver.host_unregister(start, device)
    del keep_alive
