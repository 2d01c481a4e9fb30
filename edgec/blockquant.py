"""Block quantization of weights: the grids of the int4 and int8 passes, GPTQ and AWQ, defined once.

A weight [K, N] (input channels K, as an ONNX MatMul reads it) is cut into blocks of ``block_size`` input
channels per output; each block gets its own scale (and zero point). Round to nearest (RTN) is ``rtn_grid``:
symmetric, step absmax/7 and levels -8..7; asymmetric, min/max widened to hold 0, levels 0..15 around an integer
zero point. GPTQ and AWQ (torch, at build time) round onto these same grids, so the int4 pass finds their blocks
already on a grid and carries them exactly (``carried_grid``). ``rtn_grid`` and ``round_to_grid`` take numpy
arrays or torch tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


def _namespace(x: Any):
    """numpy or torch, whichever ``x`` belongs to (the functions below use what both spell the same)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def rtn_grid(x: Any, symmetric: bool) -> tuple[Any, Any]:
    """Per block (the last axis of ``x``): (scale, zero point) of round to nearest. A block of zeros gets scale 1."""
    xp = _namespace(x)
    if symmetric:
        scale = xp.amax(abs(x), -1) / 7
        zero = scale * 0
    else:
        low, high = xp.clip(xp.amin(x, -1), None, 0), xp.clip(xp.amax(x, -1), 0, None)
        scale = (high - low) / 15
        zero = xp.round(-low / xp.where(scale == 0, 1, scale))
    return xp.where(scale == 0, 1, scale), zero


def round_to_grid(x: Any, scale: Any, zero: Any, symmetric: bool) -> Any:
    """``x`` rounded onto the grid (scale, zero), dequantized: the values the stored int4 weight stands for."""
    xp = _namespace(x)
    low, high = (-8, 7) if symmetric else (0, 15)
    return (xp.clip(xp.round(x / scale) + zero, low, high) - zero) * scale


def rtn(weight: Any, block_size: int, symmetric: bool) -> Any:
    """weight [out, in] (a torch Linear's, or any array) rounded to nearest per block of ``block_size`` inputs."""
    grouped = weight.reshape(weight.shape[0], -1, block_size)
    scale, zero = rtn_grid(grouped, symmetric)
    return round_to_grid(grouped, scale[..., None], zero[..., None], symmetric).reshape(weight.shape)


def quantize_blocks(weight: np.ndarray, block_size: int, symmetric: bool, bits: int = 4):
    """weight [K, N] → (packed uint8 [N, blocks, block_size*bits/8], scales [N*blocks], offsets [N*blocks] or None).
    Dequantized value = (q - 2**(bits-1)) · scale + offset (MatMulNBits' default zero point, plus an offset for
    asymmetric blocks). 8 bits are symmetric: absmax/127 per block, exact for a GGUF Q8_0 block."""
    x = blocks(weight, block_size)
    if bits == 8:
        scale = np.abs(x).max(-1, keepdims=True) / 127
        scale[scale == 0] = 1
        q = (np.clip(np.rint(x / scale), -128, 127) + 128).astype(np.uint8)
        return q, scale.astype(np.float32).reshape(-1), None
    scale, low, _ = carried_grid(x, symmetric)
    if symmetric:
        q = np.clip(np.rint(x / scale), -8, 7) + 8
        offsets = None
    else:
        q = np.clip(np.rint((x - low) / scale), 0, 15)
        offsets = (low + 8 * scale).astype(np.float32).reshape(-1)
    return pack(q), scale.astype(np.float32).reshape(-1), offsets


