"""``prefill_graph._add_proto_nodes`` (how ``batch_decode_evictions`` adds its body's nodes to a graph): the new
nodes read the graph's values by name, and a build says nothing of it — onnx_ir warns of every input a lone
node's deserialization cannot find (177 lines in a SmolLM2 fp32-slot build), all of which are then set."""

from __future__ import annotations

import logging

import onnx_ir as ir
import pytest
from onnx import helper

from edgec.prefill_graph import _add_proto_nodes


def _graph() -> tuple[ir.Graph, dict[str, ir.Value]]:
    x = ir.Value(name="x", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], name="g")
    return graph, {"x": x}


def test_new_nodes_read_the_graphs_values_and_log_nothing(caplog):
    graph, values = _graph()
    protos = [helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Add", ["x", "y"], ["z"])]
    with caplog.at_level(logging.DEBUG):
        created = _add_proto_nodes(graph, protos, values)
    assert not [record for record in caplog.records if record.name.startswith("onnx_ir")]
    assert set(created) == {"y", "z"}
    add = created["z"].producer()
    assert add.inputs[0] is values["x"] and add.inputs[1] is created["y"]
    assert logging.getLogger("onnx_ir.serde").level == logging.NOTSET  # left as it was


def test_a_name_the_graph_lacks_is_a_bug_said_as_one():
    graph, values = _graph()
    with pytest.raises(ValueError, match="'missing', which the graph lacks"):
        _add_proto_nodes(graph, [helper.make_node("Neg", ["missing"], ["y"])], values)
