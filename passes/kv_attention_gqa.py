"""Lower ``ai.edgec::KVAttention`` to ONNX Runtime's fused ``com.microsoft::GroupQueryAttention`` (ORT targets).

Valid only for an uncompressed cache (no eviction, float storage, global attention): then slot = position, so
the slot cache *is* GQA's shared past/present buffer of length ``capacity``, and GQA's write offset
(``seqlens_k + 1 - T``) equals the first new position because the runtime feeds positions contiguously from 0.
The ``pos`` state keeps its meaning (scattered as in the function body), so a lowered bundle and a portable one
hold identical cache state. Layers that do not qualify keep the portable function body.

Why: the function body is ~40 small nodes per layer; on a 2-core CPU their dispatch overhead costs a quarter of
a decode step. One fused kernel per layer removes it.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common

from edgec.kvcache import function as kv_function


def _i64(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(values, dtype=ir.DataType.INT64)})


def kv_attention_gqa(model: ir.Model) -> int:
    """Rewrite in place; returns how many KVAttention nodes were lowered."""
    graph = model.graph
    targets = [
        node
        for node in graph
        if node.domain == kv_function.DOMAIN
        and node.op_type == kv_function.OP_TYPE
        and node.attributes.get("window", ir.AttrInt64("window", 0)).as_int() == 0
    ]
    if not targets:
        return 0
    position_ids = targets[0].inputs[3]
    tape = ir.tape.Tape(graph_like=graph)
    # shared by every layer: GQA wants the index of the last token (total - 1) and the total length, int32
    last = tape.op("ReduceMax", [position_ids, _i64(tape, [1])], attributes={"keepdims": 0})
    seqlens_k = tape.op("Cast", [last], attributes={"to": ir.DataType.INT32})
    total = tape.op(
        "Cast",
        [tape.op("Add", [tape.op("ReduceMax", [last], attributes={"keepdims": 0}), _i64(tape, [1])])],
        attributes={"to": ir.DataType.INT32},
    )
    graph.insert_before(targets[0], tape.nodes)
    for node in targets:
        _lower(graph, node, seqlens_k, total)
    model.opset_imports.setdefault("com.microsoft", 1)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # the head splits and 4-D rotaries no longer used
    return len(targets)


def _lower(graph: ir.Graph, node: ir.Node, seqlens_k: ir.Value, total: ir.Value) -> None:
    q, k, v, position_ids, k_cache, v_cache, pos_cache = node.inputs
    num_heads, head_dim = q.shape[1], q.shape[3]
    num_kv_heads = k_cache.shape[1]
    tape = ir.tape.Tape(graph_like=graph)
    flat = _i64(tape, [0, 0, -1])

    def bsh(x: ir.Value) -> ir.Value:  # [B,N,T,D] -> [B,T,N*D]
        return _unheaded(tape, x) or tape.op(
            "Reshape", [tape.op("Transpose", [x], attributes={"perm": [0, 2, 1, 3]}), flat]
        )

    out, present_k, present_v = tape.op_multi_out(
        "GroupQueryAttention",
        [bsh(q), bsh(k), bsh(v), k_cache, v_cache, seqlens_k, total],
        attributes={
            "num_heads": num_heads,
            "kv_num_heads": num_kv_heads,
            "scale": node.attributes["scale"].as_float(),
        },
        domain="com.microsoft",
        num_outputs=3,
    )
    out4 = tape.op("Reshape", [out, _i64(tape, [0, 0, num_heads, head_dim])])
    # pos state: slot = position (capacity >= context), scattered exactly as the function body does
    slot_bht = tape.op(
        "Expand", [tape.op("Unsqueeze", [position_ids, _i64(tape, [1])]), _i64(tape, [1, num_kv_heads, 1])]
    )
    pos_out = tape.op("ScatterElements", [pos_cache, slot_bht, slot_bht], attributes={"axis": 2})
    graph.insert_before(node, tape.nodes)
    for old, new in zip(node.outputs, (out4, present_k, present_v, pos_out), strict=True):
        name, old_type, old_shape = old.name, old.type, old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{name}__lowered"
        new.name, new.type, new.shape = name, old_type, old_shape
    graph.remove(node, safe=True)


def _head_split_source(x: ir.Value | None) -> ir.Value | None:
    """x = Transpose(Reshape(y3, [B,T,N,D]), [0,2,1,3]) with y3 of rank 3 → y3 (the model's own [B,T,N*D])."""
    transpose = x.producer() if x is not None else None
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain != "":
        return None
    perm = transpose.attributes.get("perm")
    reshape = transpose.inputs[0].producer() if transpose.inputs[0] is not None else None
    if perm is None or tuple(perm.as_ints()) != (0, 2, 1, 3) or reshape is None or reshape.op_type != "Reshape":
        return None
    source = reshape.inputs[0]
    return source if source is not None and source.shape is not None and len(source.shape) == 3 else None


def _unheaded(tape: ir.tape.Tape, x: ir.Value) -> ir.Value | None:
    """The [B,T,N*D] form of a [B,N,T,D] input without moving data, when the graph allows it: undo the model's
    head split, and for RotaryEmbedding apply it to the 3-D source instead (it takes num_heads for that)."""
    source = _head_split_source(x)
    if source is not None:
        return source
    rotary = x.producer()
    if rotary is None or rotary.op_type != "RotaryEmbedding" or rotary.domain != "" or x.shape is None:
        return None
    source = _head_split_source(rotary.inputs[0])
    if source is None:
        return None
    attributes = {name: attr.value for name, attr in rotary.attributes.items()}
    attributes["num_heads"] = x.shape[1]
    return tape.op("RotaryEmbedding", [source, *rotary.inputs[1:]], attributes=attributes)