def carried_grid(x: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block of x [N, blocks, block_size]: (step, lowest value, whether the block is already exactly on that
    grid). A block already on a grid of ≤ 16 levels — a dequantized GGUF Q4 block, or one GPTQ rounded — keeps that
    grid's step (exact); any other gets round to nearest: absmax/7 (symmetric, levels -8..7) or (max - min)/15."""
    if symmetric:
        low = np.zeros(x.shape[:-1] + (1,))
        top = np.abs(x).max(-1, keepdims=True)
        candidates = [(top / levels, levels) for levels in (7, 8, 6, 5, 4, 3, 2, 1)]  # 8: a grid reaching -8
    else:
        low = x.min(-1, keepdims=True)
        candidates = [((x.max(-1, keepdims=True) - low) / levels, levels) for levels in range(15, 0, -1)]
    scale, found = candidates[0][0], np.zeros(low.shape, bool)
    for step, _ in candidates:
        ratio = (x - low) / np.where(step == 0, 1, step)
        hit = ~found & (step > 0) & (np.abs(ratio - np.rint(ratio)) < 1e-3).all(-1, keepdims=True)
        if symmetric:  # the levels must fit -8..7
            hit &= (np.rint(ratio) >= -8).all(-1, keepdims=True) & (np.rint(ratio) <= 7).all(-1, keepdims=True)
        scale, found = np.where(hit, step, scale), found | hit
        if found.all():
            break
    scale = np.where(scale == 0, 1, scale)
    return scale, low, found | (x == 0).all(-1, keepdims=True)


def quantize_weight(weight: np.ndarray, block_size: int, symmetric: bool):
    """The 4-bit form a MatMul weight [K, N] is stored in: (packed, scales, offsets or None, zero points or None).
    Symmetric: MatMulNBits' default zero point 8. Asymmetric blocks that are all on grids keep them exactly: with
    integer zero points where each grid holds 0 at an integer level (GPTQ's), else with float offsets (a Q4_1
    block's minimum is no multiple of its step); other weights get min/max round to nearest with integer zero
    points — the form ONNX Runtime's kernels read fastest."""
    if symmetric:
        return (*quantize_blocks(weight, block_size, True), None)
    x = blocks(weight, block_size)
    scale, low, found = carried_grid(x, symmetric=False)
    if not found.all():
        packed, scales, zero_points = quantize_blocks_zero_point(weight, block_size)
        return packed, scales, None, zero_points
    zero = -low / scale
    if (np.abs(zero - np.rint(zero)) < 1e-3).all() and (np.rint(zero) >= 0).all() and (np.rint(zero) <= 15).all():
        q = np.clip(np.rint(x / scale + np.rint(zero)), 0, 15)
        zero_points = np.rint(zero)[..., 0].astype(np.uint8)
        if zero_points.shape[1] % 2:
            zero_points = np.pad(zero_points, ((0, 0), (0, 1)))
        return pack(q), scale.astype(np.float32).reshape(-1), None, pack(zero_points)
    q = np.clip(np.rint((x - low) / scale), 0, 15)
    return pack(q), scale.astype(np.float32).reshape(-1), (low + 8 * scale).astype(np.float32).reshape(-1), None


def quantize_blocks_zero_point(weight: np.ndarray, block_size: int):
    """4-bit round to nearest (``rtn_grid``) with an integer zero point per block (the form ``GatherBlockQuantized``
    and the fast MatMulNBits kernels read): weight [K, N] → (packed [N, blocks, block_size/2], scales [N*blocks],
    zero points [N, ceil(blocks/2)] packed two per byte). Dequantized value = (q - zero_point) · scale."""
    x = blocks(weight, block_size)
    scale, zero_point = rtn_grid(x, symmetric=False)
    scale, zero_point = scale[..., None], zero_point[..., None]
    q = np.clip(np.rint(x / scale) + zero_point, 0, 15)
    zero_point = zero_point[..., 0].astype(np.uint8)
    if zero_point.shape[1] % 2:
        zero_point = np.pad(zero_point, ((0, 0), (0, 1)))
    return pack(q), scale.astype(np.float32).reshape(-1), pack(zero_point)


def blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """weight [K, N] → float64 [N, blocks, block_size], the last block padded with zeros."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    return padded.T.reshape(n, blocks, block_size).astype(np.float64)


def pack(q: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte along the last axis, low nibble first."""
    q = q.astype(np.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(packed: np.ndarray, rows: int) -> np.ndarray:
    """Packed 4-bit values [N, ..., bytes] (low nibble first) → [rows, N]: the first ``rows`` values of each of
    the N rows, transposed (the padding of a last partial block dropped)."""
    n = packed.shape[0]
    values = np.stack([packed & 15, packed >> 4], -1).reshape(n, -1)
    return np.ascontiguousarray(values[:, :rows].T)


# --- Exact grids given by a source (a GGUF's quantized blocks) -------------------------------------------------


@dataclass(frozen=True)
class GridRows:
    """Rows of a weight defined exactly by integer codes on per-block grids, as a GGUF's quantized blocks define
    them: row r, block b, code q (0 .. 2**qbits - 1): value = scale[r, b] · (q - zero) + low[r, b], where
    scale = step[r, g] · step_factor[r, b] and low = low_sign · low_base[r, g] · low_factor[r, b] (g: the block's
    group, a K-quant super-block; a factor left out is 1, a low left out is 0). Every stored number is the
    source's own (fp16 steps and minima, small-integer sub-scales), so the products are exact in fp32."""

    qbits: int  # 4, 5, 6 or 8
    block_size: int  # inputs per block (32; 16 for Q6_K)
    zero: int  # the code that stands for 0 (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q8_0: 128, with a minimum: 0)
    q: np.ndarray  # uint8 [rows, cols]
    step: np.ndarray  # float16 [rows, groups]
    step_factor: np.ndarray | None = None  # integer [rows, blocks]
    low_base: np.ndarray | None = None  # float16 [rows, groups]
    low_factor: np.ndarray | None = None  # integer [rows, blocks]
    low_sign: int = 1

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def blocks(self) -> int:
        return self.q.shape[1] // self.block_size

    def _per_block(self, base: np.ndarray, factor: np.ndarray | None) -> np.ndarray:
        per_block = np.repeat(base.astype(np.float64), self.blocks // base.shape[1], axis=1)
        return per_block if factor is None else per_block * factor

    def scales(self) -> np.ndarray:
        """float64 [rows, blocks], exact."""
        return self._per_block(self.step, self.step_factor)

    def lows(self) -> np.ndarray:
        """float64 [rows, blocks], exact (zeros without a minimum)."""
        if self.low_base is None:
            return np.zeros((self.rows, self.blocks))
        return self.low_sign * self._per_block(self.low_base, self.low_factor)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: each value computed exactly, rounded once (what the source's own dequantizer
        gives: its products of an fp16 step, a sub-scale and a code are exact in fp32)."""
        q = self.q.reshape(self.rows, self.blocks, self.block_size).astype(np.float64) - self.zero
        values = q * self.scales()[..., None]
        if self.low_base is not None:  # not adding a zero keeps the sign of a -0.0, as the source's dequantizer
            values += self.lows()[..., None]
        return values.reshape(self.rows, -1).astype(np.float32)

    def stored(self) -> dict[str, np.ndarray]:
        """What a bundle stores for these rows, the source's own numbers at their own width: ``codes`` (the low 4
        bits of each code packed two per byte, low nibble first, as MatMulNBits reads them: uint8 [rows, blocks,
        block_size/2]; 8-bit codes as they are: [rows, blocks, block_size]), ``high`` (the bits above the low 4,
        packed 8/(qbits-4) per byte, lowest first), ``step`` and ``low_base`` (fp16) and the integer factors."""
        q = self.q.reshape(self.rows, self.blocks, self.block_size)
        arrays = {"codes": q if self.qbits == 8 else pack(q & 15)}
        if self.qbits in (5, 6):
            width = self.qbits - 4
            per_byte = 8 // width
            high = (q >> 4).reshape(self.rows, self.blocks, -1, per_byte).astype(np.uint8)
            arrays["high"] = np.bitwise_or.reduce(high << (width * np.arange(per_byte, dtype=np.uint8)), axis=-1)
        named = {"step": self.step, "step_factor": self.step_factor}
        named |= {"low_base": self.low_base, "low_factor": self.low_factor}
        return arrays | {key: value for key, value in named.items() if value is not None}

    def take(self, rows: np.ndarray) -> GridRows:
        """These rows only, in this order."""
        pick = lambda array: None if array is None else array[rows]  # noqa: E731
        return GridRows(
            self.qbits,
            self.block_size,
            self.zero,
            self.q[rows],
            self.step[rows],
            pick(self.step_factor),
            pick(self.low_base),
            pick(self.low_factor),
            self.low_sign,
        )


class RowSource(Protocol):
    """Where the exact grids of a build's weights come from (``edgec.ggufblocks.GgufBlocks`` for a GGUF)."""

    def find(self, weight: np.ndarray) -> list[GridRows] | None:
        """The ``GridRows`` whose rows are the columns of ``weight`` [K, N], in order; None if it has none."""


@dataclass(frozen=True)
class CarriedWeight:
    """A weight [K, N] (its N columns: the rows of ``segments``, in order) in the form MatMulNBits computes it
    exactly: ``bits``-wide codes c per block of ``block_size`` inputs, value = (c - 2**(bits-1)) · scale +
    offset, the offset added by the ``blocksum(A) @ offsets`` product when ``offsets``. 4-bit codes where every
    segment has 4-bit codes and each block's offset low + (8 - zero) · scale is exact in fp32; otherwise 8-bit
    codes (code = q + 128 - zero, offset = low: exact by construction)."""

    bits: int
    block_size: int
    segments: tuple[GridRows, ...]
    offsets: bool

    def code_bias(self, segment: GridRows) -> int:
        """What the graph adds to a segment's codes q to make the kernel's codes."""
        return 0 if self.bits == 4 else 128 - segment.zero

    def offset_step(self, segment: GridRows) -> int:
        """How many steps the offset adds back: the kernel subtracts 2**(bits-1), the source ``zero``."""
        return 8 - segment.zero if self.bits == 4 else 0

    def kernel_numbers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes uint8 [N, blocks, block_size], scales float32 [N, blocks], offsets float32 [N, blocks] or None):
        the numbers the graph computes from what the bundle stores (the reference its folded constants are
        checked against)."""
        codes, scales, offsets = [], [], []
        for segment in self.segments:
            repeat = segment.block_size // self.block_size
            codes.append(segment.q.astype(np.int32) + self.code_bias(segment))
            scale = np.repeat(segment.scales(), repeat, axis=1)
            scales.append(scale)
            offsets.append(np.repeat(segment.lows(), repeat, axis=1) + self.offset_step(segment) * scale)
        n = sum(segment.rows for segment in self.segments)
        codes = np.concatenate(codes).astype(np.uint8).reshape(n, -1, self.block_size)
        offsets = np.concatenate(offsets).astype(np.float32) if self.offsets else None
        return codes, np.concatenate(scales).astype(np.float32), offsets

    def dequantize(self) -> np.ndarray:
        """float32 [K, N]: the weight as the kernel's numbers define it, each value computed exactly and rounded
        once (equal bit for bit to the source's dequantization when the import is exact)."""
        codes, scales, offsets = self.kernel_numbers()
        values = (codes.astype(np.float64) - 2 ** (self.bits - 1)) * scales[..., None]
        if offsets is not None:
            values += offsets[..., None]
        return values.reshape(codes.shape[0], -1).T.astype(np.float32)


def carried_weight(segments: list[GridRows]) -> CarriedWeight:
    """The MatMulNBits form of a weight whose columns are ``segments``' rows (see ``CarriedWeight``)."""
    block_size = min(segment.block_size for segment in segments)
    four_bit = all(segment.qbits == 4 for segment in segments)
    if four_bit:  # the 4-bit offset adds (8 - zero) steps to the minimum: exact in fp32 for (nearly) every block
        for segment in segments:
            exact = segment.lows() + (8 - segment.zero) * segment.scales()
            four_bit &= bool((exact.astype(np.float32) == exact).all())
    bits = 4 if four_bit else 8
    offsets = any(segment.low_base is not None or (bits == 4 and segment.zero != 8) for segment in segments)
    return CarriedWeight(bits, block_size, tuple(segments), offsets)
