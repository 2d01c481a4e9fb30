"""Graph rewriting shared by the block-quantized weight passes (int4_weights, int8_weights): MatMuls with constant
weights → MatMulNBits or DequantizeLinear + MatMul, the tied embedding table stored once, embedding lookups →
GatherBlockQuantized. The numbers come from edgec.blockquant."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from edgec.blockquant import quantize_blocks, quantize_blocks_zero_point, quantize_weight, unpack
from edgec.passes._graph import constant, constant_weight_matmuls, take_over


def dequantize_linear(model: ir.Model, block_size: int, symmetric: bool) -> None:
    """Every MatMul with a constant fp32 weight [K, N] → MatMul(A, DequantizeLinear(W4, scales[, zero points],
    axis 0, block_size)): INT4 without zero points when ``symmetric`` (what TensorRT reads), else UINT4 with
    integer zero points. The numbers are this module's (grid-aware: a block AWQ/GPTQ or a GGUF put on a grid keeps
    it), not a second quantizer's; a Q4_1 block (float offset) has no DequantizeLinear form and is rounded to
    nearest. ONNX Runtime turns each pair back into MatMulNBits when it loads the graph."""
    graph = model.graph
    for node, weight in constant_weight_matmuls(graph):
        array = weight.const_value.numpy()
        k, n = array.shape
        blocks = -(-k // block_size)
        zero_points = None
        if symmetric:
            packed, scales, _ = quantize_blocks(array, block_size, symmetric=True)
            levels = (unpack(packed, k) - 8).astype(ml_dtypes.int4)
        else:
            packed, scales, offsets, zero_points = quantize_weight(array, block_size, symmetric=False)
            if offsets is not None:
                packed, scales, zero_points = quantize_blocks_zero_point(array, block_size)
            levels = unpack(packed, k).astype(ml_dtypes.uint4)
            zero_points = unpack(zero_points, blocks).astype(ml_dtypes.uint4)
        inputs = [constant(graph, f"{weight.name}.int4", levels)]
        inputs.append(constant(graph, f"{weight.name}.scales", scales.reshape(n, blocks).T.copy()))
        if zero_points is not None:
            inputs.append(constant(graph, f"{weight.name}.zero_points", zero_points))
        tape = ir.tape.Tape(graph_like=graph)
        dequantized = tape.op("DequantizeLinear", inputs, attributes={"axis": 0, "block_size": block_size})
        graph.insert_before(node, tape.nodes)
        node.replace_input_with(1, dequantized)
        if not weight.uses():
            graph.initializers.pop(weight.name)


def gather_block_quantized(model: ir.Model, block_size: int) -> None:
    """Embedding lookups (Gather on axis 0 of a constant table) → 8-bit GatherBlockQuantized."""
    graph = model.graph
    for node in list(graph):
        table = node.inputs[0] if node.op_type == "Gather" and node.domain == "" else None
        axis = node.attributes.get("axis")
        if table is None or not table.is_initializer() or table.const_value is None or len(table.shape) != 2:
            continue
        if (axis is not None and axis.as_int() != 0) or table.dtype != ir.DataType.FLOAT:
            continue
        rows, columns = table.shape
        if columns % block_size:
            continue
        packed, scales, _ = quantize_blocks(table.const_value.numpy().T, block_size, symmetric=True, bits=8)
        data = packed.reshape(rows, columns)
        zero_points = np.full((rows, columns // block_size), 128, np.uint8)
        inputs = [
            constant(graph, f"{table.name}.q8", data),
            node.inputs[1],
            constant(graph, f"{table.name}.scales", scales.reshape(rows, -1)),
            constant(graph, f"{table.name}.zero_points", zero_points),
        ]
        tape = ir.tape.Tape(graph_like=graph)
        result = tape.op(
            "GatherBlockQuantized",
            inputs,
            attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": block_size, "bits": 8},
            domain="com.microsoft",
        )
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], result)
        graph.remove(node, safe=True)
        if not table.uses():
            graph.initializers.pop(table.name)


def shared_embedding(model: ir.Model, block_size: int, symmetric: bool, accuracy_level: int, bits: int) -> None:
    """A tied lm_head and its embedding table become ONE quantized table, read by the lm_head's MatMulNBits and by a
    GatherBlockQuantized (as onnxruntime-genai's ``shared_embeddings``), so it is stored once. 8 bits (absmax/127:
    exact for a GGUF's Q8_0 table) or 4 bits (integer zero points unless ``symmetric``; both kernels read them fast).
    The gather reads the packed weight and the scales through Reshape: ONNX Runtime folds those into copies before
    MatMulNBits pre-packs (and may release) its own inputs — sharing the scales directly gives wrong results."""
    graph = model.graph
    output_layer = _output_projection(graph)
    weight = output_layer.inputs[1] if output_layer is not None else None
    if weight is None or not weight.name.endswith(".transposed") or weight.const_value is None:
        return
    table = graph.initializers.get(weight.name.removesuffix(".transposed"))
    gathers = [use.node for use in table.uses() if _is_row_gather(use.node)] if table is not None else []
    rows, columns = table.shape if table is not None else (0, 0)
    if not gathers or columns % block_size:
        return
    array, blocks = weight.const_value.numpy(), columns // block_size
    zero_points = None
    if bits == 8:
        packed, scales, _ = quantize_blocks(array, block_size, symmetric=True, bits=8)
        gather_zero_points = np.full((rows, blocks), 128, np.uint8)  # explicit: MatMulNBits' default, 2**(bits-1)
    elif symmetric:
        packed, scales, _ = quantize_blocks(array, block_size, symmetric=True)
        gather_zero_points = None  # GatherBlockQuantized's default for 4 bits is 8, like MatMulNBits'
    else:
        # grid-aware (a table GPTQ rounded is carried exactly), in the integer-zero-point form both kernels read
        packed, scales, offsets, zero_points = quantize_weight(array, block_size, symmetric=False)
        if offsets is not None:  # on grids, but not with integer zero points (a Q4_1 table): round to nearest
            packed, scales, zero_points = quantize_blocks_zero_point(array, block_size)
        gather_zero_points = zero_points
    data = constant(graph, f"{table.name}.q{bits}", packed)
    scale = constant(graph, f"{table.name}.scales", scales)
    zero = constant(graph, f"{table.name}.zero_points", zero_points) if zero_points is not None else None
    tape = ir.tape.Tape(graph_like=graph)
    logits = tape.op(
        "MatMulNBits",
        [output_layer.inputs[0], data, scale] + ([zero] if zero is not None else []),
        attributes=_matmul_nbits_attributes(columns, rows, bits, block_size, accuracy_level),
        domain="com.microsoft",
    )
    graph.insert_before(output_layer, tape.nodes)
    take_over(output_layer.outputs[0], logits)
    graph.remove(output_layer, safe=True)
    graph.initializers.pop(weight.name)
    data_shape = constant(graph, f"{table.name}.rows_shape", np.array([rows, columns * bits // 8]))
    scales_shape = constant(graph, f"{table.name}.scales_shape", np.array([rows, blocks]))
    if gather_zero_points is not None and gather_zero_points is not zero_points:
        zero = constant(graph, f"{table.name}.gather_zero_points", gather_zero_points)
    for node in gathers:
        tape = ir.tape.Tape(graph_like=graph)
        inputs = [tape.op("Reshape", [data, data_shape]), node.inputs[1], tape.op("Reshape", [scale, scales_shape])]
        rows_out = tape.op(
            "GatherBlockQuantized",
            inputs + ([zero] if zero is not None else []),
            attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": block_size, "bits": bits},
            domain="com.microsoft",
        )
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], rows_out)
        graph.remove(node, safe=True)
    graph.initializers.pop(table.name)
    model.opset_imports.setdefault("com.microsoft", 1)


def _is_row_gather(node: ir.Node) -> bool:
    axis = node.attributes.get("axis")
    return node.op_type == "Gather" and node.domain == "" and (axis is None or axis.as_int() == 0)


def _output_projection(graph: ir.Graph) -> ir.Node | None:
    """The MatMul that produces the logits (through reshapes only), if any."""
    logits = next((value for value in graph.outputs if value.name == "logits"), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.op_type == "Reshape":
        node = node.inputs[0].producer()
    return node if node is not None and node.op_type == "MatMul" else None


def materialize_transposed_weights(model: ir.Model) -> None:
    """Transpose(W) feeding a MatMul, and Gemm(x, W, transB=1), become MatMul with a constant W^T."""
    flattened = False
    for node in list(model.graph):
        if node.op_type == "Gemm" and _plain_transposed_gemm(node):
            x, weight = node.inputs[:2]
            transposed = _transposed_copy(model, weight)
            unflatten = _flatten_round_trip(node)
            tape = ir.tape.Tape(graph_like=model.graph)
            # MatMulNBits takes [..., K] as it is: the Reshape to 2-D and back that Gemm needed go (4 nodes a step)
            product = tape.op("MatMul", [x.producer().inputs[0] if unflatten else x, transposed])
            model.graph.insert_before(node, tape.nodes)
            take_over((unflatten or node).outputs[0], product)
            model.graph.remove([node, unflatten] if unflatten else node, safe=True)
            flattened |= unflatten is not None
            continue
        source = node.inputs[0] if node.inputs else None
        if node.op_type != "Transpose" or source is None or not source.is_initializer() or len(source.shape) != 2:
            continue
        node.outputs[0].replace_all_uses_with(_transposed_copy(model, source))
        model.graph.remove(node, safe=True)
    if flattened:
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)


def _flatten_round_trip(gemm: ir.Node) -> ir.Node | None:
    """The final Reshape when ``gemm`` is wrapped as passes/transposed_weight_gemm.py wraps it —
    Reshape(x, [-1, K]) → Gemm → Reshape(·, Concat(Shape(x)[:-1], [N])) — else None."""
    flatten = gemm.inputs[0].producer()
    users = gemm.outputs[0].uses()
    if flatten is None or flatten.op_type != "Reshape" or len(users) != 1 or len(flatten.outputs[0].uses()) != 1:
        return None
    unflatten = users[0].node
    concat = unflatten.inputs[1].producer() if unflatten.op_type == "Reshape" else None
    shape = concat.inputs[0].producer() if concat is not None and concat.op_type == "Concat" else None
    end = shape.attributes.get("end") if shape is not None and shape.op_type == "Shape" else None
    x = flatten.inputs[0]
    start = shape.attributes.get("start") if end is not None else None
    if end is None or end.as_int() != -1 or (start is not None and start.as_int()) or shape.inputs[0] is not x:
        return None
    return unflatten


def _plain_transposed_gemm(node: ir.Node) -> bool:
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    weight = node.inputs[1]
    return (
        len(node.inputs) == 2
        and attributes.get("transB") == 1
        and not attributes.get("transA")
        and attributes.get("alpha", 1.0) == 1.0
        and weight is not None
        and weight.is_initializer()
    )


def _transposed_copy(model: ir.Model, source: ir.Value) -> ir.Value:
    name = f"{source.name}.transposed"
    if name in model.graph.initializers:
        return model.graph.initializers[name]
    weight = source.const_value.numpy()
    transposed = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(weight.T)))
    transposed.shape, transposed.type = ir.Shape(weight.T.shape), ir.TensorType(source.dtype)
    model.graph.register_initializer(transposed)
    return transposed


def matmul_nbits(model: ir.Model, block_size: int, symmetric: bool, accuracy_level: int, bits: int) -> None:
    """Every MatMul with a constant fp32 weight → MatMulNBits at ``bits`` (the lm_head at 8)."""
    weight_bits = bits
    graph = model.graph
    output_layer = _output_projection(graph)
    for node, weight in constant_weight_matmuls(graph):
        array = weight.const_value.numpy()
        k, n = array.shape
        x = node.inputs[0]
        # the lm_head (like the embedding) is the most sensitive matrix: 8 bits (GGUFs keep it at Q8_0 or better)
        bits = 8 if node is output_layer else weight_bits
        # the offset product needs whole blocks; otherwise the weight is symmetric
        whole = k % block_size == 0
        if bits == 8:
            packed, scales, offsets, zero_points = *quantize_blocks(array, block_size, True, bits=8), None
        else:
            packed, scales, offsets, zero_points = quantize_weight(array, block_size, symmetric or not whole)
        inputs = [x, constant(graph, f"{weight.name}.q{bits}", packed)]
        inputs.append(constant(graph, f"{weight.name}.scales", scales))
        if zero_points is not None:
            inputs.append(constant(graph, f"{weight.name}.zero_points", zero_points))
        tape = ir.tape.Tape(graph_like=graph)
        result = tape.op(
            "MatMulNBits",
            inputs,
            attributes=_matmul_nbits_attributes(k, n, bits, block_size, accuracy_level),
            domain="com.microsoft",
        )
        if offsets is not None:
            blocks = k // block_size
            # blocksum(A) as a product with a 0/1 block indicator [K, blocks]: one small MatMul, where Reshape +
            # ReduceSum cost ~3x more per step (the Reshape copies A, which MatMulNBits also reads)
            name = f"blocksum.{k}x{block_size}"
            indicator = graph.initializers.get(name) or constant(
                graph, name, np.repeat(np.eye(blocks, dtype=np.float32), block_size, axis=0)
            )
            sums = tape.op("MatMul", [x, indicator])
            table = constant(graph, f"{weight.name}.offsets", offsets.reshape(n, blocks).T.copy())
            result = tape.op("Add", [result, tape.op("MatMul", [sums, table])])
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], result)
        graph.remove(node, safe=True)
        if not weight.uses():
            graph.initializers.pop(weight.name)
    model.opset_imports.setdefault("com.microsoft", 1)


def _matmul_nbits_attributes(k: int, n: int, bits: int, block_size: int, accuracy_level: int) -> dict[str, int]:
    # 8-bit weights always compute with int8 activations (level 4): ONNX Runtime has no fast fp32 kernel for them
    # (SmolLM2's lm_head alone takes 85 ms a step at level 1)
    level = accuracy_level if bits == 4 else 4
    return {"K": k, "N": n, "bits": bits, "block_size": block_size, "accuracy_level": level}
