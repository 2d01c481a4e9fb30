"""MatMul(X, Transpose(W)) with W an initializer → Gemm(X2d, W, transB=1), reshaped back.

A tied lm_head reuses the embedding table: the exporter emits ``Transpose(embed)`` feeding the lm_head MatMul,
and constant folding cannot fold it without doubling the table on disk and in memory. Left alone, ONNX Runtime
transposes the whole table (113 MB for SmolLM2) at every decode step. Gemm reads W transposed in place.
"""

from __future__ import annotations

import onnx_ir as ir

from edgec.passes._contract import Pass
from edgec.passes._graph import take_over


def _transposed_initializer(value: ir.Value | None) -> ir.Value | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Transpose" or node.domain != "":
        return None
    perm = node.attributes.get("perm")
    source = node.inputs[0]
    if perm is None or tuple(perm.as_ints()) != (1, 0) or source is None or not source.is_initializer():
        return None
    return source


def transposed_weight_gemm(model: ir.Model) -> int:
    """Rewrite in place; returns how many MatMuls were rewritten."""
    graph = model.graph
    rewritten = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain != "":
            continue
        weight = _transposed_initializer(node.inputs[1])
        if weight is None:
            continue
        x = node.inputs[0]
        transpose = node.inputs[1].producer()
        # [..., K] → [-1, K] → Gemm → [-1, N] → [..., N]
        tape = ir.tape.Tape(graph_like=graph)
        in_shape = tape.op("Shape", [x], attributes={"end": -1})
        flat_shape = tape.op(
            "Constant", [], attributes={"value": ir.tensor([-1, weight.shape[1]], dtype=ir.DataType.INT64)}
        )
        flat = tape.op("Reshape", [x, flat_shape])
        gemm = tape.op("Gemm", [flat, weight], attributes={"transB": 1})
        out_cols = tape.op("Constant", [], attributes={"value": ir.tensor([weight.shape[0]], dtype=ir.DataType.INT64)})
        out_shape = tape.op("Concat", [in_shape, out_cols], attributes={"axis": 0})
        # allowzero: the shape is the input's own, so a 0 in it is a real 0 (no logits rows asked for), not "copy
        # the input's dimension" — which would turn [0, N] into [.., N, N] and fail
        result = tape.op("Reshape", [gemm, out_shape], attributes={"allowzero": 1})
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], result)
        graph.remove(node, safe=True)
        if not transpose.outputs[0].uses():
            graph.remove(transpose, safe=True)
        rewritten += 1
    return rewritten


# the tied lm_head becomes a Gemm: passes that read MatMul weights (fp8) come first
PASS = Pass("transposed_weight_gemm", transposed_weight_gemm, removes=frozenset({"matmul_weights"}))
