"""Give KVAttention its static body (edgec/kvcache/function.py, ``static=True``): every slot attended and masked,
padding at position -1 writing nothing. For runtimes that compile a graph for fixed shapes (the CANN EP): the
default body slices the cache to the filled length, a shape that depends on the data."""

from __future__ import annotations

import onnx_ir as ir

from edgec.kvcache import function as kv_function
from edgec.passes._contract import Pass


def static_kv_attention(model: ir.Model) -> int:
    """Replace the function body in place; returns how many KVAttention nodes now use it."""
    key = (kv_function.DOMAIN, kv_function.OP_TYPE, "")
    if key not in model.functions:
        return 0
    default_opset = model.opset_imports.get("", model.functions[key].opset_imports.get("", 23))
    model.functions[key] = ir.serde.deserialize_function(kv_function.make_function(default_opset, static=True))
    return sum(node.domain == kv_function.DOMAIN and node.op_type == kv_function.OP_TYPE for node in model.graph)


PASS = Pass(
    "static_kv_attention",
    static_kv_attention,
    requires=frozenset({"kv_attention", "local_functions"}),
    ensures=frozenset({"static_attention"}),
    removes=frozenset({"kv_attention"}),
)
