"""``prefill_graph.share_slot_count``: an inlined decode graph reads the compressed layers' slot count once (the
first ``Shape`` of a state whose dim is ``SLOT_DIM``) and the layers' chains from it — C + 1 rows, the kernel's
int32 lengths — are merged; a Shape of any other dim, and every node that reads more than shapes and small
constants, is left alone. The outputs stay what they were."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime as ort
from onnx import TensorProto, helper

from edgec.kvcache.spec import SLOT_DIM
from edgec.prefill_graph import share_slot_count

LAYERS = 3


def _layer_nodes(layer: int, state: str) -> list[onnx.NodeProto]:
    """What ``_decode_gqa`` computes from its state's shape (the rows, the kernel's lengths), each layer with its
    own constants, as the inlined op leaves them; the result mixes in the layer's own input ``x{layer}``."""
    p = f"l{layer}_"
    return [
        helper.make_node("Shape", [state], [f"{p}slots"], start=2, end=3),
        helper.make_node("Shape", ["position_ids"], [f"{p}batch"], end=1),
        helper.make_node("Constant", [], [f"{p}one"], value_ints=[1]),
        helper.make_node("Add", [f"{p}slots", f"{p}one"], [f"{p}rows"]),
        helper.make_node("Expand", [f"{p}slots", f"{p}batch"], [f"{p}seqlens64"]),
        helper.make_node("Cast", [f"{p}seqlens64"], [f"{p}seqlens"], to=TensorProto.INT32),
        helper.make_node("Squeeze", [f"{p}rows"], [f"{p}total64"]),
        helper.make_node("Cast", [f"{p}total64"], [f"{p}total"], to=TensorProto.INT32),
        helper.make_node("Cast", [f"{p}seqlens"], [f"{p}seqlens_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", [f"{p}total"], [f"{p}total_f"], to=TensorProto.FLOAT),
        # the layer's own data: never merged (a state read must not move)
        helper.make_node("Mul", [f"x{layer}", f"{p}seqlens_f"], [f"{p}scaled"]),
        helper.make_node("Add", [f"{p}scaled", f"{p}total_f"], [f"out{layer}"]),
    ]


def _model() -> onnx.ModelProto:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("position_ids", i64, ["batch", 1])]
    outputs, nodes = [], []
    states = [f"cache.{layer}.pos" for layer in range(LAYERS)] + ["cache.other.pos"]
    for layer, state in enumerate(states):
        slots = SLOT_DIM if state != "cache.other.pos" else "other_slots"  # a different dim: its own count
        inputs += [
            helper.make_tensor_value_info(state, i64, ["batch", 2, slots]),
            helper.make_tensor_value_info(f"x{layer}", f, ["batch"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{layer}", f, None))
        nodes += _layer_nodes(layer, state)
    graph = helper.make_graph(nodes, "decode", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _feeds(slots: int, other: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"position_ids": np.zeros((1, 1), np.int64)}
    for layer in range(LAYERS + 1):
        count = other if layer == LAYERS else slots
        feeds[f"cache.{'other' if layer == LAYERS else layer}.pos"] = np.zeros((1, 2, count), np.int64)
        feeds[f"x{layer}"] = rng.standard_normal(1).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the file's nodes, as written
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _shared() -> tuple[onnx.ModelProto, int]:
    model = ir.from_proto(_model())
    removed = share_slot_count(model)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return ir.to_proto(model), removed


def test_the_compressed_layers_read_one_slot_count_and_one_chain():
    shared, removed = _shared()
    ops = [node.op_type for node in shared.graph.node]
    shapes = [(node.input[0], node.output[0]) for node in shared.graph.node if node.op_type == "Shape"]
    # one Shape of a slots state (layer 0's), one of position_ids, the other dim's own
    assert sorted(source for source, _ in shapes) == ["cache.0.pos", "cache.other.pos", "position_ids"]
    # the three compressed layers' chains are one: Add, Expand, Squeeze and four Casts once for them; the other
    # state keeps its own chain (Add/Expand/Squeeze over its own count); each layer keeps its Mul and final Add
    assert ops.count("Expand") == 2 and ops.count("Squeeze") == 2 and ops.count("Cast") == 8
    assert ops.count("Mul") == LAYERS + 1 and ops.count("Add") == 2 + LAYERS + 1
    assert removed == 2 * 7 + 3 + 2  # 2 slot Shapes, 3 repeated position_ids Shapes, 2 chains of 7 nodes


def test_the_outputs_are_unchanged_whatever_the_counts():
    shared, _ = _shared()
    for slots, other in ((6, 6), (1024, 9), (3, 40)):
        feeds = _feeds(slots, other)
        for got, want in zip(_run(shared, feeds), _run(_model(), feeds), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_graph_without_slot_states_is_left_alone():
    model = _model()
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == SLOT_DIM:
                dim.dim_param = "kv_len"  # a plain cache's length, which differs per layer in general
    edited = ir.from_proto(model)
    removed = share_slot_count(edited)
    # only the repeated Shapes of one input (position_ids) and their Expand inputs merge; no state's count does
    sources = [node.inputs[0].name for node in edited.graph if node.op_type == "Shape"]
    assert sorted(sources) == ["cache.0.pos", "cache.1.pos", "cache.2.pos", "cache.other.pos", "position_ids"]
    assert removed == 3
