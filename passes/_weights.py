"""Graph rewriting shared by the block-quantized weight passes (int4_weights, int8_weights): MatMuls with constant
weights → MatMulNBits or DequantizeLinear + MatMul, the tied embedding table stored once, embedding lookups →
GatherBlockQuantized. The numbers come from edgec.blockquant."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from edgec.blockquant import (
    CarriedWeight,
    GridRows,
    RowSource,
    carried_weight,
    quantize_blocks,
    quantize_blocks_zero_point,
    quantize_weight,
    unpack,
)
from edgec.passes._graph import constant, constant_weight_matmuls, take_over

FLOAT = ir.DataType.FLOAT


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


def shared_embedding(
    model: ir.Model,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    bits: int,
    source: RowSource | None = None,
    split_activations: bool = False,
) -> None:
    """A tied lm_head and its embedding table become ONE quantized table, read by the lm_head's MatMulNBits and by a
    GatherBlockQuantized (as onnxruntime-genai's ``shared_embeddings``), so it is stored once. A table ``source``
    defines exactly (a GGUF's, see ``carried_inputs``) keeps its own codes, steps and minima; otherwise 8 bits
    (absmax/127: exact for a Q8_0 table) or 4 bits (integer zero points unless ``symmetric``; both kernels read
    them fast). The gather reads the packed weight and the scales through Reshape: ONNX Runtime folds those into
    copies before MatMulNBits pre-packs (and may release) its own inputs — sharing the scales directly gives wrong
    results."""
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
    array = weight.const_value.numpy()
    segments = source.find(array) if source is not None else None
    if segments is not None:
        carried = carried_weight(segments)
        bits, block_size = carried.bits, carried.block_size
        prepare = ir.tape.Tape(graph_like=graph)  # constants only: placed before the first gather reads them
        data, scale, offsets = carried_inputs(graph, prepare, table.name, carried)
        graph.insert_before(gathers[0], prepare.nodes)
        zero = gather_zero = None  # the kernels' defaults (2**(bits-1)); 8-bit codes are q + 128 - zero
    else:
        blocks, zero_points, offsets = columns // block_size, None, None
        if bits == 8:
            packed, scales, _ = quantize_blocks(array, block_size, symmetric=True, bits=8)
        elif symmetric:
            packed, scales, _ = quantize_blocks(array, block_size, symmetric=True)
        else:
            # grid-aware (a table GPTQ rounded is carried exactly), in the integer-zero-point form both kernels read
            packed, scales, offsets_array, zero_points = quantize_weight(array, block_size, symmetric=False)
            if offsets_array is not None:  # on grids, but not with integer zero points: round to nearest
                packed, scales, zero_points = quantize_blocks_zero_point(array, block_size)
        data = constant(graph, f"{table.name}.q{bits}", packed)
        scale = constant(graph, f"{table.name}.scales", scales)
        zero = constant(graph, f"{table.name}.zero_points", zero_points) if zero_points is not None else None
        gather_zero = zero
    blocks = columns // block_size
    tape = ir.tape.Tape(graph_like=graph)
    logits = _nbits_product(
        graph,
        tape,
        output_layer.inputs[0],
        data,
        scale,
        zero,
        offsets,
        (columns, rows, bits, block_size),
        accuracy_level,
        split_activations,
    )
    graph.insert_before(output_layer, tape.nodes)
    take_over(output_layer.outputs[0], logits)
    graph.remove(output_layer, safe=True)
    graph.initializers.pop(weight.name)
    # without zero points of its own the gather reads MatMulNBits' codes [rows, blocks, block_size·bits/8] where they
    # lie, each block its own quantize axis, and the rows it took are reshaped after it: a table read through a
    # Reshape is a copy ONNX Runtime folds at load and keeps for the session's life (SmolLM2's 8-bit table: 27 MB a
    # session). ONNX Runtime releases a pre-packed input only once no other kernel reads it, so MatMulNBits and the
    # gather can share the codes; the scales stay a copy of their own (shared, they gave wrong results)
    direct = zero is None
    if direct:
        data_shape = None
        scales_shape = constant(graph, f"{table.name}.block_scales_shape", np.array([rows, blocks, 1]))
    else:
        data_shape = constant(graph, f"{table.name}.rows_shape", np.array([rows, columns * bits // 8]))
        scales_shape = constant(graph, f"{table.name}.scales_shape", np.array([rows, blocks]))
    if bits == 8 and gather_zero is None:  # explicit: GatherBlockQuantized's 8-bit default is not MatMulNBits' 128
        tape = ir.tape.Tape(graph_like=graph)
        zero_shape = (rows, blocks, 1) if direct else (rows, blocks)
        gather_zero = _filled(graph, tape, f"{table.name}.gather_zero_points", zero_shape, 128)
        graph.insert_before(gathers[0], tape.nodes)
    for node in gathers:
        tape = ir.tape.Tape(graph_like=graph)
        ids = node.inputs[1]
        table_data = data if direct else tape.op("Reshape", [data, data_shape])
        inputs = [table_data, ids, tape.op("Reshape", [scale, scales_shape])]
        rows_out = tape.op(
            "GatherBlockQuantized",
            inputs + ([gather_zero] if gather_zero is not None else []),
            attributes={"gather_axis": 0, "quantize_axis": 2 if direct else 1, "block_size": block_size, "bits": bits},
            domain="com.microsoft",
        )
        if direct:  # [*ids, blocks, block_size] → [*ids, columns]
            if ids.shape is not None:  # the ids' dimensions kept as they are (0), the rest joined
                kept = len(ids.shape)
                rows_shape = _shared(graph, f"shape.keep{kept}", np.array([0] * kept + [-1]))
            else:
                width = _shared(graph, f"row_width.{columns}", np.array([columns]))
                rows_shape = tape.op("Concat", [tape.op("Shape", [ids]), width], attributes={"axis": 0})
            rows_out = tape.op("Reshape", [rows_out, rows_shape])
        if offsets is not None:  # each gathered row gets its blocks' offsets: [.., blocks] → [.., columns]
            row_offsets = tape.op(
                "Gather", [tape.op("Transpose", [offsets], attributes={"perm": [1, 0]}), node.inputs[1]]
            )
            widths = _shared(graph, f"block_widths.{block_size}", np.array([1, 1, 1, block_size]))
            spread = tape.op(
                "Expand", [tape.op("Unsqueeze", [row_offsets, _shared(graph, "axis.last", np.array([-1]))]), widths]
            )
            rows_out = tape.op(
                "Add", [rows_out, tape.op("Reshape", [spread, _shared(graph, "shape.keep2", np.array([0, 0, -1]))])]
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


def matmul_nbits(
    model: ir.Model,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    bits: int,
    source: RowSource | None = None,
    split_activations: bool = False,
) -> int:
    """Every MatMul with a constant fp32 weight → MatMulNBits at ``bits`` (the lm_head at 8); a weight ``source``
    defines exactly (a GGUF's) keeps its own numbers (``carried_inputs``). Returns how many were carried."""
    weight_bits = bits
    graph = model.graph
    output_layer = _output_projection(graph)
    carried_count = 0
    for node, weight in constant_weight_matmuls(graph):
        array = weight.const_value.numpy()
        k, n = array.shape
        x = node.inputs[0]
        tape = ir.tape.Tape(graph_like=graph)
        segments = source.find(array) if source is not None else None
        if segments is not None:
            carried = carried_weight(segments)
            codes, scales, offsets = carried_inputs(graph, tape, weight.name, carried)
            shape = (k, n, carried.bits, carried.block_size)
            result = _nbits_product(
                graph, tape, x, codes, scales, None, offsets, shape, accuracy_level, split_activations
            )
            carried_count += 1
        else:
            # the lm_head (like the embedding) is the most sensitive matrix: 8 bits (GGUFs keep it at Q8_0 or better)
            bits = 8 if node is output_layer else weight_bits
            # the offset product needs whole blocks; otherwise the weight is symmetric
            whole = k % block_size == 0
            if bits == 8:
                packed, scales, offsets, zero_points = *quantize_blocks(array, block_size, True, bits=8), None
            else:
                packed, scales, offsets, zero_points = quantize_weight(array, block_size, symmetric or not whole)
            codes = constant(graph, f"{weight.name}.q{bits}", packed)
            zero = constant(graph, f"{weight.name}.zero_points", zero_points) if zero_points is not None else None
            if offsets is not None:
                offsets = constant(graph, f"{weight.name}.offsets", offsets.reshape(n, -1).T.copy())
            scales = constant(graph, f"{weight.name}.scales", scales)
            shape = (k, n, bits, block_size)
            result = _nbits_product(
                graph, tape, x, codes, scales, zero, offsets, shape, accuracy_level, split_activations
            )
        graph.insert_before(node, tape.nodes)
        take_over(node.outputs[0], result)
        graph.remove(node, safe=True)
        if not weight.uses():
            graph.initializers.pop(weight.name)
    model.opset_imports.setdefault("com.microsoft", 1)
    return carried_count


def _nbits_product(
    graph: ir.Graph,
    tape: ir.tape.Tape,
    x: ir.Value,
    codes: ir.Value,
    scales: ir.Value,
    zero_points: ir.Value | None,
    offsets: ir.Value | None,
    shape: tuple[int, int, int, int],
    accuracy_level: int,
    split_activations: bool = False,
) -> ir.Value:
    """x @ W for W given as MatMulNBits' inputs (codes [N, blocks, bytes], scales [N·blocks], zero points) plus,
    where a block's minimum is not on its integer grid, ``blocksum(x) @ offsets`` (offsets [blocks, N]).
    8-bit codes at accuracy level 0/1 (fp32 activations) are computed as two 4-bit products of their high and low
    nibbles — exact, and ONNX Runtime's fp32 kernel for 8-bit weights is many times slower than its 4-bit one.
    ``split_activations`` (int8 activations only): x is computed as two rows, see ``_split_rows``."""
    k, n, bits, block_size = shape
    blocks = None
    if bits == 8 and accuracy_level <= 1 and zero_points is None:
        result = _nibble_pair(graph, tape, x, codes, scales, shape, accuracy_level)
    else:
        attributes = _matmul_nbits_attributes(k, n, bits, block_size, accuracy_level)
        split = split_activations and attributes["accuracy_level"] >= 2 and k % block_size == 0
        split = split and x.shape is not None and x.shape.rank() == 3
        rows, blocks, stacked = _split_rows(graph, tape, x, k, block_size) if split else (x, None, False)
        result = tape.op(
            "MatMulNBits",
            [rows, codes, scales] + ([zero_points] if zero_points is not None else []),
            attributes=attributes,
            domain="com.microsoft",
        )
        if stacked:  # [2, T, N] → the two halves' sum [1, T, N]
            result = tape.op("ReduceSum", [result, _shared(graph, "axis.0", np.array([0]))], attributes={"keepdims": 1})
        elif split:  # [B, 2T, N] → the two halves' sum [B, T, N]
            pairs = tape.op("Reshape", [result, _shared(graph, f"shape.0x2x-1x{n}", np.array([0, 2, -1, n]))])
            result = tape.op("ReduceSum", [pairs, _shared(graph, "axis.1", np.array([1]))], attributes={"keepdims": 0})
    if offsets is not None:
        if blocks is not None:  # the split's block view of x is there already: its sums are one small ReduceSum
            sums = tape.op(
                "ReduceSum", [blocks, _shared(graph, "axis.last", np.array([-1]))], attributes={"keepdims": 0}
            )
        else:
            # blocksum(A) as a product with a 0/1 block indicator [K, blocks]: one small MatMul, where Reshape +
            # ReduceSum cost ~3x more per step (the Reshape copies A, which MatMulNBits also reads)
            sums = tape.op("MatMul", [x, _block_indicator(graph, k, block_size)])
        result = tape.op("Add", [result, tape.op("MatMul", [sums, offsets])])
    return result


def _nibble_pair(
    graph: ir.Graph,
    tape: ir.tape.Tape,
    x: ir.Value,
    codes: ir.Value,
    scales: ir.Value,
    shape: tuple[int, int, int, int],
    accuracy_level: int,
) -> ir.Value:
    """x @ W for 8-bit codes without zero points at fp32 activations: the two 4-bit products of the codes' nibbles,
    summed (``_nibbles``) — the same product on ONNX Runtime's 4-bit fp32 kernel."""
    k, n, _, block_size = shape
    high, low, high_scales, low_zero = _nibbles(graph, tape, codes, scales, n, k // block_size)
    attributes = _matmul_nbits_attributes(k, n, 4, block_size, accuracy_level)
    parts = [
        tape.op("MatMulNBits", [x, high, high_scales], attributes=attributes, domain="com.microsoft"),
        tape.op("MatMulNBits", [x, low, scales, low_zero], attributes=attributes, domain="com.microsoft"),
    ]
    return tape.op("Add", parts)


def at_fp32_activations(graph: ir.Graph, node: ir.Node, x: ir.Value) -> ir.Value:
    """Rewrite ``node`` (a MatMulNBits of ``graph``) to compute ``x`` @ its weight at fp32 activations (accuracy
    level 1) and return the product's value. 4-bit weights: the node itself, at level 1. 8-bit codes without zero
    points (a GGUF's Q8_0 lm_head): the node is replaced by its nibble pair (``_nibble_pair``), since ONNX Runtime's
    fp32 kernel for 8-bit weights is slow — SmolLM2's lm_head took ~170 ms per prompt chunk there against a few ms
    as two 4-bit products. Any other 8-bit node: at level 1 as it is."""
    attributes = {name: attribute.value for name, attribute in node.attributes.items()}
    shape = (attributes["K"], attributes["N"], attributes["bits"], attributes["block_size"])
    has_zero_points = len(node.inputs) > 3 and node.inputs[3] is not None
    if attributes["bits"] != 8 or has_zero_points or len(node.inputs) > 4:
        node.replace_input_with(0, x)
        node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 1)
        return node.outputs[0]
    tape = ir.tape.Tape(graph_like=graph)
    product = _nibble_pair(graph, tape, x, node.inputs[1], node.inputs[2], shape, 1)
    graph.insert_before(node, tape.nodes)
    ir.convenience.replace_all_uses_with(node.outputs[0], product)
    graph.remove(node, safe=True)
    return product


def _split_rows(
    graph: ir.Graph, tape: ir.tape.Tape, x: ir.Value, k: int, block_size: int
) -> tuple[ir.Value, ir.Value, bool]:
    """x [B, T, K] → two rows per row: ``high``, x rounded onto the int8 grid of each of its blocks (absmax/127 per
    ``block_size`` inputs, as ONNX Runtime's int8 kernel quantizes its input), and ``low = x - high``. The kernel's
    own rounding then leaves ``high`` as it is and rounds only ``low``, ~1/254 of x, so the product's error is
    ~1/127 of int8 activations' (SmolLM2: max |Δlogit| 5e-3 instead of 1.4, greedy answers as fp32's). One kernel
    call with twice the rows: decoding reads the weight once. Where a kernel quantizes its input in other blocks
    (not x86 MLAS), ``high`` is rounded again and the result is no worse than plain int8 activations.

    Returns (rows, blocks, stacked): ``blocks`` is x's block view [B, T, K/block, block] (the offset product's sums
    read it). With a batch of one (every edgec graph) the halves are stacked as the batch, [2, T, K], and summed by
    one ReduceSum over axis 0 (``stacked``); otherwise as rows, [B, 2T, K], summed after a Reshape — one node more
    per product (SmolLM2's 121: the stacked form's decode step is 0.97× the rows form's)."""
    blocks = tape.op("Reshape", [x, _shared(graph, f"shape.0x0x-1x{block_size}", np.array([0, 0, -1, block_size]))])
    largest = tape.op(
        "ReduceMax",
        [tape.op("Abs", [blocks]), _shared(graph, "axis.last", np.array([-1]))],
        attributes={"keepdims": 1},
    )
    # a block of zeros keeps step 1e-30 rather than 0 (0/0); its high and low parts are both 0
    step = tape.op(
        "Max",
        [
            tape.op("Div", [largest, _shared(graph, "int8.levels", np.array(127, np.float32))]),
            _shared(graph, "step.tiny", np.array(1e-30, np.float32)),
        ],
    )
    high = tape.op("Mul", [tape.op("Round", [tape.op("Div", [blocks, step])]), step])
    stacked = isinstance(x.shape[0], int) and x.shape[0] == 1
    both = tape.op("Concat", [high, tape.op("Sub", [blocks, high])], attributes={"axis": 0 if stacked else 1})
    rows = tape.op("Reshape", [both, _shared(graph, f"shape.0x0x{k}", np.array([0, 0, k]))])
    return rows, blocks, stacked


def _block_indicator(graph: ir.Graph, k: int, block_size: int) -> ir.Value:
    """The 0/1 matrix [K, blocks] with input i in block i // block_size, made once per shape by ops that ONNX
    Runtime folds when it loads the graph (EyeLike, Expand), not stored: stored, it cost K·blocks·4 bytes per
    input width (1 % of a Q4_1 SmolLM2's bytes, 6 % of a tiny model's)."""
    name = f"blocksum.{k}x{block_size}"
    for node in graph:
        if node.outputs and node.outputs[0].name == name:
            return node.outputs[0]
    blocks = k // block_size
    tape = ir.tape.Tape(graph_like=graph)
    zeros = tape.op(
        "ConstantOfShape",
        [_shared(graph, f"shape.{blocks}x{blocks}", np.array([blocks, blocks]))],
        attributes={"value": ir.tensor(np.array([0], np.float32))},
    )
    eye = tape.op("Unsqueeze", [tape.op("EyeLike", [zeros]), _shared(graph, "axis.1", np.array([1]))])
    spread = tape.op("Expand", [eye, _shared(graph, f"shape.1x{block_size}x1", np.array([1, block_size, 1]))])
    indicator = tape.op("Reshape", [spread, _shared(graph, f"shape.{k}x{blocks}", np.array([k, blocks]))])
    indicator.name = name
    graph.insert_before(graph[0], tape.nodes)
    return indicator


def _nibbles(graph: ir.Graph, tape: ir.tape.Tape, codes: ir.Value, scales: ir.Value, n: int, blocks: int):
    """8-bit codes c (default zero point 128) as two 4-bit halves: 16·s·(c >> 4 - 8) + s·(c & 15 - 0) = s·(c - 128).
    Constant ops on constants: ONNX Runtime folds them when it loads the graph."""
    four = _shared(graph, "uint8.4", np.array(4, np.uint8))
    halves = []
    for nibble in (
        tape.op("BitShift", [codes, four], attributes={"direction": "RIGHT"}),
        tape.op("BitwiseAnd", [codes, _shared(graph, "uint8.15", np.array(15, np.uint8))]),
    ):
        even = tape.op("Slice", [nibble, *_slice_every_other(graph, 0)])
        odd = tape.op("Slice", [nibble, *_slice_every_other(graph, 1)])
        halves.append(tape.op("BitwiseOr", [even, tape.op("BitShift", [odd, four], attributes={"direction": "LEFT"})]))
    high_scales = tape.op("Mul", [scales, _shared(graph, "float.16", np.array(16, np.float32))])
    low_zero = _filled(graph, tape, f"zero_points.{n}x{blocks}", (n, -(-blocks // 2)), 0)
    return halves[0], halves[1], high_scales, low_zero


def _slice_every_other(graph: ir.Graph, start: int) -> list[ir.Value]:
    big = np.iinfo(np.int64).max
    return [
        _shared(graph, f"slice.start{start}", np.array([start])),
        _shared(graph, "slice.end", np.array([big])),
        _shared(graph, "axis.last", np.array([-1])),
        _shared(graph, "slice.step2", np.array([2])),
    ]


def _filled(graph: ir.Graph, tape: ir.tape.Tape, name: str, shape: tuple[int, ...], value: int) -> ir.Value:
    """A uint8 tensor of one value, made at load time (ConstantOfShape, folded) instead of stored."""
    fill = ir.tensor(np.array([value], np.uint8))
    return tape.op("ConstantOfShape", [_shared(graph, f"{name}.shape", np.array(shape))], attributes={"value": fill})


def _shared(graph: ir.Graph, name: str, data: np.ndarray) -> ir.Value:
    """An initializer registered once under ``name`` and reused (indicators, shapes, small constants)."""
    return graph.initializers.get(name) or constant(graph, name, data)


def carried_inputs(
    graph: ir.Graph, tape: ir.tape.Tape, name: str, carried: CarriedWeight
) -> tuple[ir.Value, ir.Value, ir.Value | None]:
    """MatMulNBits' inputs for a weight a source defines exactly: (codes [N, blocks, block_size·bits/8], scales
    [N·blocks], offsets [blocks, N] or None). The bundle stores the source's own numbers at their own width
    (``GridRows.stored``: 4-bit codes plus high bits, fp16 steps and minima, integer sub-scales — the GGUF's
    bytes, give or take a few per super-block); constant ops on them make the kernel's fp32 scales and offsets
    and 8-bit codes, which ONNX Runtime folds once when it loads the graph (exact: products of an fp16 number and
    a small integer, and offsets checked exact by ``carried_weight``)."""
    codes, scales, offsets = [], [], []
    for index, segment in enumerate(carried.segments):
        stored = {key: constant(graph, f"{name}.{index}.{key}", array) for key, array in segment.stored().items()}
        repeat = segment.block_size // carried.block_size
        rows, blocks = segment.rows, segment.blocks * repeat
        code = stored["codes"]
        if carried.bits == 8 and segment.qbits < 8:
            code = _unpacked(graph, tape, code, 4, (segment.rows, segment.blocks, segment.block_size))
            if "high" in stored:
                width = segment.qbits - 4
                high = _unpacked(graph, tape, stored["high"], width, (segment.rows, segment.blocks, segment.block_size))
                four = _shared(graph, "uint8.4", np.array(4, np.uint8))
                code = tape.op("BitwiseOr", [code, tape.op("BitShift", [high, four], attributes={"direction": "LEFT"})])
        if bias := carried.code_bias(segment):
            code = tape.op("Add", [code, _shared(graph, f"uint8.{bias}", np.array(bias, np.uint8))])
        if repeat > 1:
            code = tape.op("Reshape", [code, _shared(graph, f"shape.{rows}x{blocks}x-1", np.array([rows, blocks, -1]))])
        codes.append(code)
        scale = _per_block(graph, tape, stored["step"], stored.get("step_factor"), segment)
        low = None
        if "low_base" in stored:
            low = _per_block(graph, tape, stored["low_base"], stored.get("low_factor"), segment)
            if segment.low_sign < 0:
                low = tape.op("Neg", [low])
        if repeat > 1:
            scale, low = (
                _repeated(graph, tape, value, rows, repeat) if value is not None else None for value in (scale, low)
            )
        scales.append(scale)
        if carried.offsets:
            if steps := carried.offset_step(segment):  # the kernel's 2**(bits-1) is not the source's zero
                low = _plus_steps(graph, tape, low, scale, steps)
            offsets.append(
                low if low is not None else tape.op("Mul", [scale, _shared(graph, "float.0", np.array(0, np.float32))])
            )
    join = lambda values: values[0] if len(values) == 1 else tape.op("Concat", values, attributes={"axis": 0})  # noqa: E731
    scale = tape.op("Reshape", [join(scales), _shared(graph, "shape.flat", np.array([-1]))])
    offset = tape.op("Transpose", [join(offsets)], attributes={"perm": [1, 0]}) if carried.offsets else None
    return join(codes), scale, offset


def _plus_steps(graph: ir.Graph, tape: ir.tape.Tape, low: ir.Value | None, scale: ir.Value, steps: int) -> ir.Value:
    added = tape.op("Mul", [scale, _shared(graph, f"float.{steps}", np.array(steps, np.float32))])
    return added if low is None else tape.op("Add", [low, added])


def _unpacked(graph: ir.Graph, tape: ir.tape.Tape, packed: ir.Value, width: int, shape: tuple[int, int, int]):
    """uint8 values of ``width`` bits packed lowest first → one per byte, [rows, blocks, block_size]."""
    per_byte = 8 // width
    shifts = _shared(graph, f"uint8.shifts{width}", (width * np.arange(per_byte)).astype(np.uint8))
    mask = _shared(graph, f"uint8.{2**width - 1}", np.array(2**width - 1, np.uint8))
    spread = tape.op("Unsqueeze", [packed, _shared(graph, "axis.last", np.array([-1]))])
    values = tape.op("BitwiseAnd", [tape.op("BitShift", [spread, shifts], attributes={"direction": "RIGHT"}), mask])
    return tape.op("Reshape", [values, _shared(graph, "shape." + "x".join(map(str, shape)), np.array(shape))])


def _per_block(graph: ir.Graph, tape: ir.tape.Tape, base: ir.Value, factor: ir.Value | None, segment: GridRows):
    """fp32 [rows, blocks]: an fp16 number per group (block or super-block) times an integer per block."""
    value = tape.op("Cast", [base], attributes={"to": FLOAT})
    if factor is None:
        return value
    groups = segment.step.shape[1]
    rows_groups = _shared(graph, f"shape.{segment.rows}x{groups}x-1", np.array([segment.rows, groups, -1]))
    product = tape.op(
        "Mul",
        [
            tape.op("Reshape", [value, rows_groups]),
            tape.op("Reshape", [tape.op("Cast", [factor], attributes={"to": FLOAT}), rows_groups]),
        ],
    )
    return tape.op("Reshape", [product, _shared(graph, f"shape.{segment.rows}x-1", np.array([segment.rows, -1]))])


def _repeated(graph: ir.Graph, tape: ir.tape.Tape, value: ir.Value, rows: int, times: int) -> ir.Value:
    """[rows, blocks] → [rows, blocks·times], each block's number repeated for its ``times`` smaller blocks."""
    spread = tape.op("Unsqueeze", [value, _shared(graph, "axis.last", np.array([-1]))])
    spread = tape.op("Expand", [spread, _shared(graph, f"shape.1x1x{times}", np.array([1, 1, times]))])
    return tape.op("Reshape", [spread, _shared(graph, f"shape.{rows}x-1", np.array([rows, -1]))])


def _matmul_nbits_attributes(k: int, n: int, bits: int, block_size: int, accuracy_level: int) -> dict[str, int]:
    # 8-bit weights compute with int8 activations (level 4) unless fp32 is asked for, which _nbits_product gives
    # them as two 4-bit products: ONNX Runtime's fp32 kernel for 8-bit weights is slow (SmolLM2's lm_head alone
    # took 85 ms a step at level 1)
    level = accuracy_level if bits == 4 else 4
    return {"K": k, "N": n, "bits": bits, "block_size": block_size, "accuracy_level": level}
