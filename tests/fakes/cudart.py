"""A stand-in for ``cuda.bindings.runtime`` (cuda-python): device memory is host memory.

Every call has the real binding's shape — a tuple whose first item is a ``cudaError_t`` — and the checks a real
driver makes: a pointer must come from ``cudaMalloc`` and a copy must fit inside its allocation (an overflow that
would corrupt GPU memory is an error here), a freed pointer is gone, a stream must exist. A device allocation is a
numpy buffer (``allocation_of``/``device_bytes`` give the fake engine and kernels the very bytes the backend copied);
its "device pointer" is an address of a device space of its own that is never handed out twice, not even after
``reset``. So a pointer used past its free or a reset (a double free; a finalizer of an earlier test's state
running late) is an invalid pointer every time, never another allocation that numpy happened to place at the
same address (a real device may reuse an address too, which would make such a bug show only now and then).
``DEVICES`` sets what the machine has (0 devices: the driver reports cudaErrorNoDevice, as on a machine without
a GPU).
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import numpy as np


class cudaError_t(enum.IntEnum):  # noqa: N801  (the binding's names)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorNoDevice = 100
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


@dataclass
class cudaDeviceProp:  # noqa: N801
    name: bytes = b"Fake GeForce RTX 3060"
    major: int = 8
    minor: int = 6
    totalGlobalMem: int = 12 << 30  # noqa: N815
    uuid: bytes = b"fake-gpu-0000000"


DEVICES: list[cudaDeviceProp] = [cudaDeviceProp()]
VERSIONS = {"driver": 13000, "runtime": 13000}  # CUDA 13.0 both: the driver supports what the runtime needs
ALLOCATIONS: dict[int, np.ndarray] = {}  # device pointer → its bytes
STREAMS: set[int] = set()
PEAK = [0]  # the most bytes allocated at once since the last reset (``reset_peak``)
_next_stream = [1]
_ALIGNMENT = 256  # cudaMalloc's
_next_pointer = [1 << 52]  # above any host address, so a device pointer never reads as a host one


def reset(devices: list[cudaDeviceProp] | None = None, driver: int = 13000) -> None:
    """A fresh machine (tests call this between cases); ``driver``: the CUDA version the driver supports."""
    DEVICES[:] = [cudaDeviceProp()] if devices is None else devices
    VERSIONS["driver"] = driver
    ALLOCATIONS.clear()
    STREAMS.clear()
    PEAK[0] = 0


def used_bytes() -> int:
    """Bytes allocated now."""
    return sum(array.nbytes for array in ALLOCATIONS.values())


def leaked_after_collection() -> str | None:
    """What is still allocated once every unreachable object is collected (a cache state left open is freed by
    its finalizer then), as a line; None when nothing is. A test's end calls it: what the runtime would leak on a
    real GPU, and no late finalizer running into the next test."""
    import gc

    gc.collect()
    if not ALLOCATIONS and not STREAMS:
        return None
    held = sum(buffer.nbytes for buffer in ALLOCATIONS.values())
    return f"{len(ALLOCATIONS)} device allocations ({held} bytes) and {len(STREAMS)} streams never freed"


def reset_peak() -> None:
    """Start counting the peak from what is allocated now."""
    PEAK[0] = used_bytes()


def _no_device() -> bool:
    return not DEVICES


def cudaGetDeviceCount():  # noqa: N802
    if _no_device():
        return (cudaError_t.cudaErrorNoDevice, 0)
    return (cudaError_t.cudaSuccess, len(DEVICES))


def cudaGetDeviceProperties(device: int):  # noqa: N802
    if device >= len(DEVICES):
        return (cudaError_t.cudaErrorInvalidValue if DEVICES else cudaError_t.cudaErrorNoDevice, None)
    return (cudaError_t.cudaSuccess, DEVICES[device])


def cudaDriverGetVersion():  # noqa: N802
    return (cudaError_t.cudaSuccess, VERSIONS["driver"])


def cudaRuntimeGetVersion():  # noqa: N802
    return (cudaError_t.cudaSuccess, VERSIONS["runtime"])


def cudaMemGetInfo():  # noqa: N802
    if _no_device():
        return (cudaError_t.cudaErrorNoDevice, 0, 0)
    total = DEVICES[0].totalGlobalMem
    return (cudaError_t.cudaSuccess, max(total - used_bytes(), 0), total)


def cudaMalloc(size: int):  # noqa: N802
    if _no_device():
        return (cudaError_t.cudaErrorNoDevice, 0)
    size = max(int(size), 1)
    if used_bytes() + size > DEVICES[0].totalGlobalMem:  # the device is full, as a real one would be
        return (cudaError_t.cudaErrorMemoryAllocation, 0)
    buffer = np.zeros(size, np.uint8)
    pointer = _next_pointer[0]
    _next_pointer[0] += -(-size // _ALIGNMENT) * _ALIGNMENT + _ALIGNMENT  # a gap: one past the end is no allocation
    ALLOCATIONS[pointer] = buffer
    PEAK[0] = max(PEAK[0], used_bytes())
    return (cudaError_t.cudaSuccess, pointer)


def cudaFree(pointer: int):  # noqa: N802
    if ALLOCATIONS.pop(int(pointer), None) is None:
        return (cudaError_t.cudaErrorInvalidDevicePointer,)
    return (cudaError_t.cudaSuccess,)


def allocation_of(pointer: int, count: int) -> np.ndarray | None:
    """The allocation that holds ``count`` bytes from ``pointer`` (None when no single one does)."""
    found = _find(pointer, count)
    return None if found is None else found[1]


def device_bytes(pointer: int, count: int | None = None) -> np.ndarray | None:
    """The ``count`` bytes from ``pointer`` (None: to its allocation's end) as a view of the allocation; None when
    no single allocation holds them."""
    found = _find(pointer, 1 if count is None else count)
    if found is None:
        return None
    start, buffer = found
    end = buffer.nbytes if count is None else pointer - start + count
    return buffer[pointer - start : end]


def _find(pointer: int, count: int) -> tuple[int, np.ndarray] | None:
    for start, buffer in ALLOCATIONS.items():
        if start <= pointer and pointer + count <= start + buffer.nbytes:
            return start, buffer
    return None


def cudaMemcpyAsync(dst: int, src: int, count: int, kind: cudaMemcpyKind, stream: int):  # noqa: N802
    if stream not in STREAMS:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    return cudaMemcpy(dst, src, count, kind)


def cudaMemcpy(dst: int, src: int, count: int, kind: cudaMemcpyKind):  # noqa: N802
    dst, src, count = int(dst), int(src), int(count)
    to_device, from_device = {
        cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
        cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
        cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True),
    }.get(cudaMemcpyKind(kind), (False, False))
    target = device_bytes(dst, count) if to_device else None
    source = device_bytes(src, count) if from_device else None
    if (to_device and target is None) or (from_device and source is None):
        return (cudaError_t.cudaErrorInvalidValue,)
    if count:
        target_address = target.ctypes.data if to_device else dst
        source_address = source.ctypes.data if from_device else src
        ctypes.memmove(target_address, source_address, count)
    return (cudaError_t.cudaSuccess,)


def cudaStreamCreate():  # noqa: N802
    if _no_device():
        return (cudaError_t.cudaErrorNoDevice, 0)
    stream = _next_stream[0]
    _next_stream[0] += 1
    STREAMS.add(stream)
    return (cudaError_t.cudaSuccess, stream)


def cudaStreamSynchronize(stream: int):  # noqa: N802
    return (cudaError_t.cudaSuccess,) if stream in STREAMS else (cudaError_t.cudaErrorInvalidResourceHandle,)


def cudaStreamDestroy(stream: int):  # noqa: N802
    if stream not in STREAMS:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    STREAMS.discard(stream)
    return (cudaError_t.cudaSuccess,)


def cudaGetErrorString(error):  # noqa: N802
    return (cudaError_t.cudaSuccess, cudaError_t(int(error)).name.encode())
