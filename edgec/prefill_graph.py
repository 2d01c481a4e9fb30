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


def write_prefill_graph(
    folder: Path, native_decode: CacheSpec | None = None, context: int = 0, cache: CacheSpec | None = None
) -> dict[str, Any]:
    """Write ``prefill.onnx`` beside ``model.onnx`` (weights stay references into model.onnx.data, never copied)
    when the graph has split-activation products, when its one-token steps read the slots through
    GroupQueryAttention (``native_decode``: the cache spec of a bundle built with ``Compression.decode_kernel``
    gqa, whose presents the decode graph exposes, ``expose_decode_present``; ``context``: the bundle's longest
    sequence, the positions its rotary tables cover), or when its compressed layers' prompt chunks read fp32 slots
    through the kernel over the state (``cache``: the bundle's cache spec; ``expose_chunk_present``); returns the
    manifest's model entries for it ({} if none), with the extend graph's where it has one (``extend_graph``)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    model = ir.load(folder / "model.onnx")
    rewritten = sum(_unsplit(node) for node in list(model.graph) if node.op_type == "MatMulNBits")
    chunk_kernel = cache is not None and _has_state_kernel(model)
    if not rewritten and native_decode is None and not chunk_kernel:
        return {}
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.save(model, folder / f"{PREFILL_FILE}.tmp")
    _one_branch(folder / f"{PREFILL_FILE}.tmp", "general")
    if chunk_kernel:
        expose_chunk_present(folder / f"{PREFILL_FILE}.tmp", cache, context)
    (folder / f"{PREFILL_FILE}.tmp").replace(folder / PREFILL_FILE)
    entries = {"prefill_file": PREFILL_FILE}
    if chunk_kernel:  # the chunks that only extend the slots on a graph without the branches they never take
        from edgec.extend_graph import write_extend_graph

        entries |= write_extend_graph(folder, PREFILL_FILE, cache)
    _one_branch(folder / "model.onnx", "decode")  # model.onnx: one-token steps only, from now on
    if native_decode is not None:
        expose_decode_present(folder / "model.onnx", native_decode, context)
    return entries


# how a decode graph over fp32 slots attends once its evictions are batched: "matmul" (standard ops,
# decode_kernels_as_matmuls) or "kernel" (GroupQueryAttention); measured in docs/BENCHMARKS.md, "Twentieth round"
DECODE_ATTENTION = "matmul"
# whether prompt chunks over fp32 slots fold RoPE into the kernel (fold_chunk_rotary); tests compare both
CHUNK_ROTARY = True


def expose_decode_present(path: Path, spec: CacheSpec, context: int = 0) -> int:
    """Make GroupQueryAttention's presents in a decode graph graph outputs (``spec.present_name``), which the
    runtime binds to the k/v state's own buffers: the kernel then reads and writes the slots in place (its
    static-cache mode) instead of copying every slot into a fresh present each step. The op's function is
    inlined first (an output inside a function cannot be bound; ONNX Runtime inlines it at load anyway), and
    with ``context`` > 0 the model's head split and RoPE are folded into each kernel (``fold_decode_rotary``);
    the windowless layers share one bias (``share_decode_bias``) and one eviction (``batch_decode_evictions``), and
    all read one slot count (``share_slot_count``).
    Rewrites ``path`` (temp file + rename; weights stay references); returns how many presents it exposed."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    model = ir.load(path)
    onnx_ir.passes.common.InlinePass()(model)
    if context:
        fold_decode_rotary(model, context)
    share_decode_bias(model, spec)
    batched = batch_decode_evictions(model, spec)
    exposed = _expose_presents(model, path, spec, _is_decode_kernel, "decode kernel", save=False)
    if batched and DECODE_ATTENTION == "matmul":
        decode_kernels_as_matmuls(model, spec)
    if share_slot_count(model) or batched:
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        onnx_ir.passes.common.TopologicalSortPass()(model)
    _save_over(model, path)
    return exposed


def expose_chunk_present(path: Path, spec: CacheSpec, context: int = 0) -> int:
    """Make the presents of each compressed layer's kernel over the state (``compressed_function._state_kernel``:
    GroupQueryAttention whose past is the k/v state input itself) outputs of a prompt-chunk graph, named
    ``spec.present_name`` as in a decode graph. The runtime binds them to the state's own buffers where a call is
    known to fit the buffer (``OrtCacheState``): the kernel then writes the chunk's rows in place instead of
    copying every row of the buffer into a fresh present — for the temporary state of an `end` prompt, the whole
    prompt's length per layer and chunk. The op's function is inlined first (an output inside a function cannot
    be bound; onnx's C++ inliner: onnx_ir's InlinePass takes ~20 s on SmolLM2's 30 general bodies, this 0.1 s);
    with ``context`` > 0 the model's head split and RoPE are folded into each kernel (``fold_chunk_rotary``).
    Rewrites ``path`` (temp file + rename; weights stay references); returns how many it exposed."""
    import onnx
    import onnx.inliner
    import onnx_ir as ir

    inlined = onnx.inliner.inline_local_functions(onnx.load(str(path), load_external_data=False))
    onnx.save(inlined, str(path))
    model = ir.load(path)
    if context and CHUNK_ROTARY:
        fold_chunk_rotary(model, context)
    return _expose_presents(model, path, spec, _is_chunk_kernel, "chunk kernel")


def _expose_presents(model: Any, path: Path, spec: CacheSpec, is_kernel: Any, kind: str, save: bool = True) -> int:
    """In an inlined graph, make the presents of each ``is_kernel`` node that reads a compressed layer's k/v
    state input as its past graph outputs (``spec.present_name``); with ``save``, save ``model`` over ``path``
    (``_save_over``); returns how many. Every compressed k/v must be found: a layer left copying its slots would
    be slow, never wrong, so it is said at build time."""

    from edgec.kvcache.spec import StateTensor, present_name

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
        if not is_kernel(node):
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
    if exposed != len(pasts):
        raise RuntimeError(f"{path.name}: {exposed} of {len(pasts)} k/v slot buffers are read by the {kind}")
    if save:
        _save_over(model, path)
    return exposed


