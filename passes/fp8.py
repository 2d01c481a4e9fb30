"""FP8-E4M3 weights and dynamically quantized FP8 activations for every MatMul with a constant weight.

For GPUs whose tensor cores have FP8 (compute capability 8.9 and newer: RTX 4090, L40S, RTX 5090); the build refuses
it elsewhere. Each weight is stored as FP8 with one scale per output channel (absmax/448, 448 being E4M3's largest
finite value); each activation entering the MatMul is quantized per tensor with a scale computed in the graph,
``ReduceMax(Abs(x)) / 448``, so no calibration is needed:

    y = MatMul(DequantizeLinear(QuantizeLinear(x, s_x)), DequantizeLinear(W8, s_w))

Standard ONNX Q/DQ (opset 19), so TensorRT-RTX fuses each pattern into one FP8 GEMM, and ONNX Runtime CPU runs the
same graph (slowly, dequantizing) — which is how its quality is measured on a machine without such a GPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgec.passes._contract import Pass
from edgec.passes._graph import constant, constant_weight_matmuls, take_over

E4M3_MAX = 448.0


def fp8(model: ir.Model) -> int:
    """Rewrite in place; returns how many MatMuls now take FP8 operands."""
    graph = model.graph
    zero = constant(graph, "fp8.zero_point", np.array(0, ml_dtypes.float8_e4m3fn))
    e4m3_max = constant(graph, "fp8.e4m3_max", np.array(E4M3_MAX, np.float32))
    # an all-zero activation must not give a zero scale (0/0); 1e-7 survives a later fp16 conversion
    tiny = constant(graph, "fp8.tiny_scale", np.array(1e-7, np.float32))
    count = 0
    for node, weight in constant_weight_matmuls(graph):
        array = weight.const_value.numpy()
        scale = np.abs(array).max(0) / E4M3_MAX  # per output channel (axis 1 of [K, N])
        scale[scale == 0] = 1
        stored = constant(graph, f"{weight.name}.fp8", (array / scale).astype(ml_dtypes.float8_e4m3fn))
        weight_scale = constant(graph, f"{weight.name}.fp8_scale", scale.astype(np.float32))
        tape = ir.tape.Tape(graph_like=graph)
        x = node.inputs[0]
        peak = tape.op("ReduceMax", [tape.op("Abs", [x])], attributes={"keepdims": 0})
        # CastLike: the constants follow x's dtype through the fp16 conversion that GPU targets run next
        x_scale = tape.op(
            "Max", [tape.op("Div", [peak, tape.op("CastLike", [e4m3_max, peak])]), tape.op("CastLike", [tiny, peak])]
        )
        x8 = tape.op("QuantizeLinear", [x, x_scale, zero])
        product = tape.op(
            "MatMul",
            [
                tape.op("DequantizeLinear", [x8, x_scale, zero]),
                tape.op("DequantizeLinear", [stored, weight_scale], attributes={"axis": 1}),
            ],
        )
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], product)
        graph.remove(node, safe=True)
        if not weight.uses():
            graph.initializers.pop(weight.name)
        count += 1
    return count


# reads fp32 MatMul weights: before the fp16 conversion and before the lm_head becomes a Gemm
PASS = Pass("fp8", fp8, requires=frozenset({"fp32", "matmul_weights"}), ensures=frozenset({"quantized_weights"}))
