"""All float32 weights, activations and cache state → float16 (GPU and NPU targets compute in fp16).

Uses ONNX Runtime's float16 converter (onnxruntime.transformers.float16), which keeps ops that have no fp16 form
in fp32 behind Casts. Inputs and outputs become fp16 too: the cache state halves, and the runtime reads the
logits' dtype from the graph. The KVAttention function body needs no change: its constants are CastLike'd to
whatever type flows in.

The compressed cache stays fp32 inside: its op (``CompressedKVAttention``) reads q, k, v cast up from fp16 and
runs its body in fp32, and its float state (scores, scales; k and v stored as fp32) stays fp32 graph I/O. Which
token is evicted follows from sums of attention probabilities and keep-score comparisons; in fp16 those would
round differently from the reference and evict other tokens. The converter routes kept fp32 inputs through an
fp16 Cast before a blocked node even so; those round trips are removed again, exactly.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import onnx_ir.passes.common

from edgec.kvcache import compressed_function
from edgec.kvcache.spec import CacheSpec
from edgec.passes._contract import Pass
from edgec.passes._graph import replace_contents, take_over


def float16(model: ir.Model, spec: CacheSpec) -> tuple[int, CacheSpec]:
    """Rewrite in place; returns how many float32 initializers became float16, and the spec with fp16 plain
    layers."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    before = sum(v.dtype == ir.DataType.FLOAT for v in model.graph.initializers.values())
    if not spec.protected:
        proto = convert_float_to_float16(ir.serde.serialize_model(model), keep_io_types=False, disable_shape_infer=True)
        replace_contents(model, proto)
        return before, dataclasses.replace(spec, dtype="float16")
    graph_io = {value.name: value for value in [*model.graph.inputs, *model.graph.outputs]}
    kept = [
        name
        for tensor in spec.tensors()
        if any(layer.compressed and layer.layer == tensor.layer for layer in spec.layers)
        for name in (tensor.input, tensor.output)
        if graph_io[name].dtype == ir.DataType.FLOAT
    ]
    proto = convert_float_to_float16(
        ir.serde.serialize_model(model),
        keep_io_types=kept,
        disable_shape_infer=True,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, compressed_function.OP_TYPE],
    )
    replace_contents(model, proto)
    _drop_round_trips(model, set(kept))
    return before, dataclasses.replace(spec, dtype="float16")


def _is_cast(node: ir.Node | None, to: ir.DataType) -> bool:
    return node is not None and node.op_type == "Cast" and node.domain == "" and node.attributes["to"].as_int() == to


def _drop_round_trips(model: ir.Model, kept: set[str]) -> None:
    """Cast(Cast(x, fp16), fp32) of a kept fp32 graph input, or ending in a kept fp32 graph output → x itself."""
    for node in list(model.graph):
        if not _is_cast(node, ir.DataType.FLOAT):
            continue
        inner = node.inputs[0].producer()
        if not _is_cast(inner, ir.DataType.FLOAT16) or inner.inputs[0].dtype != ir.DataType.FLOAT:
            continue
        source, result = inner.inputs[0], node.outputs[0]
        if source.name in kept and source.is_graph_input():
            result.replace_all_uses_with(source)
        elif result.name in kept and result.is_graph_output():
            take_over(result, source)  # the graph output keeps its name
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)


# quantizing passes read fp32 weights: they come first
PASS = Pass(
    "float16",
    float16,
    requires=frozenset({"fp32"}),
    ensures=frozenset({"fp16"}),
    removes=frozenset({"fp32"}),
    cache=True,
)
