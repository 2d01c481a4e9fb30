"""TensorRT-RTX targets: the engine is built ahead of time here (no GPU), for the target's compute capability.
Loading it needs a GPU: that is benchmarks/gpu_check.sh, run when a GPU is lent."""

from __future__ import annotations

import json

import onnx
import pytest

from edgec.build import BuildSettings, build
from edgec.errors import BundleError
from edgec.runtime import Model

trt = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install 'edgec[tensorrt-rtx]')")


@pytest.mark.parametrize("target,capability", [("rtx3060", "8.6"), ("rtx4090", "8.9"), ("rtx5090", "12.0")])
def test_engine_is_built_ahead_of_time(target, capability, tiny_llama, tmp_path):
    out = tmp_path / f"tiny.{target}.edgec"
    build(tiny_llama, out, BuildSettings(target=target, context=64))
    manifest = json.loads((out / "manifest.json").read_text())
    runtime = manifest["runtime"]
    assert runtime["library"] == "tensorrt_rtx" and runtime["version"] == trt.__version__
    assert runtime["compute_capability"] == capability
    assert (out / "engine.trt").stat().st_size > 100_000 and "engine.trt" in manifest["files"]
    # the ONNX it came from travels along: fp16, standard ops only (KVAttention's body inlined here)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert not [n for n in graph.graph.node if n.domain] and not graph.functions
    assert manifest["cache"]["dtype"] == "float16"
    assert manifest["validation"]["top1_agreement"] == 1.0  # that ONNX on ORT CPU vs the fp32 source


def test_loading_needs_a_gpu_and_says_so(tiny_llama, tmp_path):
    out = tmp_path / "tiny.rtx3060.edgec"
    build(tiny_llama, out, BuildSettings(target="rtx3060", context=64))
    with pytest.raises(BundleError, match="TensorRT-RTX|CUDA|GPU"):
        Model.load(out)


def test_int4_engine_is_built_from_symmetric_dequantize_linear(tiny_llama, tmp_path):
    """--weights int4 on a TensorRT target: INT4 DequantizeLinear without zero points (what TensorRT reads), block
    along K, the engine built ahead of time from it."""
    out = tmp_path / "tiny.int4.edgec"
    build(tiny_llama, out, BuildSettings(target="rtx3060", context=64, weights="int4"))
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    dequantize = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    initializers = {i.name: i for i in graph.initializer}
    assert dequantize and all(len(n.input) == 2 for n in dequantize)
    assert {initializers[n.input[0]].data_type for n in dequantize} == {onnx.TensorProto.INT4}
    assert (out / "engine.trt").stat().st_size > 50_000