def _save_over(model: Any, path: Path) -> None:
    """Save ``model`` over ``path``: a temporary file, then a rename (its weights stay references)."""
    import onnx_ir as ir

    temporary = path.with_name(f"{path.name}.present")
    ir.save(model, temporary)
    temporary.replace(path)


def _has_state_kernel(model: Any) -> bool:
    """Whether the compressed-cache op's body holds the kernel over the state (fp32 slots, ONNX Runtime)."""
    from edgec.kvcache.compressed_function import DOMAIN, OP_TYPE

    def named(graph: Any) -> bool:
        for node in graph:
            if _is_chunk_kernel(node):
                return True
            if any(named(attribute.value) for attribute in node.attributes.values() if attribute.type == 5):
                return True  # 5: AttributeType.GRAPH — an If's branch
        return False

    return any(named(function) for key, function in model.functions.items() if (key[0], key[1]) == (DOMAIN, OP_TYPE))


def fold_decode_rotary(model: Any, context: int) -> int:
    """In an inlined decode graph, let each compressed layer's GroupQueryAttention (``_decode_gqa``) take the
    model's packed q/k/v projection and apply RoPE itself (``do_rotary``, cos/sin tables for positions
    0..context evaluated from the model's own rotary subgraph, explicit ``position_ids``), as
    ``passes/kv_attention_gqa`` does for plain layers: the head split (Reshape, Transpose ×3), both
    RotaryEmbeddings and the kernel's input Reshapes go — ~12 nodes per layer (SmolLM2, 1,024 slots, two CPU
    cores: a few per cent of a step, measured side by side). The eviction tail then reads the token's rotated
    k and its v from the row the kernel wrote them into (the spare row, the buffer's last). A layer whose q/k/v
    are not one packed projection with standard RoPE keeps its inputs. ONNX Runtime refuses a position outside
    the tables; the runtime never feeds one (generation stops at the context). Returns how many layers folded."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    from edgec.passes._graph import take_over
    from edgec.passes.kv_attention_gqa import _i64, _merge_heads_away, _packed_rotary_source, _rope_tables

    graph = model.graph
    position_ids = next((value for value in graph.inputs if value.name == "position_ids"), None)
    if position_ids is None:
        return 0
    tables: dict[ir.Value, tuple[ir.Value, ir.Value]] = {}
    folded = 0
    for node in list(graph):
        if not _is_decode_kernel(node) or "do_rotary" in node.attributes or len(node.inputs) != 11:
            continue
        heads, kv_heads = node.attributes["num_heads"].as_int(), node.attributes["kv_num_heads"].as_int()
        head_dim = node.inputs[3].shape[3] if node.inputs[3].shape is not None else None
        # the body's Reshapes of q [B,H,1,D], k and v [B,Hkv,1,D] into the kernel's [B,1,N·D]
        token = [_reshaped_from(value) for value in node.inputs[:3]]
        if None in token or not isinstance(head_dim, int):
            continue
        packed = _packed_rotary_source(*token, heads, kv_heads, head_dim)
        if packed is None:
            continue
        qkv, cos, sin = packed
        angles = cos.producer().inputs[0] if cos.producer() is not None else cos  # one table per angle tensor
        if angles not in tables:
            # rows for every position, and at least the kernel's total length (C + 1 rows ≤ context + 1)
            rows = context + 1
            tables[angles] = _rope_tables(graph, cos, sin, position_ids, rows, len(tables), prefix="decode_rope")
        cos_table, sin_table = tables[angles]
        inputs = [qkv, None, None, *node.inputs[3:7], cos_table, sin_table, position_ids, node.inputs[10]]
        attributes = [*node.attributes.values(), ir.AttrInt64("do_rotary", 1), ir.AttrInt64("rotary_interleaved", 0)]
        kernel = ir.Node("com.microsoft", "GroupQueryAttention", inputs, attributes, num_outputs=4)
        tape = ir.tape.Tape(graph_like=graph)
        spare, end, rows = _i64(tape, [-1]), _i64(tape, [2**62]), _i64(tape, [2])
        spare_k = tape.op("Slice", [kernel.outputs[1], spare, end, rows])  # [B,Hkv,1,D]: the token, rotated
        spare_v = tape.op("Slice", [kernel.outputs[2], spare, end, rows])
        graph.insert_before(node, [kernel, *tape.nodes])
        for old, new in zip(node.outputs, kernel.outputs, strict=True):
            take_over(old, new)
        reshapes = [value.producer() for value in node.inputs[:3]]
        graph.remove(node, safe=True)
        graph.remove([r for r in reshapes if not r.outputs[0].uses() and not r.outputs[0].is_graph_output()], safe=True)
        # what else read the token's rotated k and its v (the eviction tail's scatter) reads the kernel's copy
        token[1].replace_all_uses_with(spare_k)
        token[2].replace_all_uses_with(spare_v)
        out = kernel.outputs[0]
        for use in list(out.uses()):  # the body's [B,1,H,D] (through the inlined Identity) the model merges back
            if use.node.op_type == "Reshape":  # into [B,1,H·D]: the kernel's own output
                merged = use.node.outputs[0]
                while len(merged.uses()) == 1 and next(iter(merged.uses())).node.op_type == "Identity":
                    merged = next(iter(merged.uses())).node.outputs[0]
                _merge_heads_away(graph, merged, out, heads * head_dim)
        folded += 1
    if folded:
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return folded


def fold_chunk_rotary(model: Any, context: int) -> int:
    """In an inlined prompt-chunk graph, let each compressed layer's kernel over the state
    (``compressed_function._state_kernel``) take the model's packed q/k/v projection and apply RoPE itself
    (``do_rotary``, cos/sin tables for positions 0..context from the model's own rotary subgraph, explicit
    ``position_ids``), as ``passes/kv_attention_gqa`` does for plain layers. Every chunk of an `end` prompt
    appends, and there nothing else needs the rotated q/k: the appending branch's k/v rows are the kernel's
    present rows [active, active + T) (the If's condition implies the kernel's: it wrote all T there). So the
    model's Split, head splits and both RotaryEmbeddings move into the judged branch, the only one that reads
    them, and the kernel's input Transposes and Slices go (SmolLM2, a 512-token chunk, two cores: ~0.6 ms a layer
    net of the packed projection's Slice; docs/BENCHMARKS.md, "Twenty-second round"). A layer in any other shape
    keeps its inputs. Returns how many layers folded."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    from edgec.passes._graph import take_over
    from edgec.passes.kv_attention_gqa import _i64, _packed_rotary_source, _rope_tables

    graph = model.graph
    position_ids = next((value for value in graph.inputs if value.name == "position_ids"), None)
    if position_ids is None:
        return 0
    owners = _branch_owners(graph)
    # the values themselves, not their ids: a node removed below frees its outputs, and a value made later may
    # take a freed one's address (its id), which would then escape the renaming at the end
    existing = {value for node in graph.all_nodes() for value in node.outputs}
    tables: dict[Any, tuple[Any, Any]] = {}
    folded = 0
    for kernel in [node for node in graph if _is_chunk_kernel(node)]:
        found = _chunk_kernel_sources(kernel)
        if found is None:
            continue
        first, width, (q, k, v), packing = found
        heads, kv_heads = kernel.attributes["num_heads"].as_int(), kernel.attributes["kv_num_heads"].as_int()
        head_dim = width // heads
        packed = _packed_rotary_source(q, k, v, heads, kv_heads, head_dim)
        switch = _appending_switch(owners, (q, k, v))
        total = _kernel_total(kernel)
        if packed is None or switch is None or total is None:
            continue
        qkv, cos, sin = packed
        chain = _producers_between(qkv, (q, k, v))  # Split, head splits, RotaryEmbeddings: in graph order
        if chain is None or chain[0].op_type != "Split":
            continue
        append, judged = (switch.attributes[name].value for name in ("then_branch", "else_branch"))
        if not _only_used_where_expected(chain, (q, k, v), append, owners, switch):
            continue
        angles = cos.producer().inputs[0] if cos.producer() is not None else cos
        if angles not in tables:
            tables[angles] = _rope_tables(graph, cos, sin, position_ids, context + 1, len(tables), prefix="chunk_rope")
        cos_table, sin_table = tables[angles]
        tape = ir.tape.Tape(graph_like=graph)
        end, axis = _i64(tape, [2**62]), _i64(tape, [1])
        rows_qkv = tape.op("Slice", [qkv, first, end, axis])  # the last `rows` tokens (all of them where it appends)
        rows_positions = tape.op("Slice", [position_ids, first, end, axis])
        inputs = [rows_qkv, None, None, *kernel.inputs[3:7], cos_table, sin_table, rows_positions]
        attributes = [*kernel.attributes.values(), ir.AttrInt64("do_rotary", 1), ir.AttrInt64("rotary_interleaved", 0)]
        new = ir.Node("com.microsoft", "GroupQueryAttention", inputs, attributes, num_outputs=3, name=kernel.name)
        graph.insert_before(kernel, [*tape.nodes, new])
        kernel.name = f"{kernel.name}__replaced"
        for old, value in zip(kernel.outputs, new.outputs, strict=True):
            take_over(old, value)
        graph.remove([kernel, *packing], safe=True)  # the packing was read by the old kernel alone
        # the main graph's Shapes of q/k/v: the same dims from the packed projection and the kernel's attributes
        dims = _dims_from_packed(graph, chain[0], qkv, {q: heads, k: kv_heads, v: kv_heads}, head_dim)
        for value in (q, k, v):
            for use in list(value.uses()):
                if use.node.graph is graph and use.node.op_type == "Shape":
                    _replace_shape(graph, use.node, dims[value])
        # the appending branch's rows: what the kernel wrote into its present
        active, written_end = total.inputs[0], total.outputs[0]
        for value, present in ((k, new.outputs[1]), (v, new.outputs[2])):
            for use in list(value.uses()):
                if use.node.graph is append:
                    _rows_from_present(append, use.node, present, active, written_end)
        # what remains reads q/k/v inside the judged branch: compute them there
        graph.remove(chain)
        judged.insert_before(next(iter(judged)), chain)
        folded += 1
    if folded:
        model.opset_imports.setdefault("com.microsoft", 1)
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        # each graph names what is inserted into it (val_0, ...): the 30 appending branches' names would repeat,
        # and a model's names must be unique across its subgraphs
        named = existing | set(graph.outputs)
        made = [v for node in graph.all_nodes() for v in node.outputs if v not in named]
        for index, value in enumerate(made):
            value.name = f"chunk_rotary_{index}"
    return folded


