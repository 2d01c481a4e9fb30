"""Inline every model-local function, leaving standard-domain ops only (for runtimes that reject unknown
domains, such as the CANN EP). onnx-ir's InlinePass, because ``onnx.inliner`` mishandles attribute defaults
inside a function (KVAttention's ``window``)."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common

from edgec.passes._contract import Pass


def inline_functions(model: ir.Model, keep: tuple[str, ...] = ()) -> int:
    """Inline in place; returns how many call sites were inlined. ``keep``: op types whose calls stay calls (and
    their functions stay): a TensorRT plugin claims those nodes (``--kv-plugin on``)."""
    kept = {key: function for key, function in model.functions.items() if key[1] in keep}
    for key in kept:
        del model.functions[key]
    functions = {key for key in model.functions}
    calls = sum((node.domain, node.op_type, node.overload) in functions for node in model.graph)
    common.InlinePass()(model)
    common.RemoveUnusedOpsetsPass()(model)
    model.functions.update(kept)
    if kept:
        domains = {key[0] for key in kept}
        model.opset_imports.update({domain: model.opset_imports.get(domain, 1) for domain in domains})
    return calls


PASS = Pass(
    "inline_functions",
    inline_functions,
    removes=frozenset({"local_functions", "kv_attention", "static_attention", "compressed_attention"}),
)
