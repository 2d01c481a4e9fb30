"""Lower ``ai.edgec::KVAttention`` to ONNX Runtime's fused ``com.microsoft::GroupQueryAttention`` (ORT targets).

Valid only for an uncompressed cache (no eviction, float storage, no ring of slots): then slot = position, so
the slot cache *is* GQA's shared past/present buffer of length ``capacity``, and GQA's write offset
(``seqlens_k + 1 - T``) equals the first new position because the runtime feeds positions contiguously from 0.
GQA needs no ``pos`` state (with slot = position it is implied by the fill), so the lowering removes the pos
inputs/outputs from the graph and the runtime allocates only the state the graph has. Layers that do not
qualify keep the portable function body.

Where the graph allows, GQA also takes over what surrounds attention: the model's head split/merge reshapes and,
when q, k, v come from one fused projection with standard RoPE, the rotary embedding (``do_rotary`` with cos/sin
tables for every position < capacity, evaluated from the model's own rotary subgraph, and explicit
``position_ids`` — never positions inferred from the cache fill).

Why: the function body is ~40 small nodes per layer; on a 2-core CPU their dispatch overhead costs a quarter of
a decode step. One fused kernel per layer removes it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from edgec.kvcache import function as kv_function
from edgec.kvcache.spec import CacheSpec, StateTensor
from edgec.passes._contract import Pass
from edgec.passes._graph import take_over


def kv_attention_gqa(model: ir.Model, spec: CacheSpec, context: int | None = None) -> tuple[int, CacheSpec]:
    """Rewrite in place; returns how many KVAttention nodes were lowered and the spec without their pos state.
    ``context``: the longest sequence the bundle runs (default: the largest cache capacity in the graph)."""
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    # the plain layers' KVAttention nodes, found through the state the spec names
    layers = {}
    for layer in spec.layers:
        k_cache = inputs.get(StateTensor(layer.layer, "k").input)
        readers = [use.node for use in k_cache.uses()] if k_cache is not None else []
        if not layer.compressed and len(readers) == 1 and readers[0].op_type == kv_function.OP_TYPE:
            layers[layer.layer] = readers[0]
    full = context or max((node.inputs[4].shape[2] for node in layers.values()), default=0)
    # A layer whose slots are a ring smaller than the context (a sliding-window layer, export.cache_spec_for)
    # keeps the function body: GQA writes at the cache fill (seqlens_k), so it cannot wrap around.
    chosen = {i: node for i, node in layers.items() if node.inputs[4].shape[2] >= full and _pos_state_is_private(node)}
    if not chosen:
        return 0, spec
    targets = list(chosen.values())
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
    tables: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value]] = {}
    for node in targets:
        _lower(graph, node, seqlens_k, total, tables)
    model.opset_imports.setdefault("com.microsoft", 1)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)  # head splits and rotaries that GQA took over
    return len(targets), spec.without(set(chosen), "pos")


def _lower(graph: ir.Graph, node: ir.Node, seqlens_k: ir.Value, total: ir.Value, tables: dict) -> None:
    q, k, v, position_ids, k_cache, v_cache, pos_cache = node.inputs
    num_heads, head_dim = q.shape[1], q.shape[3]
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    tape = ir.tape.Tape(graph_like=graph)
    attributes = {"num_heads": num_heads, "kv_num_heads": num_kv_heads, "scale": node.attributes["scale"].as_float()}
    window = node.attributes.get("window", ir.AttrInt64("window", 0)).as_int()
    if window > 0:  # GQA's local window W attends keys > q - W, as HF's sliding window does (tested)
        attributes["local_window_size"] = window
    packed = _packed_rotary_source(q, k, v, num_heads, num_kv_heads, head_dim)
    if packed is not None:
        qkv, cos, sin = packed
        key = (cos.producer().inputs[0] if cos.producer() else cos, capacity)  # one table per angle tensor
        if key not in tables:
            tables[key] = _rope_tables(graph, cos, sin, position_ids, capacity, suffix=len(tables))
        cos_table, sin_table = tables[key]
        inputs = [qkv, None, None, k_cache, v_cache, seqlens_k, total, cos_table, sin_table, position_ids]
        attributes |= {"do_rotary": 1, "rotary_interleaved": 0}
    else:
        inputs = [_bsh(tape, x) for x in (q, k, v)] + [k_cache, v_cache, seqlens_k, total]
    out, present_k, present_v = tape.op_multi_out(
        "GroupQueryAttention", inputs, attributes=attributes, domain="com.microsoft", num_outputs=3
    )
    _merge_heads_away(graph, node.outputs[0], out, num_heads * head_dim)
    still_4d = node.outputs[0].uses() or node.outputs[0].is_graph_output()
    out4 = tape.op("Reshape", [out, _i64(tape, [0, 0, num_heads, head_dim])]) if still_4d else out
    graph.insert_before(node, tape.nodes)
    for old, new in zip(node.outputs[:3], (out4, present_k, present_v), strict=True):
        if old.uses() or old.is_graph_output():
            take_over(old, new)
    graph.outputs.remove(node.outputs[3])
    graph.remove(node, safe=True)
    graph.inputs.remove(pos_cache)


def _pos_state_is_private(node: ir.Node) -> bool:
    """The pos state is graph I/O that only this node reads and writes, so it can be dropped."""
    pos_in, pos_out = node.inputs[6], node.outputs[3]
    return (
        pos_in is not None
        and pos_in.is_graph_input()
        and len(pos_in.uses()) == 1
        and pos_out.is_graph_output()
        and not pos_out.uses()
    )


def _i64(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(values, dtype=ir.DataType.INT64)})


def _constant_ints(value: ir.Value | None) -> list[int] | None:
    if value is None:
        return None
    if value.const_value is not None:
        return [int(x) for x in value.const_value.numpy().reshape(-1)]
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return [int(x) for x in producer.attributes["value"].as_tensor().numpy().reshape(-1)]
    return None


def _merge_heads_away(graph: ir.Graph, attention_out: ir.Value, gqa_out: ir.Value, hidden: int) -> None:
    """The model reshapes attention's [B,T,H,D] straight back to [B,T,H*D], which is what GQA returns: drop it."""
    for use in list(attention_out.uses()):
        reshape = use.node
        shape = _constant_ints(reshape.inputs[1]) if reshape.op_type == "Reshape" else None
        if shape is not None and len(shape) == 3 and shape[2] == hidden and 0 not in shape:
            take_over(reshape.outputs[0], gqa_out)
            graph.remove(reshape, safe=True)


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