def _chunk_kernel_sources(kernel: Any) -> tuple[Any, int, tuple[Any, Any, Any], list[Any]] | None:
    """(first, H·D, (q, k, v), the packing's nodes) where the kernel's q/k/v are ``compressed_function._kernel``'s
    packing of the body's [B,H,T,D] q, k, v: Slice(Reshape(Transpose(x, [0,2,1,3]), [0,0,N·D]), first, ∞, axis 1);
    else None."""
    from edgec.passes.kv_attention_gqa import _constant_ints

    if len(kernel.inputs) != 7 or "do_rotary" in kernel.attributes:
        return None
    sources, firsts, widths, packing = [], [], [], []
    for value in kernel.inputs[:3]:
        piece = value.producer() if value is not None else None
        if piece is None or piece.op_type != "Slice" or len(piece.inputs) < 4:
            return None
        reshape = piece.inputs[0].producer()
        shape = _constant_ints(reshape.inputs[1]) if reshape is not None and reshape.op_type == "Reshape" else None
        transpose = reshape.inputs[0].producer() if shape is not None else None
        perm = transpose.attributes.get("perm") if transpose is not None and transpose.op_type == "Transpose" else None
        if perm is None or tuple(perm.as_ints()) != (0, 2, 1, 3) or len(shape) != 3:
            return None
        sources.append(transpose.inputs[0])
        firsts.append(piece.inputs[1])
        widths.append(shape[2])
        packing += [piece, reshape, transpose]
    if len(set(map(id, firsts))) != 1:
        return None
    return firsts[0], widths[0], tuple(sources), packing


