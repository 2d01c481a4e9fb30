"""A one-node model around KVAttention, run step by step through ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from edgec.kvcache import function
from edgec.passes import PASSES


def kv_attention_model(
    heads: int, kv_heads: int, head_dim: int, capacity: int, scale: float, window: int = 0, static: bool = False
):
    node = helper.make_node(
        function.OP_TYPE,
        list(function.INPUTS),
        list(function.OUTPUTS),
        domain=function.DOMAIN,
        scale=scale,
        window=window,
    )
    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("q", f, [1, heads, "T", head_dim]),
        helper.make_tensor_value_info("k", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("v", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("position_ids", i, [1, "T"]),
        helper.make_tensor_value_info("k_cache", f, [1, kv_heads, capacity, head_dim]),
        helper.make_tensor_value_info("v_cache", f, [1, kv_heads, capacity, head_dim]),
        helper.make_tensor_value_info("pos_cache", i, [1, kv_heads, capacity]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", f, [1, "T", heads, head_dim]),
        helper.make_tensor_value_info("k_cache_out", f, [1, kv_heads, capacity, head_dim]),
        helper.make_tensor_value_info("v_cache_out", f, [1, kv_heads, capacity, head_dim]),
        helper.make_tensor_value_info("pos_cache_out", i, [1, kv_heads, capacity]),
    ]
    graph = helper.make_graph([node], "kv_attention", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(function.DOMAIN, 1)],
        functions=[function.make_function(23, static=static)],
    )


# this one-node model's state names ↔ the names a bundle's CacheSpec gives layer 0's state
SPEC_NAMES = {
    "k_cache": "cache.0.k",
    "v_cache": "cache.0.v",
    "pos_cache": "cache.0.pos",
    "k_cache_out": "new_cache.0.k",
    "v_cache_out": "new_cache.0.v",
    "pos_cache_out": "new_cache.0.pos",
}


def lowered(model: onnx.ModelProto, lower) -> onnx.ModelProto:
    """``model`` after a lowering pass. A pass that changes the cache state finds the node through the spec's
    names, so the state is renamed to them for the pass and back afterwards."""
    from edgec.kvcache.spec import CacheSpec, LayerCache

    ir_model = ir.serde.deserialize_model(model)
    if not PASSES_BY_FUNCTION[lower].cache:
        lower(ir_model)
        return ir.serde.serialize_model(ir_model)
    values = {v.name: v for v in [*ir_model.graph.inputs, *ir_model.graph.outputs]}
    for old, new in SPEC_NAMES.items():
        values[old].name = new
    _, kv_heads, capacity, head_dim = values["k_cache"].shape
    _, spec = lower(ir_model, CacheSpec((LayerCache(0, kv_heads, head_dim, capacity),)))
    back = {new: old for old, new in SPEC_NAMES.items()}
    for value in [*ir_model.graph.inputs, *ir_model.graph.outputs]:
        value.name = back.get(value.name, value.name)
    return ir.serde.serialize_model(ir_model)


PASSES_BY_FUNCTION = {declared.run: declared for declared in PASSES.values()}


def empty_state(kv_heads: int, capacity: int, head_dim: int):
    k = np.zeros((1, kv_heads, capacity, head_dim), np.float32)
    return k, k.copy(), np.full((1, kv_heads, capacity), -1, np.int64)


def random_step(rng, heads, kv_heads, head_dim, start, count):
    q = rng.standard_normal((1, heads, count, head_dim)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, count, head_dim)).astype(np.float32)
    v = rng.standard_normal((1, kv_heads, count, head_dim)).astype(np.float32)
    return q, k, v, np.arange(start, start + count, dtype=np.int64)[None]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def present(sess: ort.InferenceSession, feeds: dict) -> dict:
    """Only the feeds the (possibly lowered) graph still has."""
    names = {i.name for i in sess.get_inputs()}
    return {name: value for name, value in feeds.items() if name in names}


# --- in place: every reader of a state input runs before the node that overwrites it ------------------------------
# ops that ONNX Runtime may run on their input's buffer (a view): reading their output reads the state
ALIASING = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def op_types(nodes) -> set[str]:
    """Every op type in ``nodes`` and in their subgraphs (If branches)."""
    found = set()
    for node in nodes:
        found.add(node.op_type)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found |= op_types(attribute.g.node)
    return found


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs and what its subgraphs (If branches) take from outside them."""
    names = set(node.input)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            produced = {out for inner in attribute.g.node for out in inner.output}
            names |= {name for inner in attribute.g.node for name in _reads(inner) if name not in produced}
    return names


def assert_state_read_before_written(nodes, outputs: list[str], compression) -> None:
    """The in-place proof, on the graph, for one body of CompressedKVAttention (an If branch, or a body without
    one): ``outputs`` names its outputs in ``compressed_function.outputs`` order. Bound in place, a state input's
    buffer is its output's, which the node computing the output writes — the last one before views (Identity,
    Reshape…, which ONNX Runtime may run on that buffer): a ScatterElements or ScatterND, the Where that prunes
    positions, or an If whose branches each write it (checked the same way, inside). Every live node that reads
    the input — directly, through a view, or from inside a subgraph — must be an ancestor of that writer: ONNX
    Runtime runs a node once its inputs exist, so nothing then reads a slot after it was overwritten. (A node
    whose result nothing uses may read whenever.)"""
    from edgec.kvcache import compressed_function as cf

    formal = list(cf.outputs(compression))
    written = {name: outputs[formal.index(f"{name}_out")] for name in cf.state_names(compression)}
    _assert_read_before_written(list(nodes), outputs, written)


def _assert_read_before_written(nodes: list, outputs: list[str], written: dict[str, str], inside: bool = False) -> None:
    """``written``: each state input's name → the name of the value among ``outputs`` (all the body's) that
    becomes its output. ``inside`` an If that writes it: the branch may read the input or not (the If itself
    was checked as a reader)."""
    producers = {output: i for i, node in enumerate(nodes) for output in node.output}

    def ancestors(index: int) -> set[int]:
        seen, stack = set(), [index]
        while stack:
            for name in _reads(nodes[stack.pop()]):
                if name in producers and producers[name] not in seen:
                    seen.add(producers[name])
                    stack.append(producers[name])
        return seen

    def readers(name: str) -> set[int]:
        found, names = set(), [name]
        while names:
            current = names.pop()
            for i, node in enumerate(nodes):
                if current in _reads(node):
                    found.add(i)
                    if node.op_type in ALIASING:
                        names.extend(node.output)
        return found

    live = set().union(*(ancestors(producers[name]) | {producers[name]} for name in outputs))
    for name, output in written.items():
        while nodes[producers[output]].op_type in ALIASING:
            output = nodes[producers[output]].input[0]
        writer = producers[output]
        assert nodes[writer].op_type in ("ScatterElements", "ScatterND", "Where", "If"), (name, nodes[writer].op_type)
        before = ancestors(writer)
        reading = readers(name) & live
        assert reading or inside, name
        late = [nodes[i].op_type for i in reading if i != writer and i not in before]
        assert not late, f"{name} is read after its output is written, by {late}"
        if nodes[writer].op_type == "If":  # each branch writes it: the same proof inside
            at = list(nodes[writer].output).index(output)
            for attribute in nodes[writer].attribute:
                branch = attribute.g
                outputs_inside = [value.name for value in branch.output]
                _assert_read_before_written(list(branch.node), outputs_inside, {name: outputs_inside[at]}, inside=True)
