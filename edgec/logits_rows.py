"""Whether a step graph computes no logits when a chunk asks for none (an empty ``logits_index``).

A prompt's chunks before its last need no logits, yet each one computed a row: the lm_head reads its whole weight
for it (Gemma-3-270m's 262,144 × 640 fp32 table: 25–35 ms a chunk, ~5 % of an 8K prompt). A graph whose logits path
keeps a zero-row dimension lets the runtime ask for none (the manifest's ``model.no_logits_rows``, written by the
build from this check). The path from ``logits_index`` to ``logits`` is gathers, products and element-wise ops,
which all take zero rows; only a Reshape can break it: one whose target shape is computed (from a Shape) reads a 0
as "copy the input's dimension" unless ``allowzero`` is set (passes/transposed_weight_gemm.py sets it).
"""

from __future__ import annotations

import onnx_ir as ir

INDEX, LOGITS = "logits_index", "logits"
_BRANCHING = {"If", "Loop", "Scan"}  # subgraphs the walk does not follow: not known to be safe


def takes_no_rows(model: ir.Model) -> bool:
    """True when every node downstream of ``logits_index`` keeps a zero dimension (see the module's note)."""
    graph = model.graph
    index = next((value for value in graph.inputs if value.name == INDEX), None)
    if index is None or not any(value.name == LOGITS for value in graph.outputs):
        return False
    seen: set[int] = set()
    pending = [index]
    while pending:
        value = pending.pop()
        for node, _ in value.uses():
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type in _BRANCHING or (node.op_type == "Reshape" and not _keeps_zero(node)):
                return False
            pending.extend(node.outputs)
    return True


def _keeps_zero(reshape: ir.Node) -> bool:
    """A Reshape keeps a zero-row input zero-row: with ``allowzero``, or a constant target shape without a 0
    (a -1 there is inferred as 0 rows; a 0 would copy the input's dimension)."""
    allowzero = reshape.attributes.get("allowzero")
    if allowzero is not None and allowzero.as_int() == 1:
        return True
    shape = reshape.inputs[1] if len(reshape.inputs) > 1 else None
    constant = ir.convenience.get_const_tensor(shape) if shape is not None else None
    return constant is not None and 0 not in constant.numpy().tolist()
