"""Ascend (CANN EP) targets: standard ONNX only, every shape fixed, two graphs (padded prefill chunk, one-token
decode) over one weights file. No NPU here: the graphs run on ONNX Runtime's CPU provider by an explicit override
and must generate what the cpu bundle generates."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from edgec.build import BuildSettings, build
from edgec.errors import BundleError
from edgec.passes.static_shapes import dynamic_values
from edgec.runtime import Model
from tests.conftest import FP16_NEAR_TIE, assert_same_greedy, build_settings, manifest, pydoc_text

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def ascend_bundle(tmp_path_factory, tiny_llama):
    """fp32 (ascend-910b has it), so greedy tokens can be compared exactly with the fp32 cpu bundle."""
    out = tmp_path_factory.mktemp("ascend") / "tiny.ascend-910b.edgec"
    build(tiny_llama, out, BuildSettings(target="ascend-910b", context=128, prefill_chunk=16, weights="fp32"))
    return out


def _long_prompt(model: Model) -> list[int]:
    return model.encode(pydoc_text()[:400])[:45]  # three chunks of 16, the last padded


def test_graphs_are_standard_and_static(ascend_bundle):
    data = manifest(ascend_bundle)
    assert data["model"]["decode_file"] == "decode.onnx" and data["model"]["static_tokens"] == 16
    assert data["runtime"]["providers"] == ["CANNExecutionProvider"]
    assert data["runtime"]["provider_options"]["CANNExecutionProvider"]["precision_mode"] == "must_keep_origin_dtype"
    assert sorted(name for name in data["files"] if name.endswith((".onnx", ".data"))) == [
        "decode.onnx",
        "model.onnx",
        "model.onnx.data",  # one weights file, both graphs point into it
    ]
    for name, tokens in (("model.onnx", 16), ("decode.onnx", 1)):
        proto = onnx.load(str(ascend_bundle / name), load_external_data=False)
        assert not proto.functions and {node.domain for node in proto.graph.node} <= {"", "ai.onnx"}
        assert {opset.domain for opset in proto.opset_import} <= {"", "ai.onnx"}
        locations = {
            entry.value
            for tensor in proto.graph.initializer
            for entry in tensor.external_data
            if entry.key == "location"
        }
        assert locations == {"model.onnx.data"}
        assert dynamic_values(ir.load(ascend_bundle / name)) == []  # inputs, outputs and every value_info
        shapes = {value.name: [d.dim_value for d in value.type.tensor_type.shape.dim] for value in proto.graph.input}
        assert shapes["input_ids"] == [1, tokens] and shapes["logits_index"] == [tokens]


def test_same_greedy_tokens_as_the_cpu_bundle(ascend_bundle, tiny_bundle):
    cpu = Model.load(tiny_bundle)
    ascend = Model.load(ascend_bundle, providers=CPU)
    for prompt in ("The capital of France is", _long_prompt(cpu)):
        want = list(cpu.generate_ids(prompt, max_new_tokens=24))
        assert list(ascend.generate_ids(prompt, max_new_tokens=24)) == want
    ids = _long_prompt(cpu)  # every position's logits through the padded chunks
    np.testing.assert_allclose(ascend.logprobs(ids), cpu.logprobs(ids), atol=1e-4)


def test_fp16_ascend_310p_matches_greedy(tiny_llama, tiny_bundle, tmp_path):
    out = tmp_path / "tiny.ascend-310p.edgec"
    build(tiny_llama, out, BuildSettings(target="ascend-310p", context=128, prefill_chunk=16))
    assert manifest(out)["cache"]["dtype"] == "float16"
    prompt = _long_prompt(Model.load(tiny_bundle))
    ascend = Model.load(out, providers=CPU)
    assert_same_greedy(Model.load(tiny_bundle), ascend, prompt, max_new_tokens=16, near_tie=FP16_NEAR_TIE)


def test_without_the_cann_provider_it_names_the_extra(ascend_bundle):
    with pytest.raises(BundleError, match=r"CANNExecutionProvider.*pip install 'edgec\[cann\]'"):
        Model.load(ascend_bundle)


def test_compressed_cache_is_refused_before_any_work(tiny_llama, tmp_path):
    from edgec.errors import BuildSettingsError

    with pytest.raises(BuildSettingsError, match="static shapes"):
        build(tiny_llama, tmp_path / "x", build_settings(target="ascend-910b", context=128, kv_capacity=96))
    assert not (tmp_path / "x").exists()
