"""Add(residual, x) → RMSNormalization  ⇒  com.microsoft::SkipSimplifiedLayerNormalization (ONNX Runtime only).

Every decoder layer adds a residual and normalises the sum twice; ORT's fused kernel does both in one pass over
the hidden state and also returns the sum for the next residual. ORT's own optimizer only fuses this from the
older decomposed RMS pattern, not from the opset-23 RMSNormalization the exporter emits.
"""

from __future__ import annotations

import onnx_ir as ir

from edgec.passes._contract import Pass
from edgec.passes._graph import take_over


def skip_rms_norm(model: ir.Model) -> int:
    """Rewrite in place; returns how many Add + RMSNormalization pairs were fused."""
    graph = model.graph
    fused = 0
    for norm in list(graph):
        if norm.op_type != "RMSNormalization" or norm.domain != "":
            continue
        add = norm.inputs[0].producer()
        axis = norm.attributes.get("axis")
        if add is None or add.op_type != "Add" or add.domain != "" or (axis is not None and axis.as_int() != -1):
            continue
        left, right = add.inputs
        if left is None or right is None or left.shape is None or right.shape != left.shape or len(left.shape) != 3:
            continue  # the fused kernel does not broadcast
        epsilon = norm.attributes.get("epsilon")
        tape = ir.tape.Tape(graph_like=graph)
        outputs = tape.op_multi_out(
            "SkipSimplifiedLayerNormalization",
            [left, right, norm.inputs[1]],
            attributes={"epsilon": epsilon.as_float() if epsilon is not None else 1e-5},
            domain="com.microsoft",
            num_outputs=4,
        )
        for unused in outputs[1:3]:  # mean and 1/std: named, ORT would allocate and write them at every node
            unused.name = ""
        graph.insert_before(add, tape.nodes)
        take_over(norm.outputs[0], outputs[0])
        take_over(add.outputs[0], outputs[3])
        graph.remove(norm, safe=True)
        graph.remove(add, safe=True)
        fused += 1
    if fused:
        model.opset_imports.setdefault("com.microsoft", 1)
    return fused


PASS = Pass("skip_rms_norm", skip_rms_norm, domains=("com.microsoft",))
