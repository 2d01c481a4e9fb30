"""Small graph-editing helpers shared by the passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir


def take_over(old: ir.Value, new: ir.Value) -> None:
    """Make ``new`` replace ``old`` everywhere, graph outputs included, keeping ``old``'s name, type and shape
    (graph output names are the bundle's interface)."""
    name, value_type, shape = old.name, old.type, old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}__replaced"
    new.name, new.type, new.shape = name, value_type, shape


def replace_contents(model: ir.Model, proto: onnx.ModelProto) -> None:
    """Put ``proto``'s graph and functions into ``model`` (passes mutate the model they are given); for passes
    built on a tool that works on ModelProto. Opset imports live on the graph and come with it."""
    converted = ir.serde.deserialize_model(proto)
    model.graph = converted.graph
    model.functions.clear()
    model.functions.update(converted.functions)


def constant(graph: ir.Graph, name: str, data: np.ndarray) -> ir.Value:
    """Register ``data`` as an initializer of ``graph`` named ``name``; returns its value."""
    value = ir.Value(name=name, const_value=ir.tensor(data))
    value.shape, value.type = ir.Shape(data.shape), ir.TensorType(ir.DataType.from_numpy(data.dtype))
    graph.register_initializer(value)
    return value


def constant_weight_matmuls(graph: ir.Graph) -> list[tuple[ir.Node, ir.Value]]:
    """The MatMuls whose second input is a constant fp32 matrix (a linear layer's weight [K, N]), with that weight;
    a list, so the caller may rewrite the graph while walking it."""
    found = []
    for node in graph:
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" else None
        if weight is None or not weight.is_initializer() or weight.const_value is None or len(weight.shape) != 2:
            continue
        if weight.dtype == ir.DataType.FLOAT:
            found.append((node, weight))
    return found
