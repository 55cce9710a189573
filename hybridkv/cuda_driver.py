"""The few CUDA driver calls hybridkv makes directly, through ctypes on ``libcuda.so.1``.

Why the driver and not the runtime: a failed runtime call (``cudaHostRegister``) leaves the
runtime's per-thread last error set, and torch's next kernel-launch check reports it as its
own failure. Driver calls return their status and leave that state alone. The runtime has no
call for a stream that is both dedicated (not from torch's pool, which vLLM's side streams also
draw from) and non-blocking (not serialised against the legacy default stream);
``cuStreamCreate`` makes one.

Every call runs with the device's primary context (the one torch's runtime uses) pushed on the
calling thread and popped after, so it works from any thread. Importing this module needs no
CUDA; the library is opened on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CudaDriverError",
    "destroy_stream",
    "host_device_pointer",
    "host_register",
    "host_unregister",
    "library",
    "nonblocking_stream",
]

# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: pinned for every context and
# mapped into the device address space (at the same address, under unified addressing).
_REGISTER_FLAGS = 0x01 | 0x02
_NON_BLOCKING = 0x01  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream


class CudaDriverError(RuntimeError):
    """A driver call returned an error status (``code``, a CUresult)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: CUresult {code} ({name})")


@functools.cache
def library() -> Any:
    """``libcuda.so.1``, initialised (raises OSError where no driver is installed)."""
    lib = ctypes.CDLL("libcuda.so.1")
    _check(lib, "cuInit", lib.cuInit(0))
    return lib


def host_register(ptr: int, size: int, device: int) -> None:
    """Pin and map ``size`` bytes at ``ptr`` for every context (raises CudaDriverError)."""
    lib = library()
    # The registration keeps a reference on the context it lives in (released on unregister),
    # so it outlives a context torch has not retained yet.
    with _primary_context(device, keep=True) as dev:
        err = lib.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(size), _REGISTER_FLAGS)
        if err != 0:
            lib.cuDevicePrimaryCtxRelease_v2(dev)
    _check(lib, "cuMemHostRegister", err)


def host_unregister(ptr: int, device: int) -> None:
    """Unpin the registration starting at ``ptr`` (raises CudaDriverError)."""
    lib = library()
    with _primary_context(device) as dev:
        err = lib.cuMemHostUnregister(ctypes.c_void_p(ptr))
        if err == 0:
            lib.cuDevicePrimaryCtxRelease_v2(dev)  # the reference host_register kept
    _check(lib, "cuMemHostUnregister", err)


def host_device_pointer(ptr: int, device: int) -> int:
    """The device address of registered host memory at ``ptr`` (raises CudaDriverError)."""
    lib = library()
    out = ctypes.c_uint64(0)
    with _primary_context(device):
        err = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr), 0)
    _check(lib, "cuMemHostGetDevicePointer", err)
    return int(out.value)


def nonblocking_stream(device: int) -> int:
    """A new dedicated non-blocking stream on ``device``; its handle (destroy it when done)."""
    lib = library()
    handle = ctypes.c_void_p(0)
    with _primary_context(device):
        err = lib.cuStreamCreate(ctypes.byref(handle), _NON_BLOCKING)
    _check(lib, "cuStreamCreate", err)
    return int(handle.value or 0)


def destroy_stream(handle: int, device: int) -> None:
    """Destroy a stream made by :func:`nonblocking_stream` (its queued work still completes)."""
    lib = library()
    with _primary_context(device):
        err = lib.cuStreamDestroy_v2(ctypes.c_void_p(handle))
    _check(lib, "cuStreamDestroy", err)


@contextlib.contextmanager
def _primary_context(device: int, *, keep: bool = False) -> Iterator[ctypes.c_int]:
    """Push ``device``'s primary context; ``keep``: leave one extra retain on it."""
    lib = library()
    dev = ctypes.c_int(0)
    _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
    ctx = ctypes.c_void_p(0)
    _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    try:
        _check(lib, "cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
        try:
            yield dev
        finally:
            popped = ctypes.c_void_p(0)
            lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    except BaseException:
        lib.cuDevicePrimaryCtxRelease_v2(dev)
        raise
    if not keep:
        lib.cuDevicePrimaryCtxRelease_v2(dev)


def _check(lib: Any, call: str, err: int) -> None:
    if err != 0:
        raise CudaDriverError(call, err, _error_name(lib, err))


def _error_name(lib: Any, code: int) -> str:
    name = ctypes.c_char_p(None)
    if lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return "unknown"
    return name.value.decode()