def _plain_rotary(x: ir.Value) -> ir.Node | None:
    """x's producer when it is a standard (non-interleaved, full-width, position-free) RotaryEmbedding."""
    rotary = x.producer()
    if rotary is None or rotary.op_type != "RotaryEmbedding" or rotary.domain != "":
        return None
    interleaved = rotary.attributes.get("interleaved")
    width = rotary.attributes.get("rotary_embedding_dim")
    if (interleaved is not None and interleaved.as_int()) or (width is not None and width.as_int()):
        return None
    if len(rotary.inputs) > 3 and rotary.inputs[3] is not None:
        return None
    return rotary


def _bsh(tape: ir.tape.Tape, x: ir.Value) -> ir.Value:
    """[B,N,T,D] → [B,T,N*D], reusing the model's own 3-D tensor when x is just its head split (+ RoPE)."""
    source = _head_split_source(x)
    if source is not None:
        return source
    rotary = _plain_rotary(x)
    source = _head_split_source(rotary.inputs[0]) if rotary is not None else None
    if source is not None:  # RotaryEmbedding applies to [B,T,N*D] given num_heads
        attributes = {name: attr.value for name, attr in rotary.attributes.items()} | {"num_heads": x.shape[1]}
        return tape.op("RotaryEmbedding", [source, *rotary.inputs[1:]], attributes=attributes)
    return tape.op(
        "Reshape",
        [tape.op("Transpose", [x], attributes={"perm": [0, 2, 1, 3]}), _i64(tape, [0, 0, -1])],
    )


