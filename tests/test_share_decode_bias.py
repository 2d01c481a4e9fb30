"""``prefill_graph.share_decode_bias``: the compressed layers without a sliding window read one attention bias
built once from the first such layer's slot positions; a windowed layer keeps its own. The kernels' outputs are
the same as with each layer's own bias wherever the layers' empty slots agree (the runtime's invariant: every
step fills every head of every layer alike), and a layer whose bias the sharing would change is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from edgec.kvcache.spec import CacheSpec, LayerCache
from edgec.prefill_graph import share_decode_bias

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 6
WINDOWS = (0, 3, 0)  # layer 1 has a sliding window


def _layer_nodes(layer: int) -> list[onnx.NodeProto]:
    """The bias as ``_decode_gqa`` builds it ([B,Hkv,C] 0/-inf per head, the spare row seen, one row per query
    head) from this layer's positions and window, then the kernel over C + 1 rows."""
    p = f"l{layer}_"
    window = WINDOWS[layer]
    lowest = f"{p}lowest"
    return [
        helper.make_node("Constant", [], [f"{p}span"], value_ints=[window - 1 if window else 2**40]),
        helper.make_node("Sub", ["position", f"{p}span"], [f"{p}first"]),
        helper.make_node("Constant", [], [f"{p}zero_i"], value_ints=[0]),
        helper.make_node("Max", [f"{p}first", f"{p}zero_i"], [lowest]),
        helper.make_node("GreaterOrEqual", [f"cache.{layer}.pos", lowest], [f"{p}seen"]),
        helper.make_node("Where", [f"{p}seen", "zero", "minus_inf"], [f"{p}hidden"]),
        helper.make_node("Pad", [f"{p}hidden", "spare_pad", "zero"], [f"{p}padded"]),
        helper.make_node("Unsqueeze", [f"{p}padded", "axis2"], [f"{p}grouped"]),
        helper.make_node("Expand", [f"{p}grouped", "grouped_shape"], [f"{p}expanded"]),
        helper.make_node("Reshape", [f"{p}expanded", "bias_shape"], [f"{p}bias"]),
        helper.make_node(
            "GroupQueryAttention",
            [f"q{layer}", f"k{layer}", f"v{layer}", f"cache.{layer}.k", f"cache.{layer}.v", "seqlens", "total"]
            + ["", "", "", f"{p}bias"],
            [f"out{layer}", f"present{layer}k", f"present{layer}v", f"probs{layer}"],
            domain="com.microsoft",
            num_heads=HEADS,
            kv_num_heads=KV_HEADS,
            qk_output=2,
        ),
    ]


