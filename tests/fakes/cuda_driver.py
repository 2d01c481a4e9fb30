"""A stand-in for ``cuda.bindings.driver`` (cuda-python): the calls a TensorRT plugin makes to load PTX and launch
a kernel, with the checks a real driver makes, and a launch that runs the kernel the PTX was compiled from in
Triton's interpreter over the fake device memory (tests.fakes.cudart: device allocations are host buffers).

- ``cuInit`` fails without a device; every other call fails before it (CUDA_ERROR_NOT_INITIALIZED);
- ``cuModuleLoadData`` takes PTX as a NUL-terminated string (the driver reads a C string) for a compute
  capability the device has (``.target sm_XY`` ≤ the device's), else CUDA_ERROR_INVALID_IMAGE / INVALID_PTX;
- ``cuModuleGetFunction`` finds only an ``.entry`` of that module;
- ``cuLaunchKernel`` takes ``kernelParams`` as (values, ctypes types), one per ``.param`` of the entry with the
  matching kind (u64 = a pointer, u32/s32 = a 32-bit integer, f32 = a float); every nonzero pointer must lie in a
  device allocation; the block must be the compiled kernel's (32 × num_warps threads) and the shared memory at
  least its. The kernel that runs is the one ``register`` tied to the PTX's bytes: a launch record from the bundle
  (its constexprs and pointer types), the Triton source being plugins/compressed_attention/kernel.py.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import re

import numpy as np

from tests.fakes import cudart


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500


KERNELS: dict[str, dict] = {}  # sha256 of PTX text → the launch record it was compiled with
MODULES: dict[int, str] = {}  # module handle → PTX text
FUNCTIONS: dict[int, tuple[str, str]] = {}  # function handle → (PTX text, entry name)
LAUNCHES: list[dict] = []  # every launch: grid, block, the scalar arguments (tests look at them)
_state = {"initialized": False, "next": 1}
_KINDS = {"u64": (ctypes.c_void_p,), "u32": (ctypes.c_uint32, ctypes.c_int32), "s32": (ctypes.c_int32,),
          "f32": (ctypes.c_float,)}  # fmt: skip
_NUMPY = {"*fp32": np.float32, "*fp16": np.float16, "*i8": np.int8, "*u8": np.uint8, "*i64": np.int64}


def register(ptx: str, record: dict) -> None:
    KERNELS[hashlib.sha256(ptx.encode()).hexdigest()] = record


def reset() -> None:
    MODULES.clear()
    FUNCTIONS.clear()
    LAUNCHES.clear()
    _state["initialized"] = False


def _handle() -> int:
    _state["next"] += 1
    return _state["next"]


def cuInit(flags: int):  # noqa: N802
    if not cudart.DEVICES:
        return (CUresult.CUDA_ERROR_NO_DEVICE,)
    _state["initialized"] = True
    return (CUresult.CUDA_SUCCESS,)


def cuModuleLoadData(image):  # noqa: N802
    if not _state["initialized"]:
        return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
    data = bytes(image)
    if not data.endswith(b"\0"):
        return (CUresult.CUDA_ERROR_INVALID_IMAGE, None)
    text = data[:-1].decode()
    target = re.search(r"\.target\s+sm_(\d+)", text)
    device = cudart.DEVICES[0]
    if target is None or int(target.group(1)) > device.major * 10 + device.minor:
        return (CUresult.CUDA_ERROR_INVALID_PTX, None)
    handle = _handle()
    MODULES[handle] = text
    return (CUresult.CUDA_SUCCESS, handle)


def cuModuleGetFunction(module: int, name: bytes):  # noqa: N802
    text = MODULES.get(module)
    if text is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
    if not re.search(rf"\.entry\s+{re.escape(name.decode())}\(", text):
        return (CUresult.CUDA_ERROR_NOT_FOUND, None)
    handle = _handle()
    FUNCTIONS[handle] = (text, name.decode())
    return (CUresult.CUDA_SUCCESS, handle)


def cuLaunchKernel(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared, stream, params, extra):  # noqa: N802
    entry = FUNCTIONS.get(function)
    if entry is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    text, name = entry
    if stream not in cudart.STREAMS:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    kinds = re.findall(r"\.param\s+\.(\w+)", re.search(rf"\.entry\s+{name}\(([^)]*)\)", text).group(1))
    values, types = params
    if len(values) != len(kinds) or len(types) != len(kinds):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if any(kind_type not in _KINDS[kind] for kind, kind_type in zip(kinds, types, strict=True)):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    record = KERNELS.get(hashlib.sha256(text.encode()).hexdigest())
    if record is None:
        raise AssertionError("tests.fakes.cuda_driver: no launch record registered for this PTX")
    if (block_x, block_y, block_z) != (32 * record["num_warps"], 1, 1) or shared < record["shared"]:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if (grid_y, grid_z) != (1, 1) or grid_x < 1 or extra not in (0, None):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    arguments = []
    pointer_types = [kind for _, kind in record["signature"]]
    for index, value in enumerate(values):
        if index < len(pointer_types) and pointer_types[index].startswith("*"):
            view = _device_view(int(value), _NUMPY[pointer_types[index]])
            if view is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            arguments.append(view)
        elif index < len(pointer_types):
            arguments.append(value)
        elif value not in (0, None):  # Triton's scratch pointers: the record says none is needed
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    LAUNCHES.append({"grid": grid_x, "scalars": [a for a in arguments if not hasattr(a, "data_ptr")]})
    from edgec.plugins.compressed_attention.kernel import kernel

    kernel()[(grid_x,)](*arguments, **record["constexprs"])
    return (CUresult.CUDA_SUCCESS,)


def _device_view(pointer: int, dtype):
    """A torch tensor over the device allocation that holds ``pointer``, from it to the allocation's end."""
    import torch

    tail = cudart.device_bytes(pointer)
    if tail is None:
        return None
    size = tail.nbytes // np.dtype(dtype).itemsize
    return torch.from_numpy(tail[: size * np.dtype(dtype).itemsize].view(dtype))
