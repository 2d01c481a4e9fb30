"""INT4 weights: the block quantizer (grid-exact for GGUF Q4/Q8 blocks), and a build with --weights int4."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgec.blockquant as int4
from edgec.build import BuildSettings, build
from edgec.errors import BuildSettingsError
from edgec.passes import _weights
from edgec.runtime import Model


def dequantize(packed, scales, offsets, k, n, block, bits=4):
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], -1).reshape(n, -1, block).astype(np.float64)
    else:
        q = packed.astype(np.float64)
    offset = offsets.reshape(n, -1, 1) if offsets is not None else 0
    return ((q - 2 ** (bits - 1)) * scales.reshape(n, -1, 1) + offset).reshape(n, -1)[:, :k].T


def q4_1_like(rng, k, n, block=32):
    """Weights as a Q4_1 GGUF dequantizes them: d * q + m per block of 32 input channels."""
    q = rng.integers(0, 16, (k, n))
    d = rng.uniform(0.005, 0.05, (k // block, n)).repeat(block, 0)
    m = rng.uniform(-0.3, 0.0, (k // block, n)).repeat(block, 0)
    weight = (d * q + m).astype(np.float32)
    weight[:block, 0] = (d[0, 0] * rng.integers(4, 11, block) + m[0, 0]).astype(np.float32)  # a narrow block
    return weight


def test_q4_grids_are_carried_across_exactly():
    rng = np.random.default_rng(0)
    weight = q4_1_like(rng, 128, 24)
    packed, scales, zero_points = int4.quantize_blocks(weight, 32, symmetric=False)
    assert packed.shape == (24, 4, 16) and packed.dtype == np.uint8
    assert np.abs(dequantize(packed, scales, zero_points, 128, 24, 32) - weight).max() < 1e-6


def test_q8_0_blocks_are_exact_at_8_bits():
    rng = np.random.default_rng(1)
    d = rng.uniform(0.001, 0.01, (2, 7)).repeat(32, 0)
    q = rng.integers(-127, 128, (64, 7))
    q[0], q[32] = 127, -127  # Q8_0 defines d = absmax / 127, so each block reaches ±127
    weight = (d * q).astype(np.float32)
    packed, scales, _ = int4.quantize_blocks(weight, 32, symmetric=True, bits=8)
    assert np.abs(dequantize(packed, scales, None, 64, 7, 32, bits=8) - weight).max() < 1e-6


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [64, 70])  # 70: the last block is padded
def test_round_to_nearest_error_is_half_a_step(symmetric, k):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((k, 9)).astype(np.float32)
    packed, scales, zero_points = int4.quantize_blocks(weight, 32, symmetric)
    error = np.abs(dequantize(packed, scales, zero_points, k, 9, 32) - weight)
    step = np.repeat(scales.reshape(9, -1), 32, axis=1)[:, :k].T
    assert (error <= step / 2 + 1e-6).all()


@pytest.fixture(scope="module")
def q4_source(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama whose linear weights sit on Q4_1 grids and whose embedding sits on a Q8_0 grid, like a GGUF."""
    from tests.conftest import make_llama_folder

    folder = make_llama_folder(tmp_path_factory.mktemp("q4") / "model", tiny_tokenizer, seed=3)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rng = np.random.default_rng(4)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() != 2:
                continue
            if "embed" in name:
                d = np.abs(parameter.numpy()).reshape(parameter.shape[0], -1, 32).max(-1, keepdims=True) / 127
                grid = np.rint(parameter.numpy().reshape(d.shape[0], -1, 32) / d) * d
                parameter.copy_(torch.from_numpy(grid.reshape(parameter.shape).astype(np.float32)))
            else:  # torch Linear weight [out, in]: blocks run along "in"
                parameter.copy_(torch.from_numpy(q4_1_like(rng, parameter.shape[1], parameter.shape[0]).T.copy()))
    model.save_pretrained(folder)
    return folder


