"""Weight-only INT8: every MatMul with a constant weight → ``com.microsoft::MatMulNBits`` with 8-bit blocks
(absmax/127 per block: exact for a GGUF's Q8_0 blocks), the tied embedding table stored once at 8 bits and read
by ``GatherBlockQuantized``. ONNX Runtime only. Activations are quantized to int8 per block inside the kernel
(accuracy level 4): its fp32-activation path for 8-bit weights is many times slower (see docs/BENCHMARKS.md).
The same machinery as ``int4_weights``; only the bit width differs."""

from __future__ import annotations

import onnx_ir as ir

from edgec.passes._contract import Pass
from edgec.passes._weights import (
    gather_block_quantized,
    materialize_transposed_weights,
    matmul_nbits,
    shared_embedding,
)

BLOCK_SIZES = (32, 64, 128)


def int8_weights(
    model: ir.Model, block_size: int = 32, accuracy_level: int = 4, split_activations: bool = False
) -> int:
    """Rewrite in place; returns how many weights were quantized. ``split_activations``: as in ``int4_weights``."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}")
    materialize_transposed_weights(model)
    shared_embedding(model, block_size, symmetric=True, accuracy_level=4, bits=8, split_activations=split_activations)
    matmul_nbits(
        model, block_size, symmetric=True, accuracy_level=accuracy_level, bits=8, split_activations=split_activations
    )
    gather_block_quantized(model, block_size)
    return sum(node.op_type in ("MatMulNBits", "GatherBlockQuantized") for node in model.graph)


PASS = Pass(
    "int8_weights",
    int8_weights,
    requires=frozenset({"fp32"}),
    ensures=frozenset({"quantized_weights"}),
    domains=("com.microsoft",),
)
