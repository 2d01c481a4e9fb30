"""Where the kernel sits in the graph: ``ai.edgec::CompressedDecodeAttention``, a sub-op of the compressed op's
one-token step, and the form of ``CompressedKVAttention`` that calls it (``make_plugin_function``).

The sub-op takes the compressed op's own inputs and returns ``out`` [B,1,H,D] and the scores of every candidate
[B,Hkv,C+1] (the kernel's two outputs). It is a model-local function of standard ops — the same meaning, over
every slot (no data-dependent shape) — so ONNX Runtime runs the graph (the build validates it, any runtime can
fall back to it), and TensorRT-RTX's parser, told to let plugins override local functions, gives the node to the
plugin registered under its name (plugins/compressed_attention/plugin.py).

``CompressedKVAttention`` in plugin form: an ``If`` on T = 1 — the decode step is the sub-op plus the standard
ops that choose the slot (ArgMin over keep-scores), quantize the new token and scatter it (and a pruning
policy's threshold); any other T runs the general every-slot body (``compressed_function._general``), as the
standard lowering for TensorRT-RTX does. The slot choice and the scatter stay standard ops: they are a handful of
tiny ops over [B,Hkv,C] after the attention, and writing the state in place from a plugin would bind an output to
its input, which TensorRT does not allow.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, helper

from edgec.kvcache import compressed_function as cf
from edgec.kvcache import policies
from edgec.kvcache.compression import Compression
from edgec.kvcache.onnx_body import Body

SUB_OP = "CompressedDecodeAttention"
SUB_OUTPUTS = ("out", "score_all")
# node attributes the plugin reads as its fields (the function body has its settings baked in)
FIELDS = ("scale", "window", "storage", "group", "rule", "decay")


def settings(compression: Compression) -> dict[str, int | float]:
    """The compression settings the sub-op node carries as attributes (the plugin's fields)."""
    from edgec.plugins.compressed_attention.kernel import RULES, STORAGE_CODES, decay_of

    return {
        "storage": STORAGE_CODES[compression.dtype],
        "group": compression.group,
        "rule": RULES[compression.policy],
        "decay": decay_of(compression.policy),
    }


def make_sub_function(compression: Compression, default_opset: int, heads: cf.Heads) -> onnx.FunctionProto:
    """The sub-op's body: attention of the one query over every slot plus the new token, and the candidates'
    scores (the policy's decode rule, then +inf for protected ones) — the kernel's meaning in standard ops."""
    b = Body()
    scale = b.attribute_ref("value_float", "scale", AttributeProto.FLOAT)
    window = b.attribute_ref("value_int", "window", AttributeProto.INT)
    policy = policies.get(compression.policy)
    per_kv = heads.query // heads.kv
    capacity = b.shape("pos", 2)
    scales = ("k_scale", "v_scale") if compression.quantized else (None, None)
    old_k = cf._dequantize(b, "k_cache", scales[0], compression)  # [B,Hkv,C,D]
    old_v = cf._dequantize(b, "v_cache", scales[1], compression)
    queries = b.op("Reshape", "q", b.i64([0, heads.kv, per_kv, heads.dim]))  # [B,Hkv,G,D]
    scores_old = b.op("MatMul", queries, b.op("Transpose", old_k, perm=[0, 1, 3, 2]))  # [B,Hkv,G,C]
    scores_new = b.op("MatMul", queries, b.op("Transpose", "k", perm=[0, 1, 3, 2]))  # [B,Hkv,G,1]
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    span = b.op("Where", b.op("Greater", window, b.i64(0)), window, b.i64(cf.HUGE))
    lowest = b.op("Max", b.op("Sub", position, b.op("Sub", span, b.i64(1))), b.i64(0))
    valid = b.op("And", b.op("GreaterOrEqual", "pos", lowest), b.op("LessOrEqual", "pos", position))
    hidden = b.op("Where", valid, b.f32(0.0), b.f32(float("-inf")))
    masked_old = b.op("Add", scores_old, b.op("Unsqueeze", hidden, b.i64([2])))
    probs = b.op("Softmax", b.op("Mul", b.op("Concat", masked_old, scores_new, axis=-1), scale), axis=-1)
    probs_old = b.op("Slice", probs, b.i64([0]), capacity, b.i64([-1]))
    probs_new = b.op("Slice", probs, capacity, b.i64([cf.HUGE]), b.i64([-1]))  # [B,Hkv,G,1]
    context = b.op("Add", b.op("MatMul", probs_old, old_v), b.op("Mul", probs_new, "v"))  # [B,Hkv,G,D]
    b.named("Reshape", [context, b.i64([0, 1, heads.query, heads.dim])], "out")

    total = b.op("ReduceSum", probs, b.i64([2]), keepdims=0)  # [B,Hkv,C+1]: attention received
    stats = {"total": total, "observed": total, "last": b.op("Div", total, b.f32(float(per_kv)))}
    new_pos = b.op("Expand", position, b.i64([1, heads.kv, 1]))
    updated = policy.update_onnx(b, "score", stats, b.op("Concat", "pos", new_pos, axis=2), None)
    old_protected = b.op("And", b.op("IsInf", "score", detect_negative=0), b.op("GreaterOrEqual", "pos", b.i64(0)))
    new_protected = b.op("Expand", b.op("Unsqueeze", "protect", b.i64([1])), b.i64([1, heads.kv, 1]))
    protected = b.op("Concat", old_protected, new_protected, axis=2)
    b.named("Where", [protected, b.f32(float("inf")), updated], "score_all")
    return helper.make_function(
        cf.DOMAIN,
        SUB_OP,
        list(cf.inputs(compression, with_observe=False)),  # one token always observes
        list(SUB_OUTPUTS),
        b.nodes,
        opset_imports=[helper.make_opsetid("", default_opset)],
        attributes=["scale", *FIELDS[2:]],
        attribute_protos=[helper.make_attribute("window", 0)],
    )


def make_plugin_function(compression: Compression, default_opset: int, heads: cf.Heads) -> onnx.FunctionProto:
    """``CompressedKVAttention`` whose one-token step runs the sub-op (the plugin's node) and whose other calls run
    the general every-slot body; the same meaning as ``compressed_function.make_function``."""
    b = Body()
    scale = b.attribute_ref("value_float", "scale", AttributeProto.FLOAT)
    window = b.attribute_ref("value_int", "window", AttributeProto.INT)
    is_decode = b.op("Equal", b.op("Squeeze", b.shape("k", 2)), b.i64(1))
    branches = {}
    for kind in ("decode", "general"):
        branch = Body(prefix=f"{kind[0]}_")
        if kind == "decode":
            results = _decode(branch, compression, heads)
        else:
            results = cf._general(branch, compression, scale, window, every_slot=True)
        graph_outputs = []
        for name in cf.outputs(compression):
            # each state output takes the shape of its input, from outside the If: both branches then give
            # TensorRT-RTX one shape (else its Myelin compiler fails on the If's merged shape)
            shape = b.op("Shape", "q" if name == "out" else name[: -len("_out")])
            if name == "out":  # [B,T,H,D] from q [B,H,T,D]
                shape = b.op("Gather", shape, b.i64([0, 2, 1, 3]), axis=0)
            value = branch.op("Reshape", results[name], shape, name=f"{name}_result")
            graph_outputs.append(helper.make_tensor_value_info(value, cf._output_type(compression, name), None))
        branches[kind] = helper.make_graph(branch.nodes, f"{kind}_step", [], graph_outputs)
    b.nodes.append(
        helper.make_node(
            "If",
            [is_decode],
            list(cf.outputs(compression)),
            then_branch=branches["decode"],
            else_branch=branches["general"],
        )
    )
    function = cf._function(b, compression, default_opset, list(cf.inputs(compression)), None)
    function.opset_import.append(helper.make_opsetid(cf.DOMAIN, cf.OPSET_VERSION))  # it calls the sub-op
    return function


def _decode(b: Body, compression: Compression, heads: cf.Heads) -> dict[str, str]:
    """One token: the sub-op, then the slot choice and the writes of ``compressed_function._decode``."""
    policy = policies.get(compression.policy)
    inputs = list(cf.inputs(compression, with_observe=False))  # one token always observes
    node = helper.make_node(SUB_OP, inputs, [b.fresh("out"), b.fresh("score_all")])
    node.domain = cf.DOMAIN
    node.attribute.extend(_reference(name, kind) for name, kind in (("scale", "f"), ("window", "i")))
    node.attribute.extend(helper.make_attribute(name, value) for name, value in settings(compression).items())
    b.nodes.append(node)
    out, score_all = node.output
    capacity = b.shape("pos", 2)
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    filled = b.op("GreaterOrEqual", "pos", b.i64(0))
    score_old = b.op("Slice", score_all, b.i64([0]), capacity, b.i64([-1]))
    score_new = b.op("Slice", score_all, capacity, b.i64([cf.HUGE]), b.i64([-1]))
    # the weakest slot takes the token (always kept: it is in the recent window); protected slots score +inf
    inf = b.f32(float("inf"))
    sink = b.op("Less", "pos", b.i64(compression.sink))
    recent = b.op("Greater", "pos", b.op("Sub", position, b.i64(compression.window)))
    keep_old = b.op("Where", b.op("Or", sink, recent), inf, score_old)
    keep_old = b.op("Where", filled, keep_old, b.f32(float("-inf")))
    weakest = b.op("ArgMin", keep_old, axis=-1, keepdims=1)  # [B,Hkv,1]
    # v is read by the sub-op only, the pruning reads the old positions: the slot indices wait for them (see
    # compressed_function._general)
    replace = b.op("Expand", b.boolean(True), b.op("Shape", weakest)) if policy.prunes else None
    evicted = cf._evicted(b, weakest, replace) if policy.prunes else None
    weakest = cf._after(b, weakest, evicted) if policy.prunes else weakest
    weakest_after_out = cf._after(b, weakest, out)
    k_stored, k_scale_new = cf._quantize(b, "k", compression)
    v_stored, v_scale_new = cf._quantize(b, "v", compression)
    arriving = {"k_cache": k_stored, "v_cache": v_stored, "k_scale": k_scale_new, "v_scale": v_scale_new}
    arriving |= {"pos": b.op("Expand", position, b.i64([1, heads.kv, 1])), "score": score_new}
    current = {name: name for name in cf.state_names(compression)} | {"score": score_old}
    stored = heads.dim // 2 if compression.dtype == "int4" else heads.dim
    groups = heads.dim // compression.group
    widths = {"k_cache": stored, "v_cache": stored, "k_scale": groups, "v_scale": groups}
    written = {}
    for name in cf.state_names(compression):
        slots = weakest_after_out if name in ("v_cache", "v_scale") else weakest
        if name not in ("score", "pos"):
            slots = b.op("Expand", b.op("Unsqueeze", slots, b.i64([-1])), b.i64([1, 1, 1, widths[name]]))
        written[name] = b.op("ScatterElements", current[name], slots, arriving[name], axis=2)
    if policy.prunes:
        written["pos"] = cf._prune(b, policy, written, evicted, position, compression)
    return {"out": out} | {f"{name}_out": value for name, value in written.items()}


def _reference(name: str, kind: str) -> onnx.AttributeProto:
    """An attribute that takes the calling function node's attribute of the same name."""
    attribute = onnx.AttributeProto()
    attribute.name, attribute.ref_attr_name = name, name
    attribute.type = AttributeProto.FLOAT if kind == "f" else AttributeProto.INT
    return attribute
