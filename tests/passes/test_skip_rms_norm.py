"""Add + RMSNormalization → SkipSimplifiedLayerNormalization: same outputs, no statistics outputs left named."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from edgec.passes.skip_rms_norm import skip_rms_norm

HIDDEN = 16


def residual_block(right_shape: list[int]) -> ir.Model:
    """normed = RMSNorm(left + right); outputs the normed sum and the sum itself (the next residual)."""
    floats = ir.TensorType(ir.DataType.FLOAT)
    left = ir.Value(name="left", shape=ir.Shape([1, 3, HIDDEN]), type=floats)
    right = ir.Value(name="right", shape=ir.Shape(right_shape), type=floats)
    gamma = np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)
    graph = ir.Graph([left, right], [], nodes=[], opset_imports={"": 23})
    tape = ir.tape.Tape(graph_like=graph)
    total = tape.op("Add", [left, right])
    weight = tape.initializer(ir.tensor(gamma, name="gamma"))
    normed = tape.op("RMSNormalization", [total, weight], attributes={"epsilon": 1e-6, "axis": -1})
    graph.extend(tape.nodes)
    graph.outputs.extend([normed, total])
    normed.name, total.name = "normed", "sum"
    return ir.Model(graph, ir_version=10)


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def test_fused_kernel_keeps_both_outputs_and_drops_the_statistics():
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((1, 3, HIDDEN)).astype(np.float32) for name in ("left", "right")}
    model = residual_block([1, 3, HIDDEN])
    want = run(model, feeds)
    assert skip_rms_norm(model) == 1
    (fused,) = [node for node in model.graph if node.op_type == "SkipSimplifiedLayerNormalization"]
    assert "RMSNormalization" not in [node.op_type for node in model.graph]
    # named mean / inv_std outputs make ONNX Runtime allocate and write them at every layer of every step
    (proto_node,) = [n for n in ir.serde.serialize_model(model).graph.node if n.op_type == fused.op_type]
    assert list(proto_node.output)[1:3] == ["", ""]
    for got, expected in zip(run(model, feeds), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_broadcasting_add_is_left_alone():
    model = residual_block([1, 1, HIDDEN])  # the fused kernel does not broadcast
    assert skip_rms_norm(model) == 0
    assert [node.op_type for node in model.graph] == ["Add", "RMSNormalization"]
