"""A second step graph for prompt chunks, over the same weights file: where the int4/int8 pass computes a product
from split activations (``passes/_weights._split_rows``: x as two rows of int8 activations, summed — fp32 accuracy
at the int8 kernel's speed for one decode row), the prefill graph feeds x itself to the same weights at fp32
activations (``accuracy_level`` 1): the exact product the split approximates (within 5e-3 of logits).

Why two graphs: for a prompt chunk of hundreds of rows ONNX Runtime's int8 kernel (level 4) is at most a little
faster than its fp32 kernel (level 1) — slower on an AVX2 CPU (SmolLM2's 576 × 3072 product, 1,024 rows, one
thread: 210 ms at level 4, 149 ms at level 1), 5–12 % faster on an AVX-512 VNNI one (docs/BENCHMARKS.md, "Ninth
round") — so the split's doubled rows make a chunk slower than level 1 everywhere (~2.6× on the AVX2 CPU); for
one decode row the split is what pays (level 1 decodes at ~0.3× of it). The runtime runs multi-token steps
on ``model.prefill_file`` and one-token steps on ``model.file``, with one set of cache buffers bound to both.

Each graph then holds only the branch of the compressed-cache op it runs (``_one_branch``): ``model.onnx`` the
one-token decode branch, ``prefill.onnx`` the general one — no ``If`` per layer in a decode step. So a bundle with a
prefill graph runs multi-token steps on it alone (``model.onnx`` refuses them: the decode branch's Reshape of q fails).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgec.kvcache.spec import CacheSpec

PREFILL_FILE = "prefill.onnx"


def write_prefill_graph(folder: Path, native_decode: CacheSpec | None = None) -> dict[str, Any]:
    """Write ``prefill.onnx`` beside ``model.onnx`` (weights stay references into model.onnx.data, never copied)
    when the graph has split-activation products, or when its one-token steps read the slots through
    GroupQueryAttention (``native_decode``: the cache spec of a bundle built with ``Compression.decode_kernel``
    gqa, whose presents the decode graph exposes, ``expose_decode_present``); returns the manifest's model entries
    for it ({} if none)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    model = ir.load(folder / "model.onnx")
    rewritten = sum(_unsplit(node) for node in list(model.graph) if node.op_type == "MatMulNBits")
    if not rewritten and native_decode is None:
        return {}
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.save(model, folder / f"{PREFILL_FILE}.tmp")
    _one_branch(folder / f"{PREFILL_FILE}.tmp", "general")
    (folder / f"{PREFILL_FILE}.tmp").replace(folder / PREFILL_FILE)
    _one_branch(folder / "model.onnx", "decode")  # model.onnx: one-token steps only, from now on
    if native_decode is not None:
        expose_decode_present(folder / "model.onnx", native_decode)
    return {"prefill_file": PREFILL_FILE}


def expose_decode_present(path: Path, spec: CacheSpec) -> int:
    """Make GroupQueryAttention's presents in a decode graph graph outputs (``spec.present_name``), which the
    runtime binds to the k/v state's own buffers: the kernel then reads and writes the slots in place (its
    static-cache mode) instead of copying every slot into a fresh present each step. The op's function is
    inlined first (an output inside a function cannot be bound; ONNX Runtime inlines it at load anyway).
    Rewrites ``path`` (temp file + rename; weights stay references); returns how many presents it exposed."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    from edgec.kvcache.spec import StateTensor, present_name

    model = ir.load(path)
    onnx_ir.passes.common.InlinePass()(model)
    inputs = {value.name: value for value in model.graph.inputs}
    # the compressed layers' k/v state inputs → (layer, name): the pasts the kernel reads
    pasts = {
        StateTensor(layer.layer, name).input: (layer.layer, name)
        for layer in spec.layers
        if layer.compressed
        for name in ("k", "v")
    }
    exposed = 0
    for node in model.graph:
        if node.op_type != "GroupQueryAttention" or "qk_output" not in node.attributes:
            continue
        for index in (1, 2):  # present k, v ← past k, v (inputs 3, 4)
            past = node.inputs[index + 2]
            if past is None or past.name not in pasts or inputs.get(past.name) is not past:
                continue
            present = node.outputs[index]
            present.name = present_name(*pasts[past.name])
            present.type, present.shape = past.type, past.shape
            model.graph.outputs.append(present)
            exposed += 1
    if exposed != len(pasts):  # a layer left copying its slots each step would be slow, never wrong: say so now
        raise RuntimeError(f"{path.name}: {exposed} of {len(pasts)} k/v slot buffers are read by the decode kernel")
    temporary = path.with_name(f"{path.name}.present")
    ir.save(model, temporary)
    temporary.replace(path)
    return exposed


def _one_branch(path: Path, kind: str) -> bool:
    """Rewrite the graph at ``path`` (temp file + rename; its weights stay references into their file) with each
    compressed-cache op's body reduced to one branch of its ``If`` (``compressed_function.single_branch``):
    ``general`` for the prompt-chunk graph, ``decode`` for the graph that then runs one-token steps only. Per
    decode step this saves an ``If`` per layer — the subgraph's launch and its copies of every state tensor's
    name bindings (SmolLM2, 30 layers: ~12 % of a 1,024-slot int4 step). False when it has no such op."""
    import onnx

    from edgec.kvcache import compressed_function

    model = onnx.load(str(path), load_external_data=False)
    found = False
    for index, function in enumerate(model.functions):
        if (function.domain, function.name) == (compressed_function.DOMAIN, compressed_function.OP_TYPE):
            model.functions[index].CopyFrom(compressed_function.single_branch(function, kind))
            found = True
    if found:
        temporary = path.with_name(f"{path.name}.branch")
        onnx.save(model, str(temporary))
        temporary.replace(path)
    return found


def _unsplit(node) -> bool:
    """MatMulNBits(split rows of x) → halves summed  ⇒  MatMulNBits(x) at fp32 activations. False if ``node`` is
    not that pattern (``_split_rows``: Reshape(Concat(high, Sub(blocks, high))), blocks = Reshape(x); the result
    read by Reshape [0, 2, -1, N] and ReduceSum over axis 1). 8-bit codes without zero points become their nibble
    pair there (``_weights.at_fp32_activations``): ONNX Runtime's fp32 kernel for 8-bit weights is slow."""
    import onnx_ir as ir

    from edgec.passes._weights import at_fp32_activations

    def producer(value, op_type):
        node = value.producer() if value is not None else None
        return node if node is not None and node.op_type == op_type else None

    rows = producer(node.inputs[0], "Reshape")
    concat = producer(rows.inputs[0], "Concat") if rows else None
    sub = producer(concat.inputs[1], "Sub") if concat and len(concat.inputs) == 2 else None
    blocks = producer(sub.inputs[0], "Reshape") if sub else None
    uses = list(node.outputs[0].uses())
    pairs = uses[0].node if len(uses) == 1 and uses[0].node.op_type == "Reshape" else None
    pair_uses = list(pairs.outputs[0].uses()) if pairs else []
    total = pair_uses[0].node if len(pair_uses) == 1 and pair_uses[0].node.op_type == "ReduceSum" else None
    if blocks is None or total is None:
        return False
    graph = node.graph
    product = at_fp32_activations(graph, node, blocks.inputs[0])
    summed = total.outputs[0]
    if summed.is_graph_output():  # the logits: the product takes the output's place and name
        index = list(graph.outputs).index(summed)
        name, summed.name = summed.name, f"{summed.name}.split"
        product.name, product.type, product.shape = name, summed.type, summed.shape
        graph.outputs[index] = product
    ir.convenience.replace_all_uses_with(summed, product)
    return True
