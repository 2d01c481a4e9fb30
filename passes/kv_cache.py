"""Turn each global layer's ``KVAttention`` into ``CompressedKVAttention``: the slot cache becomes pruned (a
fixed number of slots, an eviction policy) and quantized (storage dtype + per-token group scales), and the
graph gains the state that needs (``CacheSpec.compress`` names it: k_scale/v_scale, score), one shared
``protect`` input (flags for the new tokens) and one shared ``observe`` input ([1] bool: False for a prompt chunk
whose scores the next chunk replaces, so the op skips its observation — edgec/runtime/observe.py).

Sliding-window layers keep plain KVAttention: their ring of slots is already exact and small. The slot count
of a compressed layer is a symbolic dimension (``kv_slots``): the graph runs on any number of slots, so the
runtime can read a long prompt into a larger cache and select once at the end (``prefill_compress = end``).
"""

from __future__ import annotations

import onnx_ir as ir

from edgec.kvcache import compressed_function, function
from edgec.kvcache.compression import Compression
from edgec.kvcache.spec import (
    OBSERVE_INPUT,
    PROTECT_INPUT,
    ROW_DIM,
    SLOT_DIM,
    CacheSpec,
    LayerCache,
    StateTensor,
    recall_query_name,
)
from edgec.passes._contract import Pass
from edgec.passes._graph import take_over

SLOTS = SLOT_DIM


def kv_cache(
    model: ir.Model,
    spec: CacheSpec,
    compression: Compression,
    data_dependent_shapes: bool = True,
    fused_attention: bool = False,
) -> tuple[int, CacheSpec]:
    """Rewrite in place; returns how many layers now hold a compressed cache, and the new spec.
    ``data_dependent_shapes=False``: the op's body for compilers that need every shape from the input shapes;
    ``fused_attention``: prompt chunks attend with ONNX Runtime's GroupQueryAttention where the policy allows
    (``compressed_function.make_function``)."""
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    chosen = [layer for layer in spec.layers if not layer.window or layer.window > compression.capacity]
    nodes = {layer.layer: _attention_node(inputs, layer) for layer in chosen}
    if not nodes:
        return 0, spec
    new_spec = spec.compress(set(nodes), compression)
    position_ids = next(iter(nodes.values())).inputs[3]
    protect = ir.Value(
        name=PROTECT_INPUT, shape=ir.Shape(list(position_ids.shape)), type=ir.TensorType(ir.DataType.BOOL)
    )
    graph.inputs.insert(list(graph.inputs).index(position_ids) + 1, protect)
    # whether a prompt chunk's attention updates the policy's scores (False: the next chunk replaces them)
    observe = ir.Value(name=OBSERVE_INPUT, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.BOOL))
    graph.inputs.insert(list(graph.inputs).index(protect) + 1, observe)
    heads = _heads(list(nodes.values()))
    for layer in new_spec.layers:
        if layer.layer in nodes:
            _compress(graph, nodes[layer.layer], layer, protect, observe, compression)
    opset = model.opset_imports.get("", 23)
    function_proto = compressed_function.make_function(
        compression, opset, heads, data_dependent_shapes, fused_attention and data_dependent_shapes
    )
    ir_function = ir.serde.deserialize_function(function_proto)
    model.functions[ir_function.identifier()] = ir_function
    model.opset_imports[compressed_function.DOMAIN] = compressed_function.OPSET_VERSION
    if fused_attention and data_dependent_shapes:
        model.opset_imports.setdefault("com.microsoft", 1)
    if not any(node.op_type == function.OP_TYPE for node in graph):
        model.functions.pop((function.DOMAIN, function.OP_TYPE, ""), None)
    return len(nodes), new_spec


def _attention_node(inputs: dict[str, ir.Value], layer: LayerCache) -> ir.Node:
    """The KVAttention node that reads this layer's k state (the spec names it)."""
    k_cache = inputs[StateTensor(layer.layer, "k").input]
    readers = [use.node for use in k_cache.uses() if use.node.op_type == function.OP_TYPE]
    if len(readers) != 1 or readers[0].domain != function.DOMAIN:
        raise ValueError(f"layer {layer.layer}'s cache is not read by exactly one KVAttention node")
    return readers[0]


