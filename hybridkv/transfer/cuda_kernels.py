"""Copies as index kernels over host memory mapped into the device (zero copy).

Why: ``cuMemcpyBatchAsync`` costs the submitting thread about 0.8 us per descriptor (measured
on an H100, docs/benchmarks), more than the 0.6 us a 32 KB block takes on the wire, so small
scattered blocks cannot reach the link's rate through DMA descriptors. An index kernel moves
every block of one run of a group's template (the same layer plane of every pair) in one
launch: it gathers the source rows and scatters them to the destination rows, reading or
writing pinned host memory through its device mapping. The cost is two launches per template
run and chunk, whatever the number of blocks, and SM time on the engine's stream.

The host memory is viewed as a CUDA tensor through DLPack over its device address (the
allocation is registered with ``CU_MEMHOSTREGISTER_DEVICEMAP``). Each template run gets a pair
of strided views, (blocks, run) on the device and (slots, run) on the host, in the widest
integer type that every offset, length and stride is a multiple of.

GPU scratch: a gather lands in scratch before it is scattered. The scratch is allocated once,
when the copier is built, one buffer per direction (loads and stores run on their own streams,
so each stream reuses only its own buffer, in stream order), ``scratch_bytes`` in all
(:data:`DEFAULT_SCRATCH_BYTES`; the connector's ``gpu_scratch_bytes``). A job larger than the
scratch is copied in chunks of whole rows that fit it; no copy allocates device memory of its
own size. vLLM sizes its KV cache before the connector registers, so these bytes come out of
the headroom ``--gpu-memory-utilization`` leaves; a fixed, logged amount, never a per-job one.
:class:`IndexCopier` is that logic on any device (the CPU tests run it on host tensors);
:class:`KernelCopier` is it over mapped host memory on a CUDA device.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.utils.dlpack

from hybridkv import cuda_driver
from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.transfer.api import Direction
from hybridkv.transfer.plan import take

__all__ = ["DEFAULT_SCRATCH_BYTES", "IndexCopier", "KernelCopier"]

# Device bytes of scratch, both directions together (half each). It was 64 MiB per chunk per
# direction, allocated by each copy through torch's caching allocator; 32 MiB per direction
# keeps a chunk at 2 launches per 32 MiB of rows (the launch cost, about 5 us, is under 1% of
# the 0.7 ms such a chunk takes at 46 GB/s).
DEFAULT_SCRATCH_BYTES = 64 << 20
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


class _RunViews(NamedTuple):
    """One template run: (num_blocks, n) device rows and (num_slots, n) host rows."""

    device_rows: torch.Tensor
    host_rows: torch.Tensor
    row_bytes: int


class IndexCopier:
    """Queues a job's copies as index kernels through preallocated scratch, on the current
    stream of ``host_rows``' device (any device: the CPU path is what CI runs).

    ``host_tensor``: a uint8 tensor over the host slots' bytes, on the caches' device (on CUDA,
    the device mapping of pinned host memory; on CPU, the host memory itself).
    ``scratch_bytes``: device scratch, both directions together; each direction's half must
    hold one row of the largest template run (refused otherwise, naming the smallest size).
    """

    def __init__(
        self,
        caches: CanonicalCaches,
        host: HostMemory,
        host_tensor: torch.Tensor,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    ) -> None:
        if host_tensor.device.type != caches.device.type:
            raise HybridKVConfigError(
                "host_tensor",
                str(host_tensor.device),
                f"is not on the caches' device ({caches.device})",
                "view the host slots on the caches' device",
            )
        self._device = host_tensor.device
        self._runs: list[list[_RunViews]] = [
            _group_views(caches, host, host_tensor, g) for g in range(len(caches.group_refs))
        ]
        widest = max((run.row_bytes for runs in self._runs for run in runs), default=1)
        if isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int):
            scratch_bytes = -1  # refused below, naming what was given
        per_direction = scratch_bytes // 2
        if per_direction < widest:
            raise HybridKVConfigError(
                "gpu_scratch_bytes",
                scratch_bytes,
                f"leaves {max(per_direction, 0)} bytes per direction, less than one row of "
                f"{widest} bytes (a template run of one block)",
                f"give at least {2 * widest}, or 0 to copy by DMA only",
            )
        # Allocated once: each direction's stream reuses its own buffer, in stream order.
        self._scratch = {
            d: torch.empty(per_direction, dtype=torch.uint8, device=self._device) for d in Direction
        }

    @property
    def scratch_bytes(self) -> int:
        """Device bytes this copier holds as scratch (both directions)."""
        return sum(t.numel() for t in self._scratch.values())

    def rows_per_chunk(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` one chunk moves: as many as one direction's scratch holds."""
        return self._scratch[Direction.LOAD].numel() // row_bytes

    def runs_and_launches(self, pairs_per_group: Sequence[int]) -> tuple[int, int]:
        """For a job with these pair counts per group: its uncoalesced runs (each pair times
        its group's template runs) and the kernel launches it needs here (for cost models)."""
        runs = sum(n * len(self._runs[g]) for g, n in enumerate(pairs_per_group))
        launches = 0
        for g, n in enumerate(pairs_per_group):
            for run in self._runs[g] if n else ():
                launches += 2 * -(-n // self.rows_per_chunk(run.row_bytes))
        return runs, launches

    def copy(self, direction: Direction, table: torch.Tensor) -> object:
        """Queue the copies of a validated (n, 3) table; return what must outlive them."""
        keep: list[torch.Tensor] = []
        groups = table[:, 0]
        single = int(groups.min()) == int(groups.max()) if groups.numel() else False
        scratch = self._scratch[direction]
        for g, runs in enumerate(self._runs):
            # Selecting rows costs a few torch calls: a job of one group (the common case)
            # skips it.
            if single:
                rows = table if int(groups[0]) == g else table[:0]
            else:
                rows = take(table, (groups == g).nonzero()[:, 0])
            if rows.shape[0] == 0 or not runs:
                continue
            blocks, slots = self._indices(rows, keep)
            for run in runs:
                step = self.rows_per_chunk(run.row_bytes)
                dtype, width = run.host_rows.dtype, run.host_rows.shape[1]
                for start in range(0, rows.shape[0], step):
                    b, s = blocks[start : start + step], slots[start : start + step]
                    staged = scratch[: b.shape[0] * run.row_bytes].view(dtype).view(-1, width)
                    if direction is Direction.STORE:
                        torch.index_select(run.device_rows, 0, b, out=staged)
                        run.host_rows.index_copy_(0, s, staged)
                    else:
                        torch.index_select(run.host_rows, 0, s, out=staged)
                        run.device_rows.index_copy_(0, b, staged)
        return keep

    def _indices(
        self, rows: torch.Tensor, keep: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' block and slot ids on the copier's device (16 bytes per pair)."""
        if self._device.type != "cuda":
            ids = rows[:, 1:].t().contiguous()
            return ids[0], ids[1]
        ids = torch.empty((2, rows.shape[0]), dtype=torch.int64, pin_memory=True)
        ids.copy_(rows[:, 1:].t())
        on_device = ids.to(self._device, non_blocking=True)
        keep.append(ids)  # the pinned source of an asynchronous copy
        return on_device[0], on_device[1]


class KernelCopier(IndexCopier):
    """:class:`IndexCopier` over pinned host memory mapped into CUDA device ``device``."""

    def __init__(
        self,
        caches: CanonicalCaches,
        host: HostMemory,
        device: int,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    ) -> None:
        self._host_view = _MappedHost(host, device)
        super().__init__(caches, host, self._host_view.tensor, scratch_bytes)


def _group_views(
    caches: CanonicalCaches, host: HostMemory, mapped: torch.Tensor, group: int
) -> list[_RunViews]:
    out: list[_RunViews] = []
    slot_offset = 0
    for ref in caches.group_refs[group]:
        tensor = caches.tensors[ref.tensor_index]
        flat = tensor.flat
        for run in ref.runs:
            start = flat.storage_offset() + run.offset
            width, dtype = next(
                (w, d)
                for w, d in _WIDTHS
                if start % w == 0
                and slot_offset % w == 0
                and run.length % w == 0
                and tensor.block_stride_bytes % w == 0
                and host.slot_bytes % w == 0
            )
            device_rows = _strided(
                flat.untyped_storage(),
                dtype,
                start // width,
                (caches.num_blocks, run.length // width),
                (tensor.block_stride_bytes // width, 1),
            )
            host_rows = _strided(
                mapped.untyped_storage(),
                dtype,
                slot_offset // width,
                (host.num_slots, run.length // width),
                (host.slot_bytes // width, 1),
            )
            out.append(_RunViews(device_rows, host_rows, run.length))
            slot_offset += run.length
    return out


def _strided(
    storage: Any, dtype: torch.dtype, offset: int, size: Sequence[int], stride: Sequence[int]
) -> torch.Tensor:
    view = torch.empty(0, dtype=dtype, device=storage.device)
    return view.set_(storage, offset, tuple(size), tuple(stride))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


_KDL_CUDA = 2
_KDL_UINT = 1


# DLPack records whose tensors are alive, by address, with what they keep alive (the shape
# array, the HostMemory): torch calls the deleter when the last view of the storage dies.
_LIVE: dict[int, tuple[object, ...]] = {}


def _forget(record: int | None) -> None:
    _LIVE.pop(record or 0, None)


_release = _DELETER(_forget)


class _MappedHost:
    """A uint8 CUDA tensor over a HostMemory's device mapping. Its storage owns the DLPack
    record and keeps the host memory alive until torch frees it."""

    def __init__(self, host: HostMemory, device: int) -> None:
        if not host.pinned:
            raise RuntimeError("host memory must be pinned (and mapped) for kernel copies")
        address = cuda_driver.host_device_pointer(host.tensor.data_ptr(), device)
        if address != host.tensor.data_ptr():
            # Without unified addressing each registered region has its own device address,
            # and one tensor cannot span them.
            raise RuntimeError("host memory is not mapped at its own address (no UVA)")
        self._shape = (ctypes.c_int64 * 1)(host.nbytes)
        self._record = _DLManagedTensor()
        dl = self._record.dl_tensor
        dl.data = address
        dl.device = _DLDevice(_KDL_CUDA, device)
        dl.ndim = 1
        dl.dtype = _DLDataType(_KDL_UINT, 8, 1)
        dl.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        dl.byte_offset = 0
        self._record.deleter = _release
        _LIVE[ctypes.addressof(self._record)] = (self._record, self._shape, host)
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        capsule = new_capsule(ctypes.addressof(self._record), b"dltensor", None)
        self.tensor: torch.Tensor = torch.utils.dlpack.from_dlpack(capsule)
