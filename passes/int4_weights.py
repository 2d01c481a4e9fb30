"""Block-wise INT4 weights for every MatMul with a constant weight, the tied lm_head and the embedding table.

Round to nearest per block of ``block_size`` input channels, with a zero point unless ``symmetric``. Two forms:

- ``matmulnbits``: ``com.microsoft::MatMulNBits`` — ONNX Runtime CPU/CUDA only, the fast form there. From a GGUF
  (``source``, edgec/ggufblocks.py) every quantized tensor keeps its own codes, fp16 steps and minima, bit for
  bit: Q4_0/Q4_1/Q4_K as 4-bit codes, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as 8-bit ones (the bundle stores the file's
  narrower codes; constant ops widen them when ONNX Runtime loads the graph). Otherwise quantized here (numpy),
  grid-aware: a block whose values already lie on an affine grid of ≤ 16 levels (every block of a
  Q4_0/Q4_1 GGUF, dequantized) is carried across exactly, any other block gets min/max round-to-nearest. A block's
  minimum is not a multiple of its step in general (Q4_1), and MatMulNBits is ~50× slower with float zero points
  than with integer ones, so the weight is stored as ``(q - 8) · step`` and the per-block offset is added back by a
  small second product: ``Y = MatMulNBits(A, Q) + blocksum(A) @ offsets`` (offsets: [K/block, N], fp32). The
  embedding (``GatherBlockQuantized``) and the lm_head, the most sensitive matrices, get 8 bits per block
  (absmax/127: exact for a GGUF's Q8_0 blocks).
- ``qdq``: standard ``DequantizeLinear`` (int4, blocked along K) + ``MatMul``, the same numbers — portable
  (TensorRT-RTX reads it symmetric; ONNX Runtime also with zero points and fuses each pair into MatMulNBits).
  The embedding table stays fp32 in this form.

A tied lm_head reads the embedding through ``Transpose``; the quantizer needs a constant weight, so the transpose
is materialised first (the int4 copy costs 0.56 bytes per parameter of the table, not 4).
"""

from __future__ import annotations

import onnx_ir as ir

from edgec.blockquant import RowSource
from edgec.passes._contract import Pass
from edgec.passes._weights import (
    dequantize_linear,
    gather_block_quantized,
    materialize_transposed_weights,
    matmul_nbits,
    shared_embedding,
)

FORMS = ("matmulnbits", "qdq")
BLOCK_SIZES = (32, 64, 128)


def int4_weights(
    model: ir.Model,
    block_size: int = 32,
    symmetric: bool = False,
    form: str = "matmulnbits",
    accuracy_level: int = 4,
    embedding_bits: int = 8,
    source: RowSource | None = None,
    split_activations: bool = False,
) -> int:
    """Rewrite in place; returns how many weights were quantized. ``source``: where the weights' exact grids come
    from (a GGUF's blocks), used with the default grid (asymmetric block 32, 8-bit table). ``split_activations``:
    int8 activations as two rows each (``_weights._split_rows``), near fp32's accuracy at int8 kernels' speed."""
    if form not in FORMS or block_size not in BLOCK_SIZES:
        raise ValueError(f"form must be one of {FORMS} and block_size one of {BLOCK_SIZES}")
    materialize_transposed_weights(model)
    if form == "qdq":
        dequantize_linear(model, block_size, symmetric)
        return sum(node.op_type == "DequantizeLinear" for node in model.graph)
    carry = source if not symmetric and block_size == 32 else None
    table_source = carry if embedding_bits == 8 else None
    shared_embedding(model, block_size, symmetric, accuracy_level, embedding_bits, table_source, split_activations)
    matmul_nbits(model, block_size, symmetric, accuracy_level, 4, carry, split_activations)
    gather_block_quantized(model, block_size)
    return sum(node.op_type in ("MatMulNBits", "GatherBlockQuantized") for node in model.graph)


# rounds fp32 weights (before the fp16 conversion); takes Gemm(transB) weights too. Its MatMulNBits form is
# com.microsoft, chosen only where the target lists that form (edgec.pipeline)
PASS = Pass("int4_weights", int4_weights, requires=frozenset({"fp32"}), ensures=frozenset({"quantized_weights"}))
