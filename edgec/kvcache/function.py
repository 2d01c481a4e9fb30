"""``ai.edgec::KVAttention`` as an ONNX model-local function whose body is standard ONNX ops.

ONNX Runtime inlines the body; TensorRT-RTX's parser inlines it too; a runtime with a plugin of the same
op type may claim the node instead. The meaning is edgec/kvcache/reference.py.

Order inside the body matters for running the cache in place: the new tokens are scattered first and the
attention reads only the *scattered* cache. The cache inputs are consumed by nothing but ScatterElements,
so binding one buffer as both a cache input and its output (ORT IO binding) gives the same result as
separate buffers (tests/kvcache/test_function.py proves it).
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

DOMAIN = "ai.edgec"
OP_TYPE = "KVAttention"
OPSET_VERSION = 1
INPUTS = ("q", "k", "v", "position_ids", "k_cache", "v_cache", "pos_cache")
OUTPUTS = ("out", "k_cache_out", "v_cache_out", "pos_cache_out")
ATTRIBUTES = ("scale", "window")


def _const_i64(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def _scalar_i64(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value]))


def make_function(default_opset: int) -> onnx.FunctionProto:
    """The function body; ``default_opset`` must equal the model's default-domain opset."""
    n = helper.make_node
    nodes = [
        _const_i64("i0", [0]),
        _const_i64("i1", [1]),
        _const_i64("axes_1_3", [1, 3]),
        _const_i64("axis_2", [2]),
        _const_i64("neg1", [-1]),
        _scalar_i64("s0", 0),
        _scalar_i64("s1", 1),
        _scalar_i64("s_neg1", -1),
        _scalar_i64("huge", 1 << 40),
        # 1. slot per new token: position mod capacity
        n("Shape", ["k_cache"], ["capacity_1d"], start=2, end=3),
        n("Mod", ["position_ids", "capacity_1d"], ["slot"]),  # [B,T]
        # 2. scatter k, v, positions into their slots
        n("Shape", ["k"], ["k_shape"]),  # [B,Hkv,T,D]
        n("Unsqueeze", ["slot", "axes_1_3"], ["slot_b1t1"]),
        n("Expand", ["slot_b1t1", "k_shape"], ["slot_bhtd"]),
        n("ScatterElements", ["k_cache", "slot_bhtd", "k"], ["k_cache_out"], axis=2),
        n("ScatterElements", ["v_cache", "slot_bhtd", "v"], ["v_cache_out"], axis=2),
        n("Shape", ["k"], ["bht_shape"], end=3),
        n("Unsqueeze", ["slot", "i1"], ["slot_b1t"]),
        n("Expand", ["slot_b1t", "bht_shape"], ["slot_bht"]),
        n("Unsqueeze", ["position_ids", "i1"], ["pos_b1t"]),
        n("Expand", ["pos_b1t", "bht_shape"], ["pos_bht"]),
        n("ScatterElements", ["pos_cache", "slot_bht", "pos_bht"], ["pos_cache_out"], axis=2),
        # 3. attend over the filled prefix of slots only: L = last filled slot + 1
        n("Squeeze", ["capacity_1d"], ["capacity"]),
        n("Range", ["s0", "capacity", "s1"], ["slot_index"]),
        n("GreaterOrEqual", ["pos_cache_out", "s0"], ["filled"]),
        n("Where", ["filled", "slot_index", "s_neg1"], ["filled_index"]),
        n("ReduceMax", ["filled_index"], ["last_filled"], keepdims=0),
        n("Add", ["last_filled", "s1"], ["active"]),
        n("Unsqueeze", ["active", "i0"], ["active_1d"]),
        n("Slice", ["k_cache_out", "i0", "active_1d", "axis_2"], ["k_active"]),
        n("Slice", ["v_cache_out", "i0", "active_1d", "axis_2"], ["v_active"]),
        n("Slice", ["pos_cache_out", "i0", "active_1d", "axis_2"], ["pos_active"]),
        # grouped-query attention without repeating kv: q [B,H,T,D] -> [B,Hkv,G*T,D] (heads are kv-major)
        n("Shape", ["q"], ["q_shape"]),
        n("Shape", ["k"], ["kv_heads_1d"], start=1, end=2),
        n("Shape", ["q"], ["heads_1d"], start=1, end=2),
        n("Shape", ["q"], ["head_dim_1d"], start=3, end=4),
        n("Div", ["heads_1d", "kv_heads_1d"], ["group_1d"]),
        n("Concat", ["i0", "kv_heads_1d", "neg1", "head_dim_1d"], ["grouped_shape"], axis=0),
        n("Reshape", ["q", "grouped_shape"], ["q_grouped"]),
        n("Transpose", ["k_active"], ["k_active_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q_grouped", "k_active_t"], ["raw_scores"]),  # [B,Hkv,G*T,L]
        n("Constant", [], ["scale_value"], value_float=0.0),
        n("CastLike", ["scale_value", "raw_scores"], ["scale_typed"]),
        n("Mul", ["raw_scores", "scale_typed"], ["scores"]),
        # mask: key slot valid iff 0 <= key_pos <= query_pos (and key_pos > query_pos - window)
        n("Concat", ["i1", "group_1d"], ["tile_repeats"], axis=0),
        n("Tile", ["position_ids", "tile_repeats"], ["query_pos_rows"]),  # [B,G*T], row g*T+t -> pos t
        n("Unsqueeze", ["query_pos_rows", "axes_1_3"], ["query_pos"]),  # [B,1,G*T,1]
        n("Unsqueeze", ["pos_active", "axis_2"], ["key_pos"]),  # [B,Hkv,1,L]
        n("GreaterOrEqual", ["key_pos", "s0"], ["key_filled"]),
        n("LessOrEqual", ["key_pos", "query_pos"], ["key_not_future"]),
        n("Constant", [], ["window_value"], value_int=0),
        n("Greater", ["window_value", "s0"], ["has_window"]),
        n("Where", ["has_window", "window_value", "huge"], ["window_span"]),
        n("Sub", ["query_pos", "window_span"], ["window_floor"]),
        n("Greater", ["key_pos", "window_floor"], ["key_in_window"]),
        n("And", ["key_filled", "key_not_future"], ["valid_causal"]),
        n("And", ["valid_causal", "key_in_window"], ["valid"]),
        n("Constant", [], ["neg_inf"], value_float=float("-inf")),
        n("CastLike", ["neg_inf", "scores"], ["neg_inf_typed"]),
        n("Where", ["valid", "scores", "neg_inf_typed"], ["masked_scores"]),
        n("Softmax", ["masked_scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v_active"], ["out_grouped"]),  # [B,Hkv,G*T,D]
        n("Reshape", ["out_grouped", "q_shape"], ["out_bhtd"]),
        n("Transpose", ["out_bhtd"], ["out"], perm=[0, 2, 1, 3]),  # [B,T,H,D]
    ]
    # the two attribute-valued constants read the node's attributes
    for node in nodes:
        if node.output[0] == "scale_value":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute_ref("value_float", AttributeProto.FLOAT))
            node.attribute[0].ref_attr_name = "scale"
        elif node.output[0] == "window_value":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute_ref("value_int", AttributeProto.INT))
            node.attribute[0].ref_attr_name = "window"
    window_default = helper.make_attribute("window", 0)
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        nodes,
        opset_imports=[helper.make_opsetid("", default_opset)],
        attributes=["scale"],
        attribute_protos=[window_default],
    )


def make_schema() -> onnx.defs.OpSchema:
    """An OpSchema for the op, so tracing tools know its inputs and outputs."""
    schema = onnx.defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        inputs=[
            onnx.defs.OpSchema.FormalParameter(name, "T" if name in ("q", "k", "v", "k_cache", "v_cache") else "I")
            for name in INPUTS
        ],
        outputs=[onnx.defs.OpSchema.FormalParameter(name, "I" if name == "pos_cache_out" else "T") for name in OUTPUTS],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], "compute dtype"),
            ("I", ["tensor(int64)"], "positions"),
        ],
        attributes=[
            onnx.defs.OpSchema.Attribute("scale", onnx.defs.OpSchema.AttrType.FLOAT, "softmax scale"),
            onnx.defs.OpSchema.Attribute("window", onnx.defs.OpSchema.AttrType.INT, "sliding window, 0 = none"),
        ],
    )
    return schema
