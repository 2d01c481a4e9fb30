"""The compressed cache on fp16 targets: after the float16 pass its op still runs in fp32 (q, k, v cast up, scores
and scales kept fp32 in the state), so it chooses exactly the slots the numpy reference chooses for the same
inputs, and its output differs only by the final rounding to fp16."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgec.kvcache import compressed_function as cf
from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
from edgec.kvcache.spec import OBSERVE_INPUT, PROTECT_INPUT, CacheSpec, LayerCache, compressed_state
from edgec.passes.float16 import float16

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 16, 12
STEPS = [(0, 7), (7, 1), (8, 1), (9, 5), (14, 1), (15, 1), (16, 8), (24, 1), (25, 1)]


def _model(compression: Compression, every_slot: bool) -> tuple[ir.Model, CacheSpec]:
    """A one-layer step: CompressedKVAttention over state named as a bundle's (the spec's names)."""
    layer = LayerCache(0, KV_HEADS, HEAD_DIM, CAPACITY, compressed=True, state=compressed_state(compression))
    spec = CacheSpec((layer,), compression=compression)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    arrays = spec.empty_layer(layer)
    types = {np.dtype(np.float32): f, np.dtype(np.int64): i64, np.dtype(np.int8): TensorProto.INT8}
    types[np.dtype(np.uint8)] = TensorProto.UINT8
    state_info = {
        t.name: (types[arrays[t.name].dtype], [1, KV_HEADS, "slots", *arrays[t.name].shape[3:]])
        for t in layer.tensors()
    }
    inputs = [
        helper.make_tensor_value_info("q", f, [1, HEADS, "T", HEAD_DIM]),
        helper.make_tensor_value_info("k", f, [1, KV_HEADS, "T", HEAD_DIM]),
        helper.make_tensor_value_info("v", f, [1, KV_HEADS, "T", HEAD_DIM]),
        helper.make_tensor_value_info("position_ids", i64, [1, "T"]),
        helper.make_tensor_value_info(PROTECT_INPUT, TensorProto.BOOL, [1, "T"]),
    ]
    inputs += [helper.make_tensor_value_info(t.input, *state_info[t.name]) for t in layer.tensors()]
    inputs.append(helper.make_tensor_value_info(OBSERVE_INPUT, TensorProto.BOOL, [1]))
    outputs = [helper.make_tensor_value_info("out", f, [1, "T", HEADS, HEAD_DIM])]
    outputs += [helper.make_tensor_value_info(t.output, *state_info[t.name]) for t in layer.tensors()]
    node = helper.make_node(
        cf.OP_TYPE,
        ["q", "k", "v", "position_ids", PROTECT_INPUT, *(t.input for t in layer.tensors()), OBSERVE_INPUT],
        ["out", *(t.output for t in layer.tensors())],
        domain=cf.DOMAIN,
        scale=HEAD_DIM**-0.5,
    )
    heads = cf.Heads(HEADS, KV_HEADS, HEAD_DIM)
    proto = helper.make_model(
        helper.make_graph([node], "step", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(cf.DOMAIN, 1)],
        functions=[cf.make_function(compression, 23, heads, data_dependent_shapes=not every_slot)],
    )
    return ir.serde.deserialize_model(proto), spec


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp8", "fp32"])
@pytest.mark.parametrize("every_slot", [False, True], ids=["filled-slots", "every-slot"])
def test_fp16_graph_chooses_the_reference_slots(dtype, every_slot):
    compression = Compression(capacity=CAPACITY, sink=2, window=3, policy="snapkv", dtype=dtype, group=8, observe=4)
    model, spec = _model(compression, every_slot)
    _, spec16 = float16(model, spec)
    io = {value.name: value.dtype for value in [*model.graph.inputs, *model.graph.outputs]}
    assert io["q"] == ir.DataType.FLOAT16 and io["out"] == ir.DataType.FLOAT16  # the model around it is fp16
    for name in ("cache.0.score", "new_cache.0.score"):
        assert io[name] == ir.DataType.FLOAT  # scores stay fp32 state
    assert not [n for n in model.graph if n.op_type == "Cast" and n.inputs[0].name.startswith("cache.0.")]
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    state = reference.empty_compressed_state(KV_HEADS, CAPACITY, HEAD_DIM, compression)
    mine = {f"cache.0.{name}": value.copy() for name, value in state.items()}
    rng = np.random.default_rng(3)
    for start, count in STEPS:
        q = rng.standard_normal((1, HEADS, count, HEAD_DIM)).astype(np.float16)
        k = rng.standard_normal((1, KV_HEADS, count, HEAD_DIM)) * rng.uniform(0.2, 3, (1, KV_HEADS, count, 1))
        k = k.astype(np.float16)
        v = rng.standard_normal((1, KV_HEADS, count, HEAD_DIM)).astype(np.float16)
        positions = np.arange(start, start + count, dtype=np.int64)[None]
        protect = np.zeros_like(positions, bool)
        want_out, state = reference.compressed_kv_attention(
            q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), positions, protect, state,
            compression, scale=HEAD_DIM**-0.5,
        )  # fmt: skip
        feeds = {"q": q, "k": k, "v": v, "position_ids": positions, PROTECT_INPUT: protect} | mine
        feeds[OBSERVE_INPUT] = np.ones(1, bool)
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        mine = {name.replace("new_cache", "cache"): value for name, value in results.items() if name != "out"}
        np.testing.assert_array_equal(mine["cache.0.pos"], state["pos"], err_msg=f"slots differ at step {start}")
        np.testing.assert_allclose(mine["cache.0.score"], state["score"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(results["out"].astype(np.float32), want_out, atol=2e-3, rtol=2e-3)
