"""Fuse MatMuls that read the same activation with constant weights (q/k/v, gate/up) into one MatMul + Split.

A decode step is a chain of small matrix-vector products; each MatMul pays a thread-pool dispatch, so three
projections of one hidden state cost more as three calls than as one wider call. Same bytes, fewer calls.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from edgec.passes._contract import Pass


def _constant_weight(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or not value.is_initializer() or len(value.uses()) != 1:
        return None
    array = value.const_value.numpy()
    return array if array.ndim == 2 else None


def fuse_projections(model: ir.Model) -> int:
    """Rewrite in place; returns how many MatMul groups were fused."""
    graph = model.graph
    groups: dict[ir.Value, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if node.op_type == "MatMul" and node.domain == "" and _constant_weight(node.inputs[1]) is not None:
            groups[node.inputs[0]].append(node)
    fused = 0
    for x, nodes in groups.items():
        if len(nodes) < 2:
            continue
        weights = [_constant_weight(node.inputs[1]) for node in nodes]
        if len({w.shape[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            continue
        first = nodes[0]
        concatenated = ir.Value(name=f"{first.inputs[1].name}.fused", const_value=ir.tensor(np.concatenate(weights, 1)))
        concatenated.shape = ir.Shape(concatenated.const_value.shape)
        concatenated.type = ir.TensorType(concatenated.const_value.dtype)
        graph.register_initializer(concatenated)
        sizes = ir.Value(
            name=f"{first.inputs[1].name}.fused_sizes",
            const_value=ir.tensor(np.array([w.shape[1] for w in weights], np.int64)),
        )
        sizes.shape, sizes.type = ir.Shape([len(weights)]), ir.TensorType(ir.DataType.INT64)
        graph.register_initializer(sizes)
        tape = ir.tape.Tape(graph_like=graph)
        product = tape.op("MatMul", [x, concatenated])
        parts = tape.op_multi_out("Split", [product, sizes], attributes={"axis": -1}, num_outputs=len(nodes))
        graph.insert_before(first, tape.nodes)
        for node, part in zip(nodes, parts, strict=True):
            part.shape, part.type = node.outputs[0].shape, node.outputs[0].type
            old_weight = node.inputs[1]
            node.outputs[0].replace_all_uses_with(part)
            graph.remove(node, safe=True)
            graph.initializers.pop(old_weight.name)
        fused += 1
    return fused


PASS = Pass("fuse_projections", fuse_projections, requires=frozenset({"matmul_weights"}))
