"""The cache's optional rotation: an orthogonal transform of every key and value before it is stored.

A low-bit cache rounds each group of channels to a grid set by the group's largest value; a few outlier channels
(common in keys) make that grid coarse for all the others. Rotating each head's vectors by R = diag(s)·H/√D — a
Hadamard matrix H with a random ±1 sign per channel s (per KV head) — spreads every outlier over all channels
before rounding (QuaRot, llama.cpp's rotated cache), and changes nothing else: R is orthogonal, so

    (q R)·(k R)ᵀ = q·kᵀ        attention scores, hence probabilities and every policy's scores, are the same
    Σ p (v R) = (Σ p v) R      the output, rotated back by Rᵀ = H·diag(s)/√D (H is symmetric)

The queries are rotated with their KV head's R. Storage holds rotated values; nothing outside the op reads them.
The signs come from SHA-256 of (seed, head): the same on every machine and numpy release, recorded in the bundle
as the settings ``rotation`` and ``rotation_seed``. Row vectors throughout: x' = (x ⊙ s) @ H/√D.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROTATIONS = ("none", "hadamard")


def usable(head_dim: int) -> bool:
    """Sylvester's construction: a power of two."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def hadamard(head_dim: int) -> np.ndarray:
    """The normalized Hadamard matrix [D, D] float32 (symmetric, orthogonal, entries ±1/√D)."""
    if not usable(head_dim):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {head_dim}")
    matrix = np.ones((1, 1), np.float64)
    while matrix.shape[0] < head_dim:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return (matrix / np.sqrt(head_dim)).astype(np.float32)


def signs(seed: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """[Hkv, D] float32 of ±1: bit i of SHA-256(f"edgec-kv-rotation/{seed}/{head}/{block}") stream."""
    rows = []
    for head in range(kv_heads):
        stream = b""
        block = 0
        while len(stream) * 8 < head_dim:
            stream += hashlib.sha256(f"edgec-kv-rotation/{seed}/{head}/{block}".encode()).digest()
            block += 1
        bits = np.unpackbits(np.frombuffer(stream, np.uint8))[:head_dim]
        rows.append(1.0 - 2.0 * bits)
    return np.asarray(rows, np.float32)


def rotate(x: np.ndarray, head_signs: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """x [B, heads, T, D] with one sign row per head [heads, D] → (x ⊙ s) @ H/√D, float32."""
    return (x.astype(np.float32) * head_signs[None, :, None, :]) @ matrix


def unrotate(y: np.ndarray, head_signs: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """The inverse of ``rotate`` for y [B, T, heads, D] (the op's output layout): (y @ H/√D) ⊙ s."""
    return (y.astype(np.float32) @ matrix) * head_signs[None, None, :, :]