def _kernel_total(kernel: Any) -> Any:
    """The Add(active, rows) node whose sum is the kernel's total length (``_kernel``), or None."""
    cast = kernel.inputs[6].producer()
    squeeze = cast.inputs[0].producer() if cast is not None and cast.op_type == "Cast" else None
    total = squeeze.inputs[0].producer() if squeeze is not None and squeeze.op_type == "Squeeze" else None
    return total if total is not None and total.op_type == "Add" else None


def _branch_owners(graph: Any) -> dict[Any, tuple[Any, str]]:
    """Every subgraph of ``graph``'s If nodes (nested ones too) → (the main graph's If, its attribute)."""
    owners: dict[Any, tuple[Any, str]] = {}

    def walk(subgraph: Any, owner: tuple[Any, str]) -> None:
        owners[subgraph] = owner
        for node in subgraph:
            for attribute in node.attributes.values():
                if attribute.type == 5:  # AttributeType.GRAPH
                    walk(attribute.value, owner)

    for node in graph:
        if node.op_type == "If":
            for name in ("then_branch", "else_branch"):
                walk(node.attributes[name].value, (node, name))
    return owners


def _appending_switch(owners: dict[Any, tuple[Any, str]], values: tuple[Any, ...]) -> Any:
    """The main graph's If (``compressed_function._appending``) whose branches hold every subgraph use of
    ``values``, when its then-branch is the appending one; else None."""
    from edgec.kvcache.compressed_function import APPEND_OR_JUDGE

    switches = {owners[use.node.graph][0] for value in values for use in value.uses() if use.node.graph in owners}
    if len(switches) != 1:
        return None
    switch = next(iter(switches))
    return switch if switch.attributes["then_branch"].value.name == APPEND_OR_JUDGE[0] else None


def _producers_between(source: Any, values: tuple[Any, ...]) -> list[Any] | None:
    """The Split, Reshapes, Transposes and RotaryEmbeddings computing ``values`` from ``source``, in graph order
    (walking first inputs back to it: their other inputs — shapes, cos/sin — stay where they are computed, before
    them); None when any other op lies between."""
    nodes, stack = {}, [value.producer() for value in values]
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        nodes[id(node)] = node
        if source in node.inputs:
            continue
        # the head splits' Reshape shapes and the rotary's cos/sin are computed outside: not part of the chain
        if node.op_type in ("Reshape", "Transpose", "RotaryEmbedding", "Split"):
            stack.append(node.inputs[0].producer())
        else:
            return None
    order = {id(node): index for index, node in enumerate(source.producer().graph if source.producer() else [])}
    if not order:
        return None
    return sorted(nodes.values(), key=lambda node: order.get(id(node), -1))


def _only_used_where_expected(chain: list[Any], qkv: tuple[Any, Any, Any], append: Any, owners, switch) -> bool:
    """Every output of ``chain`` read only by the chain itself, the main graph's Shapes of q/k/v, Identities of k
    and v in the appending branch, or anything in the switch's other (judged) branch."""
    q, k, v = qkv
    members = set(chain)
    for node in chain:
        for value in node.outputs:
            if value.is_graph_output():
                return False
            for use in value.uses():
                reader = use.node
                if reader in members:
                    continue
                if reader.graph is node.graph:
                    if reader.op_type == "Shape" and value in qkv:
                        continue
                    if _is_chunk_kernel_packing(reader):
                        continue
                    return False
                owner = owners.get(reader.graph)
                if owner is None or owner[0] is not switch:
                    return False
                appending = reader.graph is append and reader.op_type == "Identity" and value in (k, v)
                if owner[1] == "then_branch" and not appending:  # the chain moves into the other branch
                    return False
    return True


def _is_chunk_kernel_packing(node: Any) -> bool:
    """The [B,H,T,D] → [B,T,H·D] Transpose of ``compressed_function._kernel``'s packing, read by a chunk kernel's
    Slice alone (through its Reshape)."""
    if node.op_type != "Transpose":
        return False
    reshapes = [use.node for use in node.outputs[0].uses()]
    slices = [use.node for reshape in reshapes for use in reshape.outputs[0].uses()]
    kernels = [use.node for piece in slices for use in piece.outputs[0].uses()]
    return bool(kernels) and all(_is_chunk_kernel(kernel) for kernel in kernels)


def _dims_from_packed(graph: Any, before: Any, qkv: Any, heads: dict[Any, int], head_dim: int) -> dict[Any, list]:
    """For each of q/k/v [B, heads, T, D]: its four dims as values ([1] int64 each) — B and T read from the
    packed projection [B,T,·], the heads and D constants — inserted before ``before``."""
    import onnx_ir as ir

    from edgec.passes.kv_attention_gqa import _i64

    tape = ir.tape.Tape(graph_like=graph)
    batch = tape.op("Shape", [qkv], attributes={"start": 0, "end": 1})
    tokens = tape.op("Shape", [qkv], attributes={"start": 1, "end": 2})
    size = _i64(tape, [head_dim])
    counts = {count: _i64(tape, [count]) for count in set(heads.values())}
    graph.insert_before(before, tape.nodes)
    return {value: [batch, counts[count], tokens, size] for value, count in heads.items()}


def _replace_shape(graph: Any, shape: Any, dims: list) -> None:
    """Shape(x, start, end) of a rank-4 x → the matching ``dims`` (one value, or their Concat)."""
    import onnx_ir as ir

    start = shape.attributes["start"].as_int() if "start" in shape.attributes else 0
    end = shape.attributes["end"].as_int() if "end" in shape.attributes else 4
    picked = dims[slice(start + 4 if start < 0 else start, end + 4 if end < 0 else min(end, 4))]
    if len(picked) == 1:
        shape.outputs[0].replace_all_uses_with(picked[0], replace_graph_outputs=False)
    else:
        concat = ir.Node("", "Concat", picked, [ir.AttrInt64("axis", 0)])
        graph.insert_before(shape, concat)
        shape.outputs[0].replace_all_uses_with(concat.outputs[0])
    graph.remove(shape, safe=True)