def test_int4_build_of_a_q4_source_is_lossless(q4_source, tmp_path):
    fp32 = build(q4_source, tmp_path / "fp32.edgec", BuildSettings(context=96, prefill_chunk=32))
    quantized = build(
        q4_source,
        tmp_path / "int4.edgec",
        BuildSettings(context=96, prefill_chunk=32, weights="int4", accuracy_level=1),
    )
    assert quantized.manifest["build_settings"]["weights"] == "int4"
    import onnx

    graph = onnx.load(str(tmp_path / "int4.edgec" / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") >= 4 and ops.count("GatherBlockQuantized") == 1
    # the tied table is stored once, at 8 bits, read by the gather and the lm_head
    assert sum(i.name.endswith(".q8") for i in graph.initializer) == 1
    # the only float products left add back the per-block offsets of the asymmetric int4 weights
    assert all(
        n.input[1].endswith(".offsets") or n.input[1].startswith("blocksum.")
        for n in graph.node
        if n.op_type == "MatMul"
    )
    ids = np.random.default_rng(5).integers(0, 384, 80).tolist()
    a, b = Model.load(tmp_path / "fp32.edgec"), Model.load(tmp_path / "int4.edgec")
    # the 4-bit layers compute in fp32 at accuracy level 1, so their exact weights give the fp32 result; what is
    # left is the 8-bit lm_head, which always uses int8 activations (ORT's only fast 8-bit kernel)
    assert np.abs(a.logprobs(ids) - b.logprobs(ids)).max() < 0.05
    size = lambda r: r.manifest["files"]["model.onnx.data"]["size"]  # noqa: E731
    assert size(quantized) < 0.5 * size(fp32)
    assert fp32.manifest["validation"]["top1_agreement"] == 1.0


def test_weight_options_are_checked(tiny_llama, tmp_path):
    with pytest.raises(BuildSettingsError, match="int8 is built as MatMulNBits, which rtx3060"):
        build(tiny_llama, tmp_path / "a", BuildSettings(target="rtx3060", weights="int8"))
    with pytest.raises(BuildSettingsError, match="fp8 needs FP8 tensor cores"):
        build(tiny_llama, tmp_path / "b", BuildSettings(target="rtx3060", weights="fp8"))
    with pytest.raises(BuildSettingsError, match="--block-size"):
        build(tiny_llama, tmp_path / "c", BuildSettings(weights="int4", block_size=48))
    assert not any(tmp_path.iterdir())


def test_zero_point_blocks_round_to_nearest():
    rng = np.random.default_rng(6)
    weight = (rng.standard_normal((96, 5)) + 0.5).astype(np.float32)
    packed, scales, zero_points = int4.quantize_blocks_zero_point(weight, 32)
    q = np.stack([packed & 15, packed >> 4], -1).reshape(5, 3, 32).astype(np.float64)
    zero = np.stack([zero_points & 15, zero_points >> 4], -1).reshape(5, -1)[:, :3, None]
    step = scales.reshape(5, 3, 1)
    restored = ((q - zero) * step).reshape(5, 96).T
    assert (np.abs(restored - weight) <= np.repeat(step[..., 0], 32, 1).T / 2 + 1e-6).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_tied_embedding_is_one_shared_4_bit_table(tmp_path, tiny_tokenizer, symmetric):
    from tests.conftest import make_llama_folder

    folder = make_llama_folder(tmp_path / "tied", tiny_tokenizer, seed=7, tie_word_embeddings=True)
    settings = dict(context=64, prefill_chunk=16)
    build(folder, tmp_path / "fp32.edgec", BuildSettings(**settings))
    options = dict(weights="int4", symmetric=symmetric, accuracy_level=1, embedding_bits=4)
    quantized = build(folder, tmp_path / "q.edgec", BuildSettings(**settings, **options))
    import onnx

    graph = onnx.load(str(tmp_path / "q.edgec" / "model.onnx"), load_external_data=False).graph
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    if symmetric:  # no zero points: the gather reads the codes where they lie (a Reshape is a copy kept at load)
        table = gather.input[0]
    else:  # the zero points' packing is MatMulNBits' own: the gather reads the table through a Reshape
        table = next(n for n in graph.node if n.output[0] == gather.input[0]).input[0]
    # the gather reads the lm_head's packed weight: one table in the file
    assert any(n.op_type == "MatMulNBits" and n.input[1] == table for n in graph.node)
    # the lm_head reads the [1, T, hidden] rows as they are: no Reshape to 2-D and back around it
    (head,) = [n for n in graph.node if "logits" in n.output]
    assert head.op_type == "MatMulNBits" and not {"Shape", "Concat"} & {n.op_type for n in graph.node}
    tables = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2]
    assert all(name.endswith((".offsets", "_cache")) for name in tables)  # no float copy of the table is left
    ids = np.random.default_rng(8).integers(0, 384, 48).tolist()
    a, b = Model.load(tmp_path / "fp32.edgec"), Model.load(tmp_path / "q.edgec")
    # 4-bit RTN of every N(0, 0.15) weight of a tiny random model moves log-probabilities, but they stay related
    assert np.corrcoef(a.logprobs(ids), b.logprobs(ids))[0, 1] > 0.8
    assert quantized.manifest["build_settings"]["embedding_bits"] == 4


def matmul_model(weight: np.ndarray, batch: int | str = 1):
    """y = x @ weight, weight a constant [K, N] (the shape of every linear layer after export); x [batch, 3, K]."""
    import onnx_ir as ir

    k, n = weight.shape
    floats = ir.TensorType(ir.DataType.FLOAT)
    x = ir.Value(name="x", shape=ir.Shape([batch, 3, k]), type=floats)
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 23})
    tape = ir.tape.Tape(graph_like=graph)
    y = tape.op("MatMul", [x, tape.initializer(ir.tensor(weight, name="weight"))])
    graph.extend(tape.nodes)
    graph.outputs.append(y)
    y.name = "y"
    return ir.Model(graph, ir_version=10)


