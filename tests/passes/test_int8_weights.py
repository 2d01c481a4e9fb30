"""Weight-only INT8 (--weights int8): every linear layer and the tied table at 8 bits, close to fp32."""

from __future__ import annotations

import numpy as np
import onnx

from edgec.build import BuildSettings, build
from edgec.runtime import Model


def test_int8_build_is_close_to_fp32(tiny_llama, tmp_path):
    settings = dict(context=64, prefill_chunk=16)
    build(tiny_llama, tmp_path / "fp32.edgec", BuildSettings(**settings))
    result = build(tiny_llama, tmp_path / "int8.edgec", BuildSettings(**settings, weights="int8"))
    graph = onnx.load(str(tmp_path / "int8.edgec" / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(a.i == 8 for n in nbits for a in n.attribute if a.name == "bits")
    assert sum(n.op_type == "GatherBlockQuantized" for n in graph.node) == 1
    assert not [n for n in graph.node if n.op_type == "MatMul"]  # no float weights left, no offset products
    ids = np.random.default_rng(9).integers(0, 384, 48).tolist()
    a, b = Model.load(tmp_path / "fp32.edgec"), Model.load(tmp_path / "int8.edgec")
    # int8 weights and int8 activations (per block, in the kernel): log-probabilities move by ~0.1 at most
    assert np.abs(a.logprobs(ids) - b.logprobs(ids)).max() < 0.25
    assert result.manifest["validation"]["top1_agreement"] == 1.0
    assert result.manifest["build_settings"]["weights"] == "int8"