def _rows_from_present(branch: Any, identity: Any, present: Any, active: Any, written_end: Any) -> None:
    """Identity(k) in the appending branch → Slice(present, active, active + T, axis 2): the rows the kernel wrote."""
    import onnx_ir as ir

    from edgec.passes._graph import take_over
    from edgec.passes.kv_attention_gqa import _i64

    tape = ir.tape.Tape(graph_like=branch)
    rows = tape.op("Slice", [present, active, written_end, _i64(tape, [2])])
    branch.insert_before(identity, tape.nodes)
    take_over(identity.outputs[0], rows)
    branch.remove(identity, safe=True)


def share_decode_bias(model: Any, spec: CacheSpec) -> int:
    """In an inlined decode graph, give every compressed layer without a sliding window one attention bias,
    [B, 1, 1, C + 1], computed once per step from the first such layer's slot positions, in place of each
    layer's own [B, H, 1, C + 1] (``_decode_gqa``: ~13 nodes per layer of masks, pads and expands to the query
    heads). Without a window a layer's bias only hides its empty slots, and those are the same in every head
    and every such layer: each step writes one token into every head of every layer, empty slots fill lowest
    first, a prompt's chunks fill them in order and an ``end`` prompt's selection fills them all. The layers
    with a window keep their own, and so do all layers under a policy that prunes (``adaptive`` empties slots per
    head and layer). Returns how many kernels take the shared bias."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    from edgec.kvcache import policies
    from edgec.kvcache.spec import StateTensor
    from edgec.passes.kv_attention_gqa import _i64

    graph = model.graph
    if spec.compression is not None and policies.get(spec.compression.policy).prunes:
        return 0  # a pruning policy empties slots per head and layer: each layer's bias is its own
    global_layers = [layer.layer for layer in spec.layers if layer.compressed and not layer.window]
    windowless = {StateTensor(layer, "k").input: layer for layer in global_layers}
    inputs = {value.name: value for value in graph.inputs}
    kernels = [
        node
        for node in graph
        if _is_decode_kernel(node)
        and len(node.inputs) == 11
        and node.inputs[10] is not None
        and node.inputs[3] is not None
        and node.inputs[3].name in windowless
    ]
    positions = inputs.get(StateTensor(windowless[kernels[0].inputs[3].name], "pos").input) if kernels else None
    if positions is None:
        return 0
    tape = ir.tape.Tape(graph_like=graph)
    zero = tape.op("Constant", [], attributes={"value": ir.tensor(0.0, dtype=ir.DataType.FLOAT)})
    hidden = tape.op("Constant", [], attributes={"value": ir.tensor(float("-inf"), dtype=ir.DataType.FLOAT)})
    first_head = tape.op("Slice", [positions, _i64(tape, [0]), _i64(tape, [1]), _i64(tape, [1])])  # [B,1,C]
    filled = tape.op("GreaterOrEqual", [first_head, _i64(tape, [0])])
    mask = tape.op("Where", [filled, zero, hidden])
    # the spare row (the token itself) is always seen; one row for every query head: [B,1,1,C+1]
    mask = tape.op("Pad", [mask, _i64(tape, [0, 0, 0, 0, 0, 1]), zero])
    bias = tape.op("Unsqueeze", [mask, _i64(tape, [2])])
    graph.insert_before(kernels[0], tape.nodes)
    for kernel in kernels:
        kernel.replace_input_with(10, bias)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return len(kernels)


def batch_decode_evictions(model: Any, spec: CacheSpec) -> int:
    """In an inlined decode graph, run the one-token eviction of every compressed layer without a sliding window
    once, over all of them: their slot positions, scores and the kernels' probabilities concatenated along the
    head axis (layer after layer), then ``_evict_into_weakest`` as the op runs it — the policy's update, the
    forced slots, ArgMin — for layers × KV heads at once, and each layer's k and v written into its weakest slots
    by its own scatter, as before (a ScatterND of the token's row per KV head: ``_scatter_rows_instead``). The
    arithmetic is per KV head, so every result is the same bits; what goes is ~25 small nodes per layer (SmolLM2:
    ~700 of a step's ~3,200 kernels, ONNX Runtime's per-node cost).
    The positions and scores are written by one ScatterElements each and split back into the layers' outputs;
    every reader of those state inputs (the concatenation, the shared bias) stays an ancestor of that write, as
    the in-place binding requires (the kernels' probabilities, or for a policy that reads none the last kernel's
    output, order it); the v writes also wait for the last kernel's output. Returns how many layers it batched
    (0: the graph is left as it was)."""
    from edgec.kvcache import compressed_function, policies
    from edgec.kvcache.onnx_body import Body
    from edgec.kvcache.spec import StateTensor, output_name
    from edgec.passes._graph import take_over

    compression = spec.compression
    graph = model.graph
    layers = [layer for layer in spec.layers if layer.compressed and not layer.window]
    if compression is None or len(layers) < 2 or compression.decode_kernel != "gqa":
        return 0
    values = {value.name: value for value in graph.inputs}
    for node in graph:
        values.update((output.name, output) for output in node.outputs)
    kernels = {node.inputs[3].name: node for node in graph if _is_decode_kernel(node) and node.inputs[3] is not None}
    names = ("k", "v", "pos", "score")
    writes = {}
    for layer in layers:
        kernel = kernels.get(StateTensor(layer.layer, "k").input)
        outputs = {name: values.get(output_name(layer.layer, name)) for name in names}
        producers = {name: _through_identity(value) for name, value in outputs.items()}
        # k and v are written by a scatter whose index this takes over; pos and score are replaced whole
        written = [producers[name] for name in ("k", "v")]
        if kernel is None or any(node is None or node.op_type != "ScatterElements" for node in written):
            return 0  # (the op's body writes a token's k/v by ScatterElements; this pass makes them ScatterND)
        if any(producers[name] is None for name in ("pos", "score")):
            return 0
        writes[layer.layer] = (kernel, producers)
    policy = policies.get(compression.policy)
    query_heads = {writes[layer.layer][0].attributes.get_int("num_heads") for layer in layers}
    if len(query_heads) > 1 or len({(layer.num_kv_heads, layer.head_dim) for layer in layers}) > 1:
        return 0  # one head layout for all, so that the concatenation is layers × heads
    n = len(layers)
    heads = compressed_function.Heads(query_heads.pop() * n, layers[0].num_kv_heads * n, layers[0].head_dim)
    b = Body(prefix="evict_all/")
    pos = b.op("Concat", *[StateTensor(layer.layer, "pos").input for layer in layers], axis=1)  # [B,n·Hkv,C]
    score = b.op("Concat", *[StateTensor(layer.layer, "score").input for layer in layers], axis=1)
    capacity = b.shape(pos, 2)
    total = None
    if policy.needs:
        # each layer's probabilities [B,H,1,C+1] summed over each KV head's query heads as _decode_gqa does, then
        # concatenated: a third of the bytes to copy than concatenating the probabilities first (SmolLM2: 0.37
        # against 1.1 MB a step)
        rows = b.op("Add", capacity, b.i64([1]))
        grouped_shape = b.op("Concat", b.i64([0, layers[0].num_kv_heads, heads.query // heads.kv]), rows, axis=0)
        probs = [writes[layer.layer][0].outputs[3].name for layer in layers]
        sums = [b.op("ReduceSum", b.op("Reshape", p, grouped_shape), b.i64([2]), keepdims=0) for p in probs]
        total = b.op("Concat", *sums, axis=1)  # [B,n·Hkv,C+1]
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    step = compressed_function._Step(capacity, b.op("GreaterOrEqual", pos, b.i64(0)), position)
    last_out = writes[layers[-1].layer][0].outputs[0].name  # after every kernel: the model's layers are in sequence
    current = {"k_cache": "k_cache", "v_cache": "v_cache", "pos": pos, "score": score}
    # the v writes wait for the last layer's attention output: v may be read in place by standard ops
    # (decode_kernels_as_matmuls), whose product with the probabilities is not an ancestor of the ArgMin
    evicted = compressed_function._evict_into_weakest(
        b, compression, heads, step, total, current, last_out, after_all=None if total is not None else last_out
    )
    # the k/v writes stay per layer (each layer's buffer, in place), each a ScatterND of the token's row: take the
    # slot each KV head's row goes to ([B,n·Hkv,1,1], before the op's Expand over the channels) as row indices
    # [B,n·Hkv,1,3] (batch, head within its layer, slot) — ScatterElements' index per channel costs ~10x more in
    # ONNX Runtime for the same 3 rows of 64 values (4.6 against 0.4 µs a write, 120 writes a SmolLM2 step)
    kv_scatters = [node for node in b.nodes if node.output[0] in (evicted["k_cache_out"], evicted["v_cache_out"])]
    producer = {output: node for node in b.nodes for output in node.output}
    # ScatterElements' index: Expand(Unsqueeze(slots [B,n·Hkv,1], -1), [1,1,1,D])
    slots = {node.output[0]: producer[producer[node.input[1]].input[0]].input[0] for node in kv_scatters}
    b.nodes = [node for node in b.nodes if node not in kv_scatters]
    sizes = b.i64([layer.num_kv_heads for layer in layers])
    split_names = {}
    for name, key in (("k", evicted["k_cache_out"]), ("v", evicted["v_cache_out"])):
        rows = compressed_function._row_index(b, slots[key], heads_per_buffer=layers[0].num_kv_heads)
        split_names[name] = b.op("Split", rows, sizes, axis=1, outputs=len(layers))
    for name in ("pos", "score"):
        split_names[name] = b.op("Split", evicted[f"{name}_out"], sizes, axis=1, outputs=len(layers))
    # the Body's formal state names are the graph's batched values; nothing else in it is free
    free = {"score": score, "pos": pos}
    for node in b.nodes:
        node.input[:] = [free.get(name, name) for name in node.input]
    created = _add_proto_nodes(graph, b.nodes, values)
    for index, layer in enumerate(layers):
        _, producers = writes[layer.layer]
        for name in ("k", "v"):
            _scatter_rows_instead(graph, producers[name], created[split_names[name][index]])
        for name in ("pos", "score"):
            take_over(values[output_name(layer.layer, name)], created[split_names[name][index]])
    return len(layers)


def _scatter_rows_instead(graph: Any, scatter: Any, row_index: Any) -> None:
    """Replace ``scatter`` (a ScatterElements along the slot axis, one index per channel) by a ScatterND of the
    same rows at ``row_index`` ([B,Hkv,T,3]): the same values written, whole rows at a time."""
    import onnx_ir as ir

    from edgec.passes._graph import take_over

    data, _, updates = scatter.inputs
    rows = ir.node("ScatterND", [data, row_index, updates], name=f"{scatter.name}_rows")
    graph.insert_before(scatter, rows)
    take_over(scatter.outputs[0], rows.outputs[0])
    graph.remove(scatter, safe=True)


def _spare_row_index(tape: Any, seqlens: Any, kv_heads: int) -> Any:
    """ScatterND's indices [B,Hkv,1,3] (batch, head, slot C) of the spare row, C = ``seqlens`` [B] (int32) as
    GroupQueryAttention's static-cache mode writes it."""
    import onnx_ir as ir

    from edgec.passes.kv_attention_gqa import _i64

    spare = tape.op("Cast", [seqlens], attributes={"to": ir.DataType.INT64})
    batch_size = tape.op("Shape", [seqlens])
    grid = tape.op("Concat", [batch_size, _i64(tape, [kv_heads, 1, 1])], attributes={"axis": 0})
    batch = tape.op("Range", [_i64(tape, 0), tape.op("Squeeze", [batch_size]), _i64(tape, 1)])
    heads = _i64(tape, list(range(kv_heads)))
    parts = (
        tape.op("Reshape", [batch, _i64(tape, [-1, 1, 1, 1])]),
        tape.op("Reshape", [heads, _i64(tape, [1, -1, 1, 1])]),
        tape.op("Reshape", [spare, _i64(tape, [-1, 1, 1, 1])]),
    )
    return tape.op("Concat", [tape.op("Expand", [part, grid]) for part in parts], attributes={"axis": -1})


def decode_kernels_as_matmuls(model: Any, spec: CacheSpec) -> int:
    """In an inlined decode graph whose evictions are batched (``batch_decode_evictions``: every write of the
    slots waits for the last layer's attention output), replace each windowless compressed layer's
    GroupQueryAttention by the same attention in standard ops over the same buffers: the token's k and v
    scattered into the spare row (in place: they take over the kernel's presents, which the runtime binds to the
    state's buffers), then ``softmax(q·Kᵀ·scale + bias)·V`` with the query heads of each KV head as the rows of one
    product — the kernel runs one product per query head, re-reading each KV head's slots per query head (one
    layer over 1,025 fp32 rows, SmolLM2's heads: 0.69× the kernel's time at 1 thread, 0.81× at 2,
    ``benchmarks/decode_attention.py``). Where the kernel rotated q and k itself (``do_rotary``), two
    RotaryEmbeddings over the same tables do. A kernel with softcap, a local window or smooth softmax is kept.
    Returns how many kernels it replaced."""
    import numpy as np
    import onnx_ir as ir

    from edgec.kvcache.spec import StateTensor
    from edgec.passes._graph import take_over
    from edgec.passes.kv_attention_gqa import _i64

    graph = model.graph
    layers = {StateTensor(layer.layer, "k").input for layer in spec.layers if layer.compressed and not layer.window}
    replaced = 0
    for node in list(graph):
        if not _is_decode_kernel(node) or node.inputs[3] is None or node.inputs[3].name not in layers:
            continue
        attributes = node.attributes
        if attributes.get_float("softcap", 0.0) or any(
            attributes.get_int(name, default) != default
            for name, default in (("local_window_size", -1), ("smooth_softmax", 0), ("rotary_interleaved", 0))
        ):
            continue
        shape = node.inputs[3].shape
        dim = shape[3] if shape is not None else None
        if not isinstance(dim, int) or len(node.inputs) < 11:
            continue
        heads, kv_heads = attributes.get_int("num_heads"), attributes.get_int("kv_num_heads")
        group = heads // kv_heads
        scale = attributes.get_float("scale", 0.0) or 1.0 / float(np.sqrt(dim))
        tape = ir.tape.Tape(graph_like=graph)
        q, k, v = node.inputs[:3]
        if attributes.get_int("do_rotary", 0):  # q, k, v packed in input 0; rotate q and k as the kernel would
            widths = _i64(tape, [heads * dim, kv_heads * dim, kv_heads * dim])
            q, k, v = tape.op_multi_out("Split", [node.inputs[0], widths], attributes={"axis": -1}, num_outputs=3)
            cos, sin, position_ids = node.inputs[7], node.inputs[8], node.inputs[9]
            q = tape.op(
                "RotaryEmbedding", [q, position_ids, cos, sin], attributes={"num_heads": heads}, domain="com.microsoft"
            )
            k = tape.op(
                "RotaryEmbedding",
                [k, position_ids, cos, sin],
                attributes={"num_heads": kv_heads},
                domain="com.microsoft",
            )
        # one token: [B,1,N·D] is [B,Hkv,G,D] (q) and [B,Hkv,1,D] (k, v) in memory already
        queries = tape.op("Reshape", [q, _i64(tape, [0, kv_heads, group, dim])])
        key_row = tape.op("Reshape", [k, _i64(tape, [0, kv_heads, 1, dim])])
        value_row = tape.op("Reshape", [v, _i64(tape, [0, kv_heads, 1, dim])])
        # the token's rows into the spare row (seqlens_k: the slot count C), as the kernel's static-cache mode
        # writes them: one ScatterND row per KV head
        spare = _spare_row_index(tape, node.inputs[5], kv_heads)
        keys = tape.op("ScatterND", [node.inputs[3], spare, key_row])
        values = tape.op("ScatterND", [node.inputs[4], spare, value_row])
        keys_t = tape.op("Transpose", [keys], attributes={"perm": [0, 1, 3, 2]})
        scores = tape.op("MatMul", [queries, keys_t])  # [B,Hkv,G,C+1]
        scale_value = tape.op("Constant", [], attributes={"value": ir.tensor(np.float32(scale))})
        scores = tape.op("Mul", [scores, scale_value])
        # per query head, [B,H,1,C+1], as the kernel takes its bias ([B,1,1,C+1] shared or [B,H,1,C+1]) and
        # returns its probabilities
        scores = tape.op("Reshape", [scores, _i64(tape, [0, heads, 1, -1])])
        if node.inputs[10] is not None:
            scores = tape.op("Add", [scores, node.inputs[10]])
        probs = tape.op("Softmax", [scores], attributes={"axis": -1})
        # ·V one query head per product, [B,Hkv,G,1,C+1] · [B,Hkv,1,C+1,D]: ONNX Runtime's one-row product streams
        # V as it lies, where a G-row one first packs all of it (SmolLM2's step 0.975–0.989× at 2 threads, 0.994× at
        # 1; the sums in another order: logits within 5e-3)
        grouped = tape.op("Reshape", [probs, _i64(tape, [0, kv_heads, group, 1, -1])])
        value_rows = tape.op("Unsqueeze", [values, _i64(tape, [2])])
        context = tape.op("MatMul", [grouped, value_rows])  # [B,Hkv,G,1,D]
        out = tape.op("Reshape", [context, _i64(tape, [0, 1, heads * dim])])
        graph.insert_before(node, tape.nodes)
        for old, new in zip(node.outputs, (out, keys, values, probs), strict=True):
            take_over(old, new)
        graph.remove(node, safe=True)
        replaced += 1
    return replaced


def _through_identity(value: Any) -> Any:
    """The node computing ``value``, past any Identity (an inlined function's outputs), or None."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type == "Identity":
        node = node.inputs[0].producer()
    return node


def _add_proto_nodes(graph: Any, protos: list, values: dict[str, Any]) -> dict[str, Any]:
    """Append ``protos`` (onnx NodeProtos naming their inputs) to ``graph``, each input the graph's value of that
    name (``values``, updated with the new outputs; a name it lacks is a bug here, said as one); returns the new
    outputs by name. The caller sorts the graph afterwards. The nodes are built from their parts, not by
    ``ir.serde.deserialize_node``: a lone node's deserialization warns of every input it cannot find (177 lines in a
    SmolLM2 fp32-slot build), all of which are the graph's values."""
    import onnx_ir as ir

    created = {}
    for proto in protos:
        if missing := [name for name in proto.input if name and name not in values]:
            raise ValueError(f"{proto.op_type} reads {missing[0]!r}, which the graph lacks")
        node = ir.Node(
            proto.domain,
            proto.op_type,
            [values[name] if name else None for name in proto.input],
            [ir.serde.deserialize_attribute(attribute) for attribute in proto.attribute],
            num_outputs=len(proto.output),
            name=proto.name or None,
        )
        graph.append(node)
        for output, name in zip(node.outputs, proto.output, strict=True):
            output.name = name
            values[name] = output
            created[name] = output
    return created


