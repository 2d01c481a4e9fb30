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


def make_function(default_opset: int, static: bool = False) -> onnx.FunctionProto:
    """The function body; ``default_opset`` must equal the model's default-domain opset.

    Every node here runs once per layer per step, so the body is kept short: static dims come from the cache
    inputs (whose shapes ONNX Runtime folds to constants), and grouped-query attention is a 5-D broadcast
    MatMul ([B,Hkv,G,T,D] × [B,Hkv,1,D,L]) rather than a repeat of K and V.

    ``static=True`` is the body for runtimes that need every shape fixed (the CANN EP): it attends over all
    ``capacity`` slots (no data-dependent slice) and accepts *padding*, tokens at position -1 that write
    nothing (see ``_padded_scatter``).
    """
    nodes = _common_constants() + (_padded_scatter() if static else _scatter()) + _attention(static)
    # the two attribute-valued constants read the node's attributes
    for node in nodes:
        if node.output[0] in ("scale_value", "window_value"):
            kind, attribute = ("value_float", "scale") if node.output[0] == "scale_value" else ("value_int", "window")
            del node.attribute[:]
            ref = helper.make_attribute_ref(kind, AttributeProto.FLOAT if attribute == "scale" else AttributeProto.INT)
            ref.ref_attr_name = attribute
            node.attribute.append(ref)
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


def _common_constants() -> list[onnx.NodeProto]:
    return [
        _const_i64("i0", [0]),
        _const_i64("i1", [1]),
        _const_i64("i2", [2]),
        _const_i64("axes_1_3", [1, 3]),
        _const_i64("axes_2_3", [2, 3]),
        _const_i64("axes_1_2_4", [1, 2, 4]),
        _const_i64("neg1", [-1]),
        _scalar_i64("s0", 0),
        _scalar_i64("s1", 1),
        _scalar_i64("huge", 1 << 40),
        helper.make_node("Shape", ["k_cache"], ["capacity_1d"], start=2, end=3),
    ]


def _scatter() -> list[onnx.NodeProto]:
    n = helper.make_node
    return [
        # 1. slot per new token: position mod capacity (no eviction: with capacity >= context, the position)
        n("Mod", ["position_ids", "capacity_1d"], ["slot"]),  # [B,T]
        # 2. scatter k, v and positions into their slots
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
    ]


def _padded_scatter() -> list[onnx.NodeProto]:
    """Steps 1-2 for fixed-size chunks: a token at a negative position is padding and must leave the cache as it
    was. Each pad gets its own slot right after the chunk's real tokens (max position + its rank among the pads,
    mod capacity; a chunk is never longer than the capacity, so no pad shares a slot with a real token or
    another pad) and writes back what that slot already held. Duplicate scatter indices, whose result ONNX
    leaves undefined, never occur; and the cache inputs are still read (GatherElements) before they are
    written, so binding each cache input and output to one buffer stays correct."""
    n = helper.make_node
    return [
        n("Less", ["position_ids", "s0"], ["is_pad"]),  # [B,T]
        n("Cast", ["is_pad"], ["pad_count"], to=TensorProto.INT64),
        n("CumSum", ["pad_count", "s1"], ["pad_rank"]),  # 1, 2, ... along the pads
        n("ReduceMax", ["position_ids"], ["max_position"], keepdims=0),
        n("Add", ["max_position", "pad_rank"], ["pad_position"]),
        n("Where", ["is_pad", "pad_position", "position_ids"], ["write_position"]),
        n("Mod", ["write_position", "capacity_1d"], ["slot"]),  # [B,T]
        n("Shape", ["k"], ["k_shape"]),  # [B,Hkv,T,D]
        n("Unsqueeze", ["slot", "axes_1_3"], ["slot_b1t1"]),
        n("Expand", ["slot_b1t1", "k_shape"], ["slot_bhtd"]),
        n("Unsqueeze", ["is_pad", "axes_1_3"], ["pad_b1t1"]),
        n("GatherElements", ["k_cache", "slot_bhtd"], ["k_kept"], axis=2),
        n("GatherElements", ["v_cache", "slot_bhtd"], ["v_kept"], axis=2),
        n("Where", ["pad_b1t1", "k_kept", "k"], ["k_written"]),
        n("Where", ["pad_b1t1", "v_kept", "v"], ["v_written"]),
        n("ScatterElements", ["k_cache", "slot_bhtd", "k_written"], ["k_cache_out"], axis=2),
        n("ScatterElements", ["v_cache", "slot_bhtd", "v_written"], ["v_cache_out"], axis=2),
        n("Shape", ["k"], ["bht_shape"], end=3),
        n("Unsqueeze", ["slot", "i1"], ["slot_b1t"]),
        n("Expand", ["slot_b1t", "bht_shape"], ["slot_bht"]),
        n("Unsqueeze", ["position_ids", "i1"], ["pos_b1t"]),
        n("Expand", ["pos_b1t", "bht_shape"], ["pos_bht"]),
        n("Unsqueeze", ["is_pad", "i1"], ["pad_b1t"]),
        n("GatherElements", ["pos_cache", "slot_bht"], ["pos_kept"], axis=2),
        n("Where", ["pad_b1t", "pos_kept", "pos_bht"], ["pos_written"]),
        n("ScatterElements", ["pos_cache", "slot_bht", "pos_written"], ["pos_cache_out"], axis=2),
    ]