def run_matmul(model, x: np.ndarray) -> np.ndarray:
    import onnx_ir as ir
    import onnxruntime as ort

    options = ort.SessionOptions()
    # unoptimized: ORT would fuse DequantizeLinear + MatMul into MatMulNBits with int8 activations (level 4)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [64, 80])  # 80: a partial last block
def test_dequantize_linear_form_carries_grids_exactly(symmetric, k):
    """The portable form stores the same numbers as MatMulNBits: weights already on a 4-bit grid (symmetric: a Q4_0
    or AWQ/GPTQ block; with zero points: an integer-zero-point grid) come back exactly through ONNX Runtime."""
    rng = np.random.default_rng(11)
    step = rng.uniform(0.01, 0.05, (-(-k // 32), 7)).repeat(32, 0)[:k]
    if symmetric:
        levels = rng.integers(-8, 8, (k, 7))
    else:
        zero = rng.integers(0, 16, (-(-k // 32), 7)).repeat(32, 0)[:k]
        levels = rng.integers(0, 16, (k, 7)) - zero
    weight = (step * levels).astype(np.float32)
    model = matmul_model(weight)
    _weights.materialize_transposed_weights(model)
    _weights.dequantize_linear(model, 32, symmetric)
    (dq,) = [node for node in model.graph if node.op_type == "DequantizeLinear"]
    data = dq.inputs[0].const_value
    assert str(data.dtype) == ("INT4" if symmetric else "UINT4") and len(dq.inputs) == (2 if symmetric else 3)
    assert dq.attributes["axis"].as_int() == 0 and dq.attributes["block_size"].as_int() == 32
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    np.testing.assert_allclose(run_matmul(model, x), x @ weight.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_dequantize_linear_form_rounds_a_q4_1_block_to_nearest():
    """A Q4_1 block's minimum is no multiple of its step: DequantizeLinear has no float offsets, so such weights
    get round to nearest with integer zero points — within half a step, not exact."""
    rng = np.random.default_rng(12)
    weight = q4_1_like(rng, 64, 5)
    model = matmul_model(weight)
    _weights.dequantize_linear(model, 32, symmetric=False)
    x = np.eye(64, dtype=np.float32)[None, :3]  # rows of the identity read back three rows of the weight
    blocks = weight.reshape(2, 32, 5)
    step = (np.maximum(blocks.max(1), 0) - np.minimum(blocks.min(1), 0)) / 15  # the grid holds 0 at an integer
    assert (np.abs(run_matmul(model, x)[0] - weight[:3]) <= step[0] / 2 + 1e-5).all()


def test_portable_form_has_zero_points_only_where_the_runtime_reads_them():
    from edgec.build import weight_options
    from edgec.targets import load_target

    def plan(target: str, **settings) -> dict:
        return weight_options(load_target(target), BuildSettings(weights="int4", **settings), "int4")

    assert plan("rtx3060")["form"] == "qdq" and plan("rtx3060")["symmetric"]  # TensorRT: INT4 without zero points
    assert plan("cpu", int4_form="qdq") == {**plan("cpu"), "form": "qdq"}  # ONNX Runtime reads both
    assert plan("cpu", int4_form="qdq", symmetric=True)["symmetric"]


def test_split_activations_on_an_hf_folder_only_when_asked(tiny_llama, tmp_path):
    """Rounded weights (an HF folder's) keep one row of int8 activations unless asked: the weights' own error
    dominates there, and the split costs speed. Asked, every product gets its two rows and the manifest says so."""
    import onnx

    from edgec.build import BuildSettings, build

    for asked in (None, True):
        out = tmp_path / f"split-{asked}.edgec"
        result = build(tiny_llama, out, BuildSettings(context=64, weights="int4", split_activations=asked))
        assert result.manifest["build_settings"]["split_activations"] is bool(asked)
        nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
        products = sum(node.op_type == "MatMulNBits" for node in nodes)
        reduced = sum(node.op_type == "ReduceSum" for node in nodes)
        assert products and reduced == (products if asked else 0)


@pytest.mark.parametrize("batch", [1, "batch"])
def test_split_activations_stack_their_halves_as_the_batch_of_one(batch):
    """With a batch of one (every edgec graph) the split's two halves are the batch, [2, T, K], summed by one
    ReduceSum over axis 0, and the offset product's block sums read the split's block view — no Reshape of the
    product, no indicator MatMul. Any other batch keeps the halves as rows. Either way the product is the
    weight's within the split's error: far below one row of int8 activations' (7e-3 here)."""
    rng = np.random.default_rng(17)
    weight = q4_1_like(rng, 128, 40)
    model = matmul_model(weight, batch)
    _weights.matmul_nbits(model, 32, False, 4, 4, split_activations=True)
    nodes = list(model.graph)
    (product,) = [node for node in nodes if node.op_type == "MatMulNBits"]
    (concat,) = [node for node in nodes if node.op_type == "Concat"]
    after = [use.node.op_type for use in product.outputs[0].uses()]
    matmuls = [node for node in nodes if node.op_type == "MatMul"]
    if batch == 1:
        assert concat.attributes["axis"].value == 0 and after == ["ReduceSum"]
        assert len(matmuls) == 1 and matmuls[0].inputs[1].name.endswith(".offsets")  # sums @ offsets only
    else:
        assert concat.attributes["axis"].value == 1 and after == ["Reshape"]
    batch_size = 1 if batch == 1 else 2
    x = rng.standard_normal((batch_size, 3, 128)).astype(np.float32) * rng.uniform(0.1, 10, 128).astype(np.float32)
    reference = x.astype(np.float64) @ weight.astype(np.float64)
    error = np.abs(run_matmul(model, x) - reference).max() / np.abs(reference).max()
    assert error < 2e-4, error


@pytest.mark.parametrize("embedding_bits", [4, 8])
def test_tied_table_rows_are_the_lm_head_s_weight_rows_bit_for_bit(tmp_path, tiny_tokenizer, embedding_bits):
    """Without zero points the gather reads MatMulNBits' codes [rows, blocks, block bytes] where they lie, each
    block its own quantize axis, and joins the rows it took after it: every id's embedding, as ONNX Runtime's
    kernel computes it, is the lm_head's dequantized weight row for that id, bit for bit."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from tests.conftest import make_llama_folder

    folder = make_llama_folder(tmp_path / "tied", tiny_tokenizer, seed=9, tie_word_embeddings=True)
    options = dict(weights="int4", symmetric=True, accuracy_level=1, embedding_bits=embedding_bits)
    build(folder, tmp_path / "q.edgec", BuildSettings(context=64, prefill_chunk=16, **options))
    model = onnx.load(str(tmp_path / "q.edgec" / "model.onnx"))  # with its weights
    graph = model.graph
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert gather.input[0] in {i.name for i in graph.initializer}  # the stored codes, no Reshape copy
    (joined,) = [n for n in graph.node if gather.output[0] in n.input]
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    (scales_reshape,) = [n for n in graph.node if n.output[0] == gather.input[2]]
    assert any(n.op_type == "MatMulNBits" and scales_reshape.input[0] in n.input for n in graph.node)  # shared
    data, scales = values[gather.input[0]], values[scales_reshape.input[0]]
    vocab, blocks, width = data.shape
    codes = data if embedding_bits == 8 else np.stack([data & 15, data >> 4], -1).reshape(vocab, blocks, -1)
    steps = (codes.astype(np.float64) - 2 ** (embedding_bits - 1)) * scales.reshape(vocab, blocks, 1)
    expected = steps.reshape(vocab, -1).astype(np.float32)  # one rounding, as the kernel's (q - zero) · scale
    lookup = onnx.utils.Extractor(model).extract_model(["input_ids"], [joined.output[0]])
    session = ort.InferenceSession(lookup.SerializeToString(), providers=["CPUExecutionProvider"])
    (rows,) = session.run(None, {"input_ids": np.arange(vocab, dtype=np.int64)[None]})
    assert rows.shape == (1, *expected.shape) and np.array_equal(rows[0], expected)