def share_slot_count(model: Any) -> int:
    """In an inlined decode graph, read the slot count once per step: each compressed layer's one-token step
    takes it from its own ``pos`` input's shape (``Shape(cache.L.pos)[2]``, then its C + 1 rows and the kernel's
    int32 lengths: ~6 nodes per layer that ONNX Runtime runs every step, the dim being symbolic). Every compressed
    layer's slots are the one symbolic dim ``SLOT_DIM`` (the runtime gives them all one count, ``with_capacity``),
    so the first such Shape serves every layer, as the first Shape of any other input serves its repeats; the
    layers' chains, now the same nodes over the same values, are merged (``_merge_repeats``). Returns how many
    nodes it removed."""
    import onnx_ir as ir

    from edgec.kvcache.spec import SLOT_DIM

    graph = model.graph
    kept: dict[tuple, Any] = {}
    removed = 0
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Shape" and node.domain == "" and node.inputs else None
        if source is None or not source.is_graph_input():
            continue
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", None)
        dims = list(source.shape)[start:end] if source.shape is not None else []
        slots = bool(dims) and all(isinstance(dim, ir.SymbolicDim) and dim.value == SLOT_DIM for dim in dims)
        # a shape never changes during a run, so reading it earlier is safe even for a state written in place
        key = ("slots", len(dims)) if slots else ("input", source.name, start, end)
        if key not in kept:
            kept[key] = node
            continue
        ir.convenience.replace_all_uses_with(node.outputs[0], kept[key].outputs[0])
        graph.remove(node, safe=True)
        removed += 1
    if removed:
        removed += _merge_repeats(graph, [node.outputs[0] for node in kept.values()])
    return removed