def _same_computation(a: ir.Value, b: ir.Value) -> bool:
    """The exporter gives each RotaryEmbedding its own Cos/Sin of one shared angle tensor: treat those as equal."""
    if a is b:
        return True
    pa, pb = a.producer(), b.producer()
    return (
        pa is not None
        and pb is not None
        and pa.op_type == pb.op_type
        and pa.domain == pb.domain
        and len(pa.inputs) == 1
        and pa.inputs[0] is pb.inputs[0]
        and not pa.attributes
        and not pb.attributes
    )


def _packed_rotary_source(q, k, v, num_heads, num_kv_heads, head_dim):
    """(qkv, cos, sin) when q, k, v are the three parts of one Split of a packed projection and q, k get the same
    standard RoPE; else None."""
    rotary_q, rotary_k = _plain_rotary(q), _plain_rotary(k)
    if rotary_q is None or rotary_k is None:
        return None
    if any(_same_computation(a, b) is False for a, b in zip(rotary_q.inputs[1:3], rotary_k.inputs[1:3], strict=True)):
        return None
    parts = [_head_split_source(rotary_q.inputs[0]), _head_split_source(rotary_k.inputs[0]), _head_split_source(v)]
    split = parts[0].producer() if parts[0] is not None else None
    if split is None or split.op_type != "Split" or list(split.outputs) != parts:
        return None
    axis = split.attributes.get("axis")
    sizes = _constant_ints(split.inputs[1]) if len(split.inputs) > 1 else None
    wanted = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if axis is None or axis.as_int() not in (-1, 2) or sizes != wanted:
        return None
    return split.inputs[0], rotary_q.inputs[1], rotary_q.inputs[2]


def _rope_tables(
    graph: ir.Graph,
    cos: ir.Value,
    sin: ir.Value,
    position_ids: ir.Value,
    capacity: int,
    suffix: int,
    prefix: str = "rope",
):
    """cos/sin [capacity, D/2] for positions 0..capacity-1, computed by running the model's own rotary subgraph
    (so any rope scaling it computes from position_ids is reproduced exactly, by the same kernels); initializers
    named ``{prefix}{suffix}.cos_cache`` / ``.sin_cache``."""
    import onnxruntime as ort

    nodes, seen, stack = [], set(), [cos.producer(), sin.producer()]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack += [value.producer() for value in node.inputs if value is not None]
    order = {id(node): index for index, node in enumerate(graph)}
    nodes.sort(key=lambda node: order[id(node)])
    initializers = {
        value.name: value for node in nodes for value in node.inputs if value is not None and value.is_initializer()
    }
    inputs = {value.name for node in nodes for value in node.inputs if value is not None and value.producer() is None}
    if inputs - set(initializers) - {position_ids.name}:
        raise ValueError(f"rotary tables depend on more than position_ids: {sorted(inputs)}")
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(
            [ir.serde.serialize_node(node) for node in nodes],
            "rope_tables",
            [onnx.helper.make_tensor_value_info(position_ids.name, onnx.TensorProto.INT64, [1, "T"])],
            [onnx.helper.make_tensor_value_info(v.name, onnx.TensorProto.FLOAT, None) for v in (cos, sin)],
            [_named_tensor(value) for value in initializers.values()],
        ),
        opset_imports=[onnx.helper.make_opsetid("", graph.opset_imports.get("", 23))],
    )
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    cos_table, sin_table = session.run(None, {position_ids.name: np.arange(capacity, dtype=np.int64)[None]})
    values = []
    for name, table in ((f"{prefix}{suffix}.cos_cache", cos_table), (f"{prefix}{suffix}.sin_cache", sin_table)):
        value = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(table[0], dtype=np.float32)))
        value.shape, value.type = ir.Shape(table[0].shape), ir.TensorType(ir.DataType.FLOAT)
        graph.register_initializer(value)
        values.append(value)
    return tuple(values)


def _named_tensor(value: ir.Value) -> onnx.TensorProto:
    proto = ir.serde.serialize_tensor(value.const_value)
    proto.name = value.name  # a freshly exported initializer's tensor may carry no name of its own
    return proto


# lowers only uncompressed full-length caches: after kv_cache, which needs every global layer as KVAttention
PASS = Pass(
    "kv_attention_gqa",
    kv_attention_gqa,
    requires=frozenset({"kv_attention"}),
    removes=frozenset({"global_kv_attention"}),
    domains=("com.microsoft",),
    cache=True,
)
