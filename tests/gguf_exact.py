"""The weights a bundle computes with, read back the way ONNX Runtime sees them, against a GGUF's own blocks.

ONNX Runtime folds the constant ops of a carried weight (fp16 steps → fp32 scales, narrow codes → kernel codes)
when it loads the graph; saving its optimized model gives the numbers its kernels then use. Every MatMulNBits
(with its offset product, or the two halves of an 8-bit weight at fp32 activations; through the sum of the two
rows of split activations) is dequantized exactly and
rounded once to fp32, column by column, and compared bit for bit with the rows ``gguf.quants.dequantize`` gives.
"""

from __future__ import annotations

import collections
import hashlib
from pathlib import Path

import numpy as np


def _optimized_graph(bundle: Path, folder: Path):
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # constant folding, no fusion
    options.optimized_model_filepath = str(folder / "folded.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "folded.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(folder / "folded.onnx")).graph


def _dequantized(node, values: dict[str, np.ndarray]) -> np.ndarray:
    """float64 [N, K] of one MatMulNBits."""
    import onnx

    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attributes["K"], attributes["N"], attributes["bits"], attributes["block_size"]
    packed = values[node.input[1]].reshape(n, -1)
    codes = packed if bits == 8 else np.stack([packed & 15, packed >> 4], -1).reshape(n, -1)
    blocks = codes.shape[1] // block
    zero = np.full((n, blocks), 2 ** (bits - 1), np.float64)
    if len(node.input) > 3 and node.input[3]:
        zp = values[node.input[3]].reshape(n, -1)
        zero = (zp if bits == 8 else np.stack([zp & 15, zp >> 4], -1).reshape(n, -1))[:, :blocks]
    scales = values[node.input[2]].astype(np.float64).reshape(n, blocks)
    steps = (codes.reshape(n, blocks, block) - zero[..., None].astype(np.float64)) * scales[..., None]
    return steps.reshape(n, -1)[:, :k]


def bundle_weight_rows(bundle: Path, folder: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(each linear layer's weight as fp32 [N, K] — its columns are the source's rows — and each quantized
    embedding table as fp32 [rows, K]), as ONNX Runtime computes with them."""
    from onnx import numpy_helper

    graph = _optimized_graph(bundle, folder)
    values = {init.name: numpy_helper.to_array(init, base_dir=str(folder)) for init in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    consumers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    weights, tables = [], []
    done = set()
    for node in graph.node:
        if node.op_type == "GatherBlockQuantized":
            tables.append(_table(node, values))
        if node.op_type != "MatMulNBits" or node.name in done:
            continue
        total = _dequantized(node, values)
        output = node.output[0]
        after = consumers[output]
        if len(after) == 1 and after[0].op_type == "Reshape":  # split activations as rows: the two rows' sum
            (summed,) = consumers[after[0].output[0]]
            assert summed.op_type == "ReduceSum", summed.op_type
            output = summed.output[0]
        elif len(after) == 1 and after[0].op_type == "ReduceSum":  # split activations stacked as the batch
            output = after[0].output[0]
        (add,) = consumers[output] if len(consumers[output]) == 1 else (None,)
        if add is not None and add.op_type == "Add":
            other = producer.get(next(name for name in add.input if name != node.output[0]))
            if other is not None and other.op_type == "MatMulNBits":  # an 8-bit weight as two 4-bit halves
                total = total + _dequantized(other, values)
                done.add(other.name)
                (add,) = consumers[add.output[0]] if len(consumers[add.output[0]]) == 1 else (None,)
        if add is not None and add.op_type == "Add":  # + blocksum(A) @ offsets
            product = producer.get(add.input[1])
            if product is not None and product.op_type == "MatMul" and product.input[1] in values:
                offsets = values[product.input[1]].astype(np.float64).T  # [N, blocks]
                n, k = total.shape
                block = -(-k // offsets.shape[1])
                total = total + np.repeat(offsets, block, axis=1)[:, :k]
        weights.append(total.astype(np.float32))
    return weights, tables


def _table(node, values: dict[str, np.ndarray]) -> np.ndarray:
    import onnx

    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits, block = attributes["bits"], attributes["block_size"]
    data = values[node.input[0]]
    rows = data.shape[0]
    codes = data.reshape(rows, -1) if bits == 8 else np.stack([data & 15, data >> 4], -1).reshape(rows, -1)
    scales = values[node.input[2]].astype(np.float64).reshape(rows, -1)
    blocks = scales.shape[1]
    zero = values[node.input[3]].reshape(rows, -1).astype(np.float64) if len(node.input) > 3 else 2 ** (bits - 1)
    if bits == 4 and len(node.input) > 3:
        zp = values[node.input[3]].reshape(rows, -1)
        zero = np.stack([zp & 15, zp >> 4], -1).reshape(rows, -1)[:, :blocks].astype(np.float64)
    steps = (codes.reshape(rows, blocks, block) - np.broadcast_to(zero, (rows, blocks))[..., None]) * scales[..., None]
    return steps.reshape(rows, -1).astype(np.float32)


def gguf_rows(path: Path) -> dict[str, np.ndarray]:
    """Every quantized 2-D tensor of a GGUF, dequantized by the gguf library: name → fp32 [rows, K]."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    plain = ("F32", "F16", "BF16")
    return {
        tensor.name: gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        for tensor in reader.tensors
        if tensor.tensor_type.name not in plain and len(tensor.data.shape) == 2
    }


def row_keys(rows: np.ndarray) -> collections.Counter:
    """The rows, as a multiset of their exact bytes (the sign of a zero included)."""
    return collections.Counter(hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows)


def assert_weights_are_the_gguf_s(bundle: Path, gguf_path: Path, folder: Path) -> int:
    """Every linear layer of the bundle (the lm_head included) is made of the GGUF's rows bit for bit, each GGUF
    row used exactly once, and every embedding table is the GGUF's token table; returns how many weights."""
    weights, tables = bundle_weight_rows(bundle, folder)
    source = gguf_rows(gguf_path)
    want = collections.Counter()
    for rows in source.values():
        want += row_keys(rows)
    got = collections.Counter()
    for weight in weights:
        got += row_keys(weight)
    strays, unused = sum((got - want).values()), sum((want - got).values())
    assert got == want, f"{strays} bundle columns are no GGUF row; {unused} GGUF rows unused"
    for table in tables:
        assert row_keys(table) == row_keys(source["token_embd.weight"])
    return len(weights)