def _attention(static: bool) -> list[onnx.NodeProto]:
    n = helper.make_node
    if static:  # every slot, masked: no shape depends on the data
        active = [
            n("Identity", ["k_cache_out"], ["k_active"]),
            n("Identity", ["v_cache_out"], ["v_active"]),
            n("Identity", ["pos_cache_out"], ["pos_active"]),
        ]
    else:
        active = [
            # 3. attend over slots [0, L) only, L = min(max query position + 1, capacity): with slot = position
            #    mod capacity, a slot at or past max position + 1 is either empty or (before a wrap) in the future
            n("ReduceMax", ["position_ids"], ["max_position"], keepdims=0),
            n("Add", ["max_position", "s1"], ["after_max"]),
            n("Min", ["after_max", "capacity_1d"], ["active"]),  # [1]
            n("Slice", ["k_cache_out", "i0", "active", "i2"], ["k_active"]),
            n("Slice", ["v_cache_out", "i0", "active", "i2"], ["v_active"]),
            n("Slice", ["pos_cache_out", "i0", "active", "i2"], ["pos_active"]),
        ]
    # a pad's query sees no slot: a finite floor (the fp16 minimum) instead of -inf keeps its softmax finite
    floor = -65504.0 if static else float("-inf")
    return active + [
        # grouped-query attention in 5-D: q [B,H,T,D] -> [B,Hkv,G,T,D]; heads are kv-major as in repeat_kv
        n("Shape", ["k"], ["kv_heads_1d"], start=1, end=2),
        n("Shape", ["q"], ["t_d"], start=2),
        n("Concat", ["i0", "kv_heads_1d", "neg1", "t_d"], ["grouped_shape"], axis=0),
        n("Reshape", ["q", "grouped_shape"], ["q_grouped"]),
        n("Unsqueeze", ["k_active", "i2"], ["k_grouped"]),  # [B,Hkv,1,L,D]
        n("Unsqueeze", ["v_active", "i2"], ["v_grouped"]),
        n("Transpose", ["k_grouped"], ["k_grouped_t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q_grouped", "k_grouped_t"], ["raw_scores"]),  # [B,Hkv,G,T,L]
        n("Constant", [], ["scale_value"], value_float=0.0),
        n("CastLike", ["scale_value", "raw_scores"], ["scale_typed"]),
        n("Mul", ["raw_scores", "scale_typed"], ["scores"]),
        # mask: a slot is visible iff lowest <= key_pos <= query_pos, lowest = max(0, query_pos - window + 1);
        # empty slots hold -1 and so are never visible
        n("Unsqueeze", ["position_ids", "axes_1_2_4"], ["query_pos"]),  # [B,1,1,T,1]
        n("Unsqueeze", ["pos_active", "axes_2_3"], ["key_pos"]),  # [B,Hkv,1,1,L]
        n("Constant", [], ["window_value"], value_int=0),
        n("Greater", ["window_value", "s0"], ["has_window"]),
        n("Where", ["has_window", "window_value", "huge"], ["window_span"]),
        n("Sub", ["window_span", "s1"], ["window_back"]),
        n("Sub", ["query_pos", "window_back"], ["window_floor"]),
        n("Max", ["window_floor", "s0"], ["lowest"]),
        n("GreaterOrEqual", ["key_pos", "lowest"], ["key_recent"]),
        n("LessOrEqual", ["key_pos", "query_pos"], ["key_not_future"]),
        n("And", ["key_recent", "key_not_future"], ["valid"]),
        n("Constant", [], ["neg_inf"], value_float=floor),
        n("CastLike", ["neg_inf", "scores"], ["neg_inf_typed"]),
        n("Where", ["valid", "scores", "neg_inf_typed"], ["masked_scores"]),
        n("Softmax", ["masked_scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v_grouped"], ["out_grouped"]),  # [B,Hkv,G,T,D]
        n("Shape", ["q"], ["q_shape"]),
        n("Reshape", ["out_grouped", "q_shape"], ["out_bhtd"]),
        n("Transpose", ["out_bhtd"], ["out"], perm=[0, 2, 1, 3]),  # [B,T,H,D]
    ]


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