def _compress(
    graph: ir.Graph, node: ir.Node, layer: LayerCache, protect: ir.Value, observe: ir.Value, compression: Compression
) -> None:
    q, k, v, position_ids, k_cache, v_cache, pos_cache = node.inputs
    batch, kv_heads, _, head_dim = k_cache.shape
    storage = ir.DataType(compressed_function.STORAGE_TYPES[compression.dtype])
    stored_dim = head_dim // 2 if compression.dtype == "int4" else head_dim
    rows = ROW_DIM if compression.spare_rows else SLOTS  # GroupQueryAttention's spare row (_decode_gqa)
    for value in (k_cache, v_cache):
        value.type = ir.TensorType(storage)
        value.shape = ir.Shape([batch, kv_heads, rows, stored_dim])
    pos_cache.shape = ir.Shape([batch, kv_heads, SLOTS])
    float_type = ir.TensorType(ir.DataType.FLOAT)
    shapes = {
        "k_scale": [batch, kv_heads, SLOTS, head_dim // compression.group],
        "v_scale": [batch, kv_heads, SLOTS, head_dim // compression.group],
        "score": [batch, kv_heads, SLOTS],
    }
    types = dict.fromkeys(shapes, float_type)
    if compression.mixed != "none":  # the wide pool: a fixed number of slots (sink + window)
        hi = compression.hi_slots
        wide = ir.TensorType(ir.DataType(compressed_function.STORAGE_TYPES[compression.mixed]))
        for name in ("k_hi", "v_hi"):
            shapes[name], types[name] = [batch, kv_heads, hi, head_dim], wide
        for name in ("k_hi_scale", "v_hi_scale"):
            shapes[name], types[name] = [batch, kv_heads, hi, head_dim // compression.group], float_type
        shapes["score_hi"], types["score_hi"] = [batch, kv_heads, hi], float_type
        shapes["pos_hi"], types["pos_hi"] = [batch, kv_heads, hi], pos_cache.type
    tensors = {tensor.name: tensor for tensor in layer.tensors()}
    extra = {
        name: ir.Value(name=tensors[name].input, type=types[name], shape=ir.Shape(shape))
        for name, shape in shapes.items()
        if name in tensors
    }
    at = list(graph.inputs).index(pos_cache)
    for offset, value in enumerate(extra.values()):
        graph.inputs.insert(at + offset, value)
    state = {"k": k_cache, "v": v_cache, **extra, "pos": pos_cache}
    replacement = ir.Node(
        compressed_function.DOMAIN,
        compressed_function.OP_TYPE,
        inputs=[q, k, v, position_ids, protect, *(state[name] for name in layer.state), observe],
        attributes=[node.attributes["scale"], ir.AttrInt64("window", layer.window)],
        num_outputs=len(compressed_function.outputs(compression)),
    )
    graph.insert_before(node, replacement)
    out, *old_state = node.outputs
    recall = (compressed_function.RECALL_QUERY,) if compression.recall else ()
    new_outputs = dict(zip(("out", *layer.state, *recall), replacement.outputs, strict=True))
    take_over(out, new_outputs["out"])
    for old, name in zip(old_state, ("k", "v", "pos"), strict=True):
        take_over(old, new_outputs[name])
        new_outputs[name].type, new_outputs[name].shape = state[name].type, state[name].shape
    at = list(graph.outputs).index(new_outputs["pos"])
    for offset, name in enumerate(extra):
        value = new_outputs[name]
        value.name = tensors[name].output
        value.type, value.shape = state[name].type, state[name].shape
        graph.outputs.insert(at + offset, value)
    if recall:  # recall (kvcache/recall.py): the runtime reads each layer's last query
        query = new_outputs[compressed_function.RECALL_QUERY]
        query.name = recall_query_name(layer.layer)
        query.type, query.shape = float_type, ir.Shape([batch, q.shape[1], head_dim])
        graph.outputs.append(query)
    graph.remove(node, safe=True)


def _heads(nodes: list[ir.Node]) -> compressed_function.Heads:
    """The head layout the function bakes in: q [B,H,T,D], cache [B,Hkv,slots,D], the same in every layer."""
    layouts = {(node.inputs[0].shape[1], node.inputs[4].shape[1], node.inputs[4].shape[3]) for node in nodes}
    if len(layouts) != 1 or not all(isinstance(size, int) for size in next(iter(layouts))):
        raise ValueError(f"compressed layers need one static head layout (heads, kv heads, head dim); got {layouts}")
    return compressed_function.Heads(*next(iter(layouts)))


# first: it needs every global layer still a KVAttention node (lowerings of the remaining ones come after)
PASS = Pass(
    "kv_cache",
    kv_cache,
    requires=frozenset({"global_kv_attention"}),
    ensures=frozenset({"compressed_attention"}),
    removes=frozenset({"global_kv_attention"}),
    cache=True,
)
