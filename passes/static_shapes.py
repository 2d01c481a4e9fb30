"""Fix every dimension of the step graph: ``tokens`` tokens per step and ``logits`` positions of logits, then fold
the shape arithmetic that the fixed sizes make constant and infer every intermediate shape. Refuses (BuildError)
if any dimension is still unknown: a runtime that compiles for fixed shapes (the CANN EP) would otherwise
recompile, or fail, at run time."""

from __future__ import annotations

import onnx_ir as ir

from edgec.errors import BuildError
from edgec.passes._contract import Pass

TOKEN_INPUTS = ("input_ids", "position_ids")


def static_shapes(model: ir.Model, tokens: int, logits: int | None = None) -> int:
    """Rewrite in place; returns how many graph inputs and outputs had a dimension fixed."""
    import onnxscript.optimizer

    logits = tokens if logits is None else logits
    fixed = 0
    for value in model.graph.inputs:
        if value.name in TOKEN_INPUTS:
            fixed += _fix(value, [1, tokens])
        elif value.name == "logits_index":
            fixed += _fix(value, [logits])
    for value in model.graph.outputs:
        if value.name == "logits":
            fixed += _fix(value, [1, logits, value.shape[2]])
    for node in model.graph:  # forget what was inferred for the dynamic graph
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None
    onnxscript.optimizer.optimize(model, num_iterations=2)
    if dynamic := dynamic_values(model):
        raise BuildError(f"the static graph still has dynamic dimensions in {', '.join(dynamic[:5])}")
    return fixed


def _fix(value: ir.Value, dims: list[int]) -> int:
    changed = value.shape is None or list(value.shape) != dims
    value.shape = ir.Shape(dims)
    return int(changed)


def dynamic_values(model: ir.Model) -> list[str]:
    """Names of graph inputs, outputs and intermediate values whose shape is unknown or has a symbolic dim,
    after ONNX shape inference."""
    import onnx

    proto = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model), strict_mode=True, data_prop=True)
    values = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    known = {value.name for value in values}
    missing = [out for node in proto.graph.node for out in node.output if out and out not in known]
    symbolic = [
        value.name
        for value in values
        if value.type.HasField("tensor_type")
        and (
            not value.type.tensor_type.HasField("shape")
            or any(not dim.HasField("dim_value") for dim in value.type.tensor_type.shape.dim)
        )
    ]
    return symbolic + missing


# run by the build once per graph of a static-shape target (tokens differ per graph), not from the table
PASS = Pass("static_shapes", static_shapes)
