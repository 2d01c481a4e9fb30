"""FP8: dynamic E4M3 activations and E4M3 weights into every MatMul; the graph runs on ONNX Runtime CPU, a
TensorRT-RTX engine builds for SM89 ahead of time, and targets without FP8 refuse it in one line."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from edgec.build import BuildSettings, build
from edgec.cli import main
from edgec.passes.fp8 import fp8
from tests.test_cli import assert_clean_failure


def one_matmul(weight: np.ndarray) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape([3, weight.shape[0]]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(weight))
    w.shape, w.type = ir.Shape(weight.shape), ir.TensorType(ir.DataType.FLOAT)
    node = ir.node("MatMul", [x, w], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 20})
    return ir.Model(graph, ir_version=10)


def simulated_fp8(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """numpy meaning: per-tensor activation scale, per-output-channel weight scale, E4M3 rounding of both."""
    fp8_round = lambda a: a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # noqa: E731
    x_scale = np.abs(x).max() / 448
    w_scale = np.abs(weight).max(0) / 448
    return (fp8_round(x / x_scale) * x_scale) @ (fp8_round(weight / w_scale) * w_scale)


def test_fp8_matmul_on_onnx_runtime_cpu_matches_numpy():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 24)).astype(np.float32)
    weight[:, 3] *= 50  # one loud output channel: its own scale keeps the others precise
    model = one_matmul(weight)
    assert fp8(model) == 1
    ops = [node.op_type for node in model.graph]
    assert ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 2
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    x = rng.standard_normal((3, 64)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    assert np.abs(y - simulated_fp8(x, weight)).max() < 1e-3 * np.abs(y).max()
    assert np.abs(y - x @ weight).max() < 0.05 * np.abs(x @ weight).max()  # E4M3: 3 mantissa bits


def test_fp8_build_for_sm89_runs_on_onnx_runtime_cpu(tiny_llama, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    result = build(tiny_llama, tmp_path / "f.edgec", BuildSettings(target="rtx4090", context=64, weights="fp8"))
    assert result.manifest["runtime"]["compute_capability"] == "8.9"
    assert (tmp_path / "f.edgec" / "engine.trt").stat().st_size > 0
    assert result.manifest["passes"]["fp8"] >= 4
    # validation ran model.onnx (the graph the engine came from) on ONNX Runtime CPU against the fp32 source
    # (a tiny random model's logits are nearly flat, so top-1 is a coin toss; SmolLM2's perplexity is the real
    # measure, in docs/BENCHMARKS.md)
    assert result.manifest["validation"]["max_abs_logit_error"] < 1.5


@pytest.mark.parametrize("target", ["rtx3060", "cpu"])
def test_fp8_elsewhere_is_one_error_line(tiny_llama, tmp_path, target):
    args = ["build", str(tiny_llama), "-o", str(tmp_path / "x"), "--target", target, "--weights", "fp8"]
    assert_clean_failure(CliRunner().invoke(main, args), "needs FP8 tensor cores")