def _model() -> onnx.ModelProto:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("position", i64, [1, 1, 1])]
    outputs = []
    nodes = []
    for layer in range(len(WINDOWS)):
        inputs += [
            helper.make_tensor_value_info(f"q{layer}", f, [1, 1, HEADS * DIM]),
            helper.make_tensor_value_info(f"k{layer}", f, [1, 1, KV_HEADS * DIM]),
            helper.make_tensor_value_info(f"v{layer}", f, [1, 1, KV_HEADS * DIM]),
            helper.make_tensor_value_info(f"cache.{layer}.k", f, [1, KV_HEADS, SLOTS + 1, DIM]),
            helper.make_tensor_value_info(f"cache.{layer}.v", f, [1, KV_HEADS, SLOTS + 1, DIM]),
            helper.make_tensor_value_info(f"cache.{layer}.pos", i64, [1, KV_HEADS, SLOTS]),
        ]
        outputs += [helper.make_tensor_value_info(f"out{layer}", f, None)]
        outputs += [helper.make_tensor_value_info(f"probs{layer}", f, None)]
        nodes += _layer_nodes(layer)
    constants = [
        helper.make_tensor("zero", f, [], [0.0]),
        helper.make_tensor("minus_inf", f, [], [float("-inf")]),
        helper.make_tensor("spare_pad", i64, [6], [0, 0, 0, 0, 0, 1]),
        helper.make_tensor("axis2", i64, [1], [2]),
        helper.make_tensor("grouped_shape", i64, [4], [1, KV_HEADS, HEADS // KV_HEADS, SLOTS + 1]),
        helper.make_tensor("bias_shape", i64, [4], [1, HEADS, 1, SLOTS + 1]),
        helper.make_tensor("seqlens", TensorProto.INT32, [1], [SLOTS]),
        helper.make_tensor("total", TensorProto.INT32, [], [SLOTS + 1]),
    ]
    graph = helper.make_graph(nodes, "decode", inputs, outputs, initializer=constants)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _spec() -> CacheSpec:
    layers = tuple(LayerCache(n, KV_HEADS, DIM, SLOTS, window=w, compressed=True) for n, w in enumerate(WINDOWS))
    return CacheSpec(layers=layers)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(positions: list[np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"position": np.array([[[9]]], np.int64)}
    for layer, pos in enumerate(positions):
        feeds |= {
            f"q{layer}": rng.standard_normal((1, 1, HEADS * DIM), np.float32),
            f"k{layer}": rng.standard_normal((1, 1, KV_HEADS * DIM), np.float32),
            f"v{layer}": rng.standard_normal((1, 1, KV_HEADS * DIM), np.float32),
            f"cache.{layer}.k": rng.standard_normal((1, KV_HEADS, SLOTS + 1, DIM), np.float32),
            f"cache.{layer}.v": rng.standard_normal((1, KV_HEADS, SLOTS + 1, DIM), np.float32),
            f"cache.{layer}.pos": pos,
        }
    return feeds


def _shared() -> onnx.ModelProto:
    model = ir.from_proto(_model())
    assert share_decode_bias(model, _spec()) == 2
    return ir.to_proto(model)


def test_windowless_layers_share_one_bias_and_a_windowed_one_keeps_its_own():
    shared = _shared()
    kernels = [node for node in shared.graph.node if node.op_type == "GroupQueryAttention"]
    biases = [node.input[10] for node in kernels]
    assert biases[0] == biases[2] != biases[1]
    assert biases[1] == "l1_bias"  # the windowed layer's own, untouched
    # each windowless layer's own mask chain is gone: one small chain in their place
    assert not any(output.startswith(("l0_", "l2_")) for node in shared.graph.node for output in node.output)


def test_the_shared_bias_gives_each_layer_its_own_outputs():
    """Slots 4 and 5 empty in every head of every layer (a cache filling up), slot 0 below layer 1's window:
    every output — attention and probabilities — as with each layer's own bias."""
    pos = np.array([[[3, 4, 7, 8, -1, -1], [0, 5, 6, 8, -1, -1]]], np.int64)
    feeds = _feeds([pos, pos, pos])
    for got, want in zip(_run(_shared(), feeds), _run(_model(), feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # full slots too: nothing hidden in the windowless layers
    full = _feeds([np.arange(12, dtype=np.int64).reshape(1, KV_HEADS, SLOTS)] * 3, seed=1)
    for got, want in zip(_run(_shared(), full), _run(_model(), full), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_it_reads_the_first_windowless_layer_and_says_when_there_is_none():
    """The bias comes from layer 0's positions: an empty slot there hides that slot in layer 2 too (which is
    why the sharing rests on every layer filling alike). A spec with only windowed layers shares nothing."""
    pos = np.array([[[3, 4, 7, 8, 9, 2], [0, 5, 6, 8, 9, 1]]], np.int64)
    emptier = pos.copy()
    emptier[:, :, 5] = -1
    got = _run(_shared(), _feeds([emptier, pos, pos]))
    want = _run(_model(), _feeds([emptier, pos, emptier]))
    np.testing.assert_allclose(got[4], want[4], atol=1e-6)  # layer 2's output as if its slot 5 were empty
    windowed = CacheSpec(layers=tuple(LayerCache(n, KV_HEADS, DIM, SLOTS, window=3, compressed=True) for n in range(3)))
    assert share_decode_bias(ir.from_proto(_model()), windowed) == 0
