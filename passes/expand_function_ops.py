"""Expand standard ops that ONNX defines as functions of older ops (RMSNormalization-23, RotaryEmbedding-23) into
those ops, for runtimes whose ONNX support stops before opset 23 (the OpenVINO EP of onnxruntime-openvino 1.24 takes
neither, leaves them to the CPU and then fails to partition the graph). The expansion is ONNX's own function body
for the node (``OpSchema.get_context_dependent_function``), so the meaning cannot drift from the spec."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer
from onnx import helper

from edgec.passes._contract import Pass

EXPANDED = ("RMSNormalization", "RotaryEmbedding")
LOCAL_DOMAIN = "edgec.expanded"  # a node becomes a call to its own expansion, then every call is inlined


def expand_function_ops(model: ir.Model, ops: tuple[str, ...] = EXPANDED) -> int:
    """Rewrite in place; returns how many nodes were expanded."""
    opset = model.opset_imports.get("", 23)
    targets = [node for node in model.graph if node.domain in ("", "ai.onnx") and node.op_type in ops]
    if any(value is not None and value.dtype is None for node in targets for value in node.inputs):
        common.ShapeInferencePass()(model)  # an expansion depends on its input types
    bodies: dict[bytes, str] = {}
    expanded = 0
    for node in targets:
        function = _expansion(node, opset)
        key = function.SerializeToString()
        if key not in bodies:  # identical expansions (same attributes and input types) share one function
            bodies[key] = f"{node.op_type}_{len(bodies)}"
            function.name, function.domain = bodies[key], LOCAL_DOMAIN
            local = ir.serde.deserialize_function(function)
            model.functions[local.identifier()] = local
        node.op_type, node.domain = bodies[key], LOCAL_DOMAIN
        expanded += 1
    if expanded:
        model.opset_imports[LOCAL_DOMAIN] = 1
        common.InlinePass()(model)
        common.RemoveUnusedOpsetsPass()(model)
        # the bodies compute axes and shapes from ranks (Shape, Size, Range) that are known here: fold them, as
        # runtimes that build their own graph (OpenVINO) need the reduction axes constant
        onnxscript.optimizer.optimize(model, num_iterations=2)
        _drop_empty_splits(model)
    return expanded


def _drop_empty_splits(model: ir.Model) -> None:
    """RotaryEmbedding's body splits off the channels it does not rotate and concatenates them back: with full-width
    rotary that part is empty, and runtimes without zero-size tensors (OpenVINO) reject the Split. An empty part
    only feeding Concats is dropped; a Split left with one part is the identity."""
    for node in list(model.graph):
        lengths = node.inputs[1].const_value if node.op_type == "Split" and len(node.inputs) > 1 else None
        if lengths is None or 0 not in lengths.numpy().tolist():
            continue
        outputs = list(node.outputs)
        empty = [out for out, n in zip(outputs, lengths.numpy().tolist(), strict=True) if n == 0]
        if any(out.is_graph_output() or any(use.node.op_type != "Concat" for use in out.uses()) for out in empty):
            continue
        for out in empty:
            for use in list(out.uses()):
                concat = use.node
                kept = [value for value in concat.inputs if value is not out]
                replacement = ir.node("Concat", kept, attributes=concat.attributes, num_outputs=1)
                model.graph.insert_before(concat, replacement)
                concat.outputs[0].replace_all_uses_with(replacement.outputs[0], replace_graph_outputs=True)
                model.graph.remove(concat, safe=True)
        remaining = [out for out in outputs if out not in empty]
        if len(remaining) == 1:
            remaining[0].replace_all_uses_with(node.inputs[0], replace_graph_outputs=False)
    common.RemoveUnusedNodesPass()(model)


def _expansion(node: ir.Node, opset: int) -> onnx.FunctionProto:
    schema = onnx.defs.get_schema(node.op_type, opset)
    proto = ir.serde.serialize_node(node)
    types = [
        helper.make_tensor_type_proto(value.dtype.value, None if value.shape is None else [None] * len(value.shape))
        if value is not None
        else onnx.TypeProto()
        for value in node.inputs
    ]
    body = schema.get_context_dependent_function(proto.SerializeToString(), [t.SerializeToString() for t in types])
    function = onnx.FunctionProto()
    function.ParseFromString(body)
    return function


PASS = Pass("expand_function_ops", expand_function_ops, removes=frozenset({"opset23_ops"}))
