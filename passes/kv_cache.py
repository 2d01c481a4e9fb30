"""Turn each global layer's ``KVAttention`` into ``CompressedKVAttention``: the slot cache becomes pruned (a
fixed number of slots, an eviction policy) and quantized (storage dtype + per-token group scales), and the
graph gains the state that needs: ``cache.{i}.k_scale``/``v_scale``, ``cache.{i}.score`` and one shared
``protect`` input (flags for the new tokens).

Sliding-window layers keep plain KVAttention: their ring of slots is already exact and small. The slot count
of a compressed layer is a symbolic dimension (``kv_slots``): the graph runs on any number of slots, so the
runtime can read a long prompt into a larger cache and select once at the end (``prefill_compress = end``).
"""

from __future__ import annotations

import onnx_ir as ir

from edgec.kvcache import compressed_function, function
from edgec.kvcache.compression import Compression
from edgec.passes._graph import take_over

SLOTS = "kv_slots"


def kv_cache(model: ir.Model, **compression_settings) -> int:
    """Rewrite in place; returns how many layers now hold a compressed cache."""
    compression = Compression(**compression_settings)
    graph = model.graph
    targets = [
        node
        for node in graph
        if node.domain == function.DOMAIN and node.op_type == function.OP_TYPE and _needs_compression(node, compression)
    ]
    if not targets:
        return 0
    position_ids = targets[0].inputs[3]
    protect = ir.Value(name="protect", shape=ir.Shape(list(position_ids.shape)), type=ir.TensorType(ir.DataType.BOOL))
    graph.inputs.insert(list(graph.inputs).index(position_ids) + 1, protect)
    heads = _heads(targets)
    for node in targets:
        _compress(graph, node, protect, compression)
    function_proto = compressed_function.make_function(compression, model.opset_imports.get("", 23), heads)
    ir_function = ir.serde.deserialize_function(function_proto)
    model.functions[ir_function.identifier()] = ir_function
    model.opset_imports[compressed_function.DOMAIN] = compressed_function.OPSET_VERSION
    if not any(node.op_type == function.OP_TYPE for node in graph):
        model.functions.pop((function.DOMAIN, function.OP_TYPE, ""), None)
    return len(targets)


def _needs_compression(node: ir.Node, compression: Compression) -> bool:
    return _window(node) == 0 or _window(node) > compression.capacity


def _compress(graph: ir.Graph, node: ir.Node, protect: ir.Value, compression: Compression) -> None:
    q, k, v, position_ids, k_cache, v_cache, pos_cache = node.inputs
    prefix = k_cache.name.rsplit(".", 1)[0]  # cache.{i}
    batch, kv_heads, _, head_dim = k_cache.shape
    storage = ir.DataType(compressed_function.STORAGE_TYPES[compression.dtype])
    stored_dim = head_dim // 2 if compression.dtype == "int4" else head_dim
    for value in (k_cache, v_cache):
        value.type = ir.TensorType(storage)
        value.shape = ir.Shape([batch, kv_heads, SLOTS, stored_dim])
    pos_cache.shape = ir.Shape([batch, kv_heads, SLOTS])
    float_type = ir.TensorType(ir.DataType.FLOAT)
    extra = {}
    if compression.quantized:
        for name in ("k_scale", "v_scale"):
            extra[name] = ir.Value(
                name=f"{prefix}.{name}",
                type=float_type,
                shape=ir.Shape([batch, kv_heads, SLOTS, head_dim // compression.group]),
            )
    extra["score"] = ir.Value(name=f"{prefix}.score", type=float_type, shape=ir.Shape([batch, kv_heads, SLOTS]))
    inputs_list = list(graph.inputs)
    at = inputs_list.index(pos_cache)
    for offset, value in enumerate(extra.values()):
        graph.inputs.insert(at + offset, value)
    state = {"k_cache": k_cache, "v_cache": v_cache, **extra, "pos": pos_cache}
    replacement = ir.Node(
        compressed_function.DOMAIN,
        compressed_function.OP_TYPE,
        inputs=[
            q,
            k,
            v,
            position_ids,
            protect,
            *(state[name] for name in compressed_function.state_names(compression)),
        ],
        attributes=[node.attributes["scale"], ir.AttrInt64("window", _window(node))],
        num_outputs=len(compressed_function.outputs(compression)),
    )
    graph.insert_before(node, replacement)
    out, k_out, v_out, pos_out = node.outputs
    new_outputs = dict(zip(compressed_function.outputs(compression), replacement.outputs, strict=True))
    take_over(out, new_outputs["out"])
    for old, name in ((k_out, "k_cache_out"), (v_out, "v_cache_out"), (pos_out, "pos_out")):
        take_over(old, new_outputs[name])
        new_outputs[name].type = state[name[:-4]].type
        new_outputs[name].shape = state[name[:-4]].shape
    at = list(graph.outputs).index(new_outputs["pos_out"])
    for offset, name in enumerate(extra):
        value = new_outputs[f"{name}_out"]
        value.name = f"new_{prefix}.{name}"
        value.type, value.shape = state[name].type, state[name].shape
        graph.outputs.insert(at + offset, value)
    graph.remove(node, safe=True)


def _heads(nodes: list[ir.Node]) -> compressed_function.Heads:
    """The head layout the function bakes in: q [B,H,T,D], cache [B,Hkv,slots,D], the same in every layer."""
    layouts = {(node.inputs[0].shape[1], node.inputs[4].shape[1], node.inputs[4].shape[3]) for node in nodes}
    if len(layouts) != 1 or not all(isinstance(size, int) for size in next(iter(layouts))):
        raise ValueError(f"compressed layers need one static head layout (heads, kv heads, head dim); got {layouts}")
    return compressed_function.Heads(*next(iter(layouts)))


def _window(node: ir.Node) -> int:
    return node.attributes["window"].as_int() if "window" in node.attributes else 0
