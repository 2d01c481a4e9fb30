"""A GGUF file's quantized blocks, read raw, so the int4 pass can carry them into the bundle exactly.

transformers dequantizes a GGUF to fp32 when it loads it; the int4 pass then sees only fp32 weights. This module
reads the same file with ``gguf.GGUFReader`` and finds, for a weight of the exported graph, the quantized rows it
came from: every row of every quantized tensor is indexed by the exact bytes of its fp32 dequantization
(``gguf.quants.dequantize``), so projections that transformers permuted (Llama's q/k) or that the graph fused
(q|k|v, gate|up) and transposed are found column by column. The rows found are decoded into ``GridRows`` (codes,
fp16 steps and minima, integer sub-scales: the file's own numbers) and accepted only if their dequantization
equals the graph's weight bit for bit.

The bit layouts of the codes come from the gguf library: a block is dequantized with its step set to 1 and its
minimum to 0 (a "probe"), which yields its integer codes; the header fields overwritten for that are below.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgec.blockquant import GridRows

ONE_FP16 = np.array([1], np.float16).view(np.uint8)  # the two bytes of 1.0 in fp16
ROWS_PER_CHUNK = 4096  # rows dequantized at a time while indexing (the Gemma-3 table is 262144 rows)


@dataclass(frozen=True)
class BlockType:
    """What edgec needs to know of a GGUF block type beyond what the gguf library says."""

    qbits: int  # bits per code
    block_size: int  # inputs per (sub-)block with its own step
    zero: int  # the code that stands for 0 (added back to the probe's result)
    step_at: int  # byte offset of the fp16 step d (K-quants: the super-block's)
    low_at: int | None = None  # byte offset of the fp16 minimum m (K-quants: dmin)
    scales_at: int | None = None  # byte offset of the K-quants' sub-scales
    signed_scales: bool = False  # Q6_K: 16 int8 sub-scales; Q4_K/Q5_K: 12 bytes of packed 6-bit scales and mins


BLOCK_TYPES = {
    "Q4_0": BlockType(4, 32, 8, step_at=0),
    "Q4_1": BlockType(4, 32, 0, step_at=0, low_at=2),
    "Q5_0": BlockType(5, 32, 16, step_at=0),
    "Q5_1": BlockType(5, 32, 0, step_at=0, low_at=2),
    "Q8_0": BlockType(8, 32, 128, step_at=0),  # int8 codes, read as code + 128
    "Q4_K": BlockType(4, 32, 0, step_at=0, low_at=2, scales_at=4),
    "Q5_K": BlockType(5, 32, 0, step_at=0, low_at=2, scales_at=4),
    "Q6_K": BlockType(6, 16, 32, step_at=208, scales_at=192, signed_scales=True),
}


def decode_rows(raw: np.ndarray, type_name: str) -> GridRows:
    """Raw rows of a tensor of ``type_name`` (uint8 [rows, bytes per row], as ``GGUFReader`` gives them) → their
    ``GridRows``."""
    import gguf

    kind = BLOCK_TYPES[type_name]
    qtype = gguf.GGMLQuantizationType[type_name]
    super_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, type_size)  # [rows * groups, type_size]
    step = blocks[:, kind.step_at : kind.step_at + 2].copy().view(np.float16).reshape(rows, -1)
    probe = blocks.copy()
    probe[:, kind.step_at : kind.step_at + 2] = ONE_FP16
    low_base = low_factor = step_factor = None
    if kind.low_at is not None:
        low_base = blocks[:, kind.low_at : kind.low_at + 2].copy().view(np.float16).reshape(rows, -1)
        probe[:, kind.low_at : kind.low_at + 2] = 0
    if kind.scales_at is not None:
        per_group = super_size // kind.block_size
        if kind.signed_scales:
            span = slice(kind.scales_at, kind.scales_at + per_group)
            step_factor = blocks[:, span].copy().view(np.int8).reshape(rows, -1)
            probe[:, span] = 1
        else:
            span = slice(kind.scales_at, kind.scales_at + gguf.quants.Q4_K.K_SCALE_SIZE)
            scales, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, span].copy())
            step_factor, low_factor = scales.reshape(rows, -1), mins.reshape(rows, -1)
            # sub-scales 1, mins 0: the low 6 bits of bytes 0-3 and the low nibbles of bytes 8-11 hold the scales
            probe[:, span] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    codes = gguf.quants.dequantize(probe.reshape(raw.shape), qtype).reshape(rows, -1)
    q = (np.rint(codes).astype(np.int32) + kind.zero).astype(np.uint8)
    return GridRows(
        kind.qbits,
        kind.block_size,
        kind.zero,
        q,
        step,
        step_factor,
        low_base,
        low_factor,
        low_sign=-1 if low_factor is not None else 1,
    )


def _row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class GgufBlocks:
    """The quantized rows of a GGUF file, found by their fp32 values (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.asked = self.carried = 0  # weights looked up, and found (what the build records)
        self.where: dict[bytes, tuple[int, int]] = {}  # row key → (tensor index, row)
        for index, tensor in enumerate(self.reader.tensors):
            type_name = tensor.tensor_type.name
            if type_name not in BLOCK_TYPES or len(tensor.data.shape) != 2:
                continue
            qtype = tensor.tensor_type
            for start in range(0, tensor.data.shape[0], ROWS_PER_CHUNK):
                rows = gguf.quants.dequantize(tensor.data[start : start + ROWS_PER_CHUNK], qtype)
                for offset, row in enumerate(rows):
                    self.where.setdefault(_row_key(row), (index, start + offset))

    def find(self, weight: np.ndarray) -> list[GridRows] | None:
        """The rows a constant weight [K, N] (fp32, as the graph holds it) was dequantized from: one ``GridRows``
        per run of columns of one block type, in column order; None unless every column is a quantized row of
        this file, equal bit for bit."""
        self.asked += 1
        columns = np.ascontiguousarray(weight.T)
        found = [self.where.get(_row_key(column)) for column in columns]
        if any(place is None for place in found):
            return None
        segments, start = [], 0
        type_of = lambda place: self.reader.tensors[place[0]].tensor_type.name  # noqa: E731
        for stop in range(1, len(found) + 1):
            if stop < len(found) and type_of(found[stop]) == type_of(found[start]):
                continue
            raw = np.stack([self.reader.tensors[index].data[row] for index, row in found[start:stop]])
            segment = decode_rows(raw, type_of(found[start]))
            if not np.array_equal(segment.dequantize().view(np.uint32), columns[start:stop].view(np.uint32)):
                return None
            segments.append(segment)
            start = stop
        self.carried += 1
        return segments

    def record(self) -> dict[str, object]:
        """What the build records: how many weights kept the file's blocks, and the file's tensor types."""
        types: dict[str, int] = {}
        for tensor in self.reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        return {"weights": self.asked, "carried_exactly": self.carried, "tensor_types": dict(sorted(types.items()))}