def _merge_repeats(graph: Any, roots: list[Any]) -> int:
    """Merge the nodes computed from ``roots`` and small constants alone that repeat one another (the same op,
    attributes and inputs), keeping the first, then their results' repeats, and so on. Such nodes read no state
    buffer, so moving a read earlier cannot cross an in-place write; nodes with subgraphs or outside the standard
    domain are left alone. Returns how many it removed."""
    import numpy as np
    import onnx_ir as ir

    derived = set(roots)  # the values (by identity), not their ids, which a value made later could reuse

    def small_constant(value: Any) -> tuple | None:
        producer = value.producer()
        array = value.const_value.numpy() if value.const_value is not None else None
        if producer is not None and producer.op_type == "Constant" and producer.domain == "":
            if len(producer.attributes) != 1:
                return None
            ((kind, attribute),) = producer.attributes.items()
            numbers = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32}
            numbers["value_floats"] = np.float32
            if kind == "value":
                array = attribute.value.numpy()
            elif kind in numbers:
                array = np.asarray(attribute.value, numbers[kind])
        if array is None or array.size > 16:
            return None
        return (array.dtype.str, array.shape, array.tobytes())

    def key(node: Any) -> tuple | None:
        if node.domain != "" or any(
            attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()
        ):
            return None
        inputs: list = []
        for value in node.inputs:
            if value is None or value in derived:
                inputs.append(value)
                continue
            constant = small_constant(value)
            if constant is None:
                return None
            inputs.append(constant)
        attributes = tuple(sorted((name, repr(attr.value)) for name, attr in node.attributes.items()))
        return (node.op_type, len(node.outputs), tuple(inputs), attributes)

    seen: dict[tuple, Any] = {}
    removed = 0
    for node in list(graph):
        if not any(value is not None and value in derived for value in node.inputs):
            continue
        node_key = key(node)
        if node_key is None:
            continue
        first = seen.setdefault(node_key, node)
        if first is node or any(output.is_graph_output() for output in node.outputs):
            derived.update(node.outputs)
            continue
        for old, new in zip(node.outputs, first.outputs, strict=True):
            ir.convenience.replace_all_uses_with(old, new)
        graph.remove(node, safe=True)
        removed += 1
    return removed


