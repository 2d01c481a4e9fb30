"""Give the compressed op's one-token step to the TensorRT-RTX plugin (``edgec build --kv-plugin on``): the
``CompressedKVAttention`` function becomes its plugin form (plugins/compressed_attention/graph.py), whose decode
branch calls ``ai.edgec::CompressedDecodeAttention`` — a model-local function of standard ops that ONNX Runtime
runs and that TensorRT-RTX's parser hands to the plugin of the same name. ``inline_functions`` keeps that one
function (``keep``)."""

from __future__ import annotations

import onnx_ir as ir

from edgec.kvcache import compressed_function as cf
from edgec.kvcache.spec import CacheSpec
from edgec.passes._contract import Pass


def kv_plugin(model: ir.Model, spec: CacheSpec) -> tuple[int, CacheSpec]:
    """Rewrite in place; returns how many compressed layers now call the sub-op, and the spec (unchanged)."""
    from edgec.plugins.compressed_attention import graph

    nodes = [node for node in model.graph if (node.domain, node.op_type) == (cf.DOMAIN, cf.OP_TYPE)]
    if not nodes:
        return 0, spec
    heads = heads_of(nodes)
    opset = model.opset_imports.get("", 23)
    for proto in (
        graph.make_plugin_function(spec.compression, opset, heads),
        graph.make_sub_function(spec.compression, opset, heads),
    ):
        function = ir.serde.deserialize_function(proto)
        model.functions[function.identifier()] = function
    return len(nodes), spec


def heads_of(nodes: list[ir.Node]) -> cf.Heads:
    """The head layout of the compressed nodes: q [B,H,T,D] and the new k [B,Hkv,T,D], the same in every layer."""
    layouts = {(node.inputs[0].shape[1], node.inputs[1].shape[1], node.inputs[0].shape[3]) for node in nodes}
    if len(layouts) != 1 or not all(isinstance(size, int) for size in next(iter(layouts))):
        raise ValueError(f"compressed layers need one static head layout (heads, kv heads, head dim); got {layouts}")
    return cf.Heads(*next(iter(layouts)))


PASS = Pass(
    "kv_plugin",
    kv_plugin,
    requires=frozenset({"compressed_attention", "local_functions"}),
    ensures=frozenset({"plugin_attention"}),
    cache=True,
)
