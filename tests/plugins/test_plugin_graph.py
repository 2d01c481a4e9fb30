"""The plugin form of the compressed op in ONNX (plugins/compressed_attention/graph.py), run by ONNX Runtime:
the whole op (sub-op for one token, general body otherwise) against the numpy reference over steps that fill
the cache, evict and read chunks, for every storage dtype and policy; and the sub-op's standard-op body against
the interpreted kernel — the two implementations TensorRT-RTX chooses between."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgec.kvcache import compressed_function as cf
from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
from tests.kvcache.test_compressed import STEPS, _run, _session, compressed_model
from tests.plugins.test_decode_kernel import OUT_ATOL, SCORE_ATOL, SCORE_RTOL, kernel_inputs, random_case

graph = pytest.importorskip("edgec.plugins.compressed_attention.graph", reason="needs triton (edgec[dev])")
kernel = pytest.importorskip("edgec.plugins.compressed_attention.kernel", reason="needs triton (edgec[dev])")


def plugin_model(heads, kv_heads, head_dim, capacity, compression, scale, window=0) -> onnx.ModelProto:
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale, window)
    layout = cf.Heads(heads, kv_heads, head_dim)
    del model.functions[:]
    model.functions.extend(
        [graph.make_plugin_function(compression, 23, layout), graph.make_sub_function(compression, 23, layout)]
    )
    return model


@pytest.mark.parametrize(
    "dtype,policy",
    [("fp16", "snapkv"), ("int8", "h2o"), ("fp8", "tova"), ("int4", "adaptive"), ("fp32", "streaming")],
)
def test_plugin_form_equals_the_reference(dtype, policy):
    heads, kv_heads, head_dim, capacity = 6, 3, 32, 16
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = plugin_model(heads, kv_heads, head_dim, capacity, compression, scale=head_dim**-0.5)
    onnx.checker.check_model(model, full_check=True)
    branch = next(a.g for a in model.functions[0].node[-1].attribute if a.name == "then_branch")
    decode_nodes = [n for n in branch.node if n.op_type == graph.SUB_OP]
    assert len(decode_nodes) == 1 and decode_nodes[0].domain == cf.DOMAIN
    _run(_session(model), compression, heads, kv_heads, head_dim, capacity, STEPS, seed=len(dtype + policy))


def sub_op_model(heads, kv_heads, head_dim, capacity, compression, scale, window) -> onnx.ModelProto:
    """One sub-op node, its inputs and its two outputs."""
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale, window)
    node = model.graph.node[0]
    node.op_type = graph.SUB_OP
    # the sub-op runs one-token steps only, which always observe: it takes no `observe`
    del node.input[len(cf.inputs(compression, with_observe=False)) :]
    model.graph.input.remove(next(value for value in model.graph.input if value.name == "observe"))
    del node.output[:]
    node.output.extend(graph.SUB_OUTPUTS)
    node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in graph.settings(compression).items())
    del model.graph.output[:]
    f = onnx.TensorProto.FLOAT
    model.graph.output.extend(
        [
            onnx.helper.make_tensor_value_info("out", f, [1, 1, heads, head_dim]),
            onnx.helper.make_tensor_value_info("score_all", f, [1, kv_heads, capacity + 1]),
        ]
    )
    del model.functions[:]
    model.functions.append(graph.make_sub_function(compression, 23, cf.Heads(heads, kv_heads, head_dim)))
    return model


@pytest.mark.parametrize("dtype", ["fp16", "int8", "fp8", "int4"])
def test_sub_op_body_equals_the_kernel(dtype):
    rng = np.random.default_rng()
    shape = (1, 6, 2, 32, 24)
    for policy, window in (("snapkv", 0), ("tova", 24), ("streaming", 0)):
        compression = Compression(capacity=24, sink=2, window=4, policy=policy, dtype=dtype, group=16)
        q, k, v, position_ids, protect, state = random_case(rng, shape, compression, window, "empty_head")
        model = sub_op_model(6, 2, 32, 24, compression, 0.2, window)
        onnx.checker.check_model(model, full_check=True)
        feeds = {"q": q, "k": k, "v": v, "position_ids": position_ids, "protect": protect}
        feeds |= {cf.FORMAL.get(name, name): value for name, value in state.items()}
        body_out, body_scores = _session(model).run(None, feeds)
        config = kernel.Config(2, 3, 32, dtype, 16, policy)
        out, scores = kernel.run_numpy(config, kernel_inputs(q, k, v, position_ids, protect, state), 0.2, window)
        np.testing.assert_allclose(out, body_out, rtol=0, atol=OUT_ATOL)
        np.testing.assert_allclose(scores, body_scores, rtol=SCORE_RTOL, atol=SCORE_ATOL)
        want, _ = reference.compressed_kv_attention(q, k, v, position_ids, protect, state, compression, 0.2, window)
        np.testing.assert_allclose(body_out, want, rtol=0, atol=OUT_ATOL)