def _is_decode_kernel(node: Any) -> bool:
    """A compressed layer's one-token kernel (``_decode_gqa``): GroupQueryAttention returning its probabilities,
    which the plain layers' kernels (``passes/kv_attention_gqa``) never do."""
    return node.op_type == "GroupQueryAttention" and "qk_output" in node.attributes


def _is_chunk_kernel(node: Any) -> bool:
    """A compressed layer's prompt-chunk kernel over the state (``compressed_function._state_kernel``), by name."""
    from edgec.kvcache.compressed_function import STATE_KERNEL

    return node.op_type == "GroupQueryAttention" and STATE_KERNEL in (node.name or "")


def _reshaped_from(value: Any) -> Any:
    """x when ``value`` is Reshape(x, shape), else None."""
    producer = value.producer() if value is not None else None
    return producer.inputs[0] if producer is not None and producer.op_type == "Reshape" else None


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
    summed by ReduceSum over axis 0 — the halves stacked as the batch — or, for a batch other than one, by Reshape
    [0, 2, -1, N] and ReduceSum over axis 1). 8-bit codes without zero points become their nibble
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
    after = uses[0].node if len(uses) == 1 else None
    if after is not None and after.op_type == "Reshape":  # rows [B, 2T, N] → [B, 2, T, N], summed
        pair_uses = list(after.outputs[0].uses())
        after = pair_uses[0].node if len(pair_uses) == 1 else None
    total = after if after is not None and after.op_type == "ReduceSum" else None
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
