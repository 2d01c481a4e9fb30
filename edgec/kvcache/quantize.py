"""Per-token, per-group quantization of cache entries — the storage half of the compressed cache's meaning.

Each token's k (or v) vector of D channels is split into groups of G channels; each group gets its own scale,
computed on the fly (absmax / qmax), so no calibration is needed. int4 values are packed two per uint8 (low
nibble first, offset-binary: stored = q + 8). fp8 is e4m3fn (max 448), as ml_dtypes/ONNX define it, stored as
its uint8 bit pattern: ONNX's gather/scatter/where ops take no float8 tensors, bytes they move freely.
The ONNX function body and any kernel must reproduce these bytes exactly; tests/kvcache check it.
"""

from __future__ import annotations

import numpy as np

QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
STORAGE = ("fp32", "fp16", "int8", "fp8", "int4")


def bytes_per_value(dtype: str, group: int) -> float:
    """Storage bytes per cached channel value, scales included (fp32 scale per group)."""
    payload = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}[dtype]
    return payload + (4.0 / group if dtype in QMAX else 0.0)


def quantize(x: np.ndarray, dtype: str, group: int) -> tuple[np.ndarray, np.ndarray | None]:
    """x [..., D] float → (stored values, scales [..., D/G] float32 or None for float storage)."""
    if dtype not in STORAGE:
        raise ValueError(f"unknown cache dtype {dtype!r}; one of {', '.join(STORAGE)}")
    if dtype == "fp32":
        return x.astype(np.float32), None
    if dtype == "fp16":
        return x.astype(np.float16), None
    depth = x.shape[-1]
    if depth % group:
        raise ValueError(f"group {group} does not divide the head dim {depth}")
    grouped = x.astype(np.float32).reshape(*x.shape[:-1], depth // group, group)
    scale = np.abs(grouped).max(-1) / np.float32(QMAX[dtype])
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    if dtype == "fp8":
        import ml_dtypes

        stored = (grouped / safe).astype(ml_dtypes.float8_e4m3fn).reshape(x.shape).view(np.uint8)
    else:
        q = np.clip(np.rint(grouped / safe), -QMAX[dtype] - 1, QMAX[dtype]).astype(np.int8).reshape(x.shape)
        stored = q if dtype == "int8" else pack_int4(q)
    return stored, scale.astype(np.float32)


def dequantize(stored: np.ndarray, scale: np.ndarray | None, dtype: str, group: int) -> np.ndarray:
    """The float32 values attention reads."""
    if scale is None:
        return stored.astype(np.float32)
    if dtype == "int4":
        values = unpack_int4(stored).astype(np.float32)
    elif dtype == "fp8":
        import ml_dtypes

        values = stored.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        values = stored.astype(np.float32)
    grouped = values.reshape(*values.shape[:-1], values.shape[-1] // group, group)
    return (grouped * scale[..., None]).reshape(values.shape)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], last axis even → uint8 with two values each (low nibble = even index)."""
    offset = (q.astype(np.int16) + 8).astype(np.uint8)
    return offset[..., 0::2] | (offset[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    low = (packed & 0x0F).astype(np.int8) - 8
    high = (packed >> 4).astype(np.int8) - 8
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
