"""Small graph-editing helpers shared by the passes."""

from __future__ import annotations

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
