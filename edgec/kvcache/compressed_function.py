"""``ai.edgec::CompressedKVAttention``: KVAttention over a pruned, quantized slot cache, as a function of
standard ONNX ops. Its meaning is ``reference.compressed_kv_attention``; read that first.

One function per build: the compression settings (policy, storage dtype, group, sink, window) are baked
into the body; ``scale`` and ``window`` (sliding attention) stay node attributes, as in KVAttention.

Running the state in place (one buffer bound as input and output, ORT IO binding) is correct because every
node that reads a state input is an ancestor of the single ScatterElements that writes its output: the old
values are read (attention, gathers of the slots written back) before the scatter overwrites them, and the
scatter writes distinct slots. tests/kvcache/test_compressed.py runs every dtype and policy both ways. (fp32
slots on the fused path: k/v are written by a ScatterND after the branches, and the prompt-chunk kernel over the
state may itself write the chunk's rows into empty slots first — ``_state_kernel``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import onnx
from onnx import AttributeProto, TensorProto, helper

from edgec.kvcache import policies
from edgec.kvcache.compression import Compression
from edgec.kvcache.onnx_body import Body
from edgec.kvcache.policies.base import prompt_needs
from edgec.kvcache.quantize import QMAX
from edgec.kvcache.spec import compressed_state

DOMAIN = "ai.edgec"
OP_TYPE = "CompressedKVAttention"
OPSET_VERSION = 1
STORAGE_TYPES = {  # storage dtype → ONNX element type of the k/v state
    "fp32": TensorProto.FLOAT,
    "fp16": TensorProto.FLOAT16,
    "int8": TensorProto.INT8,
    "fp8": TensorProto.UINT8,  # e4m3fn bit patterns
    "int4": TensorProto.UINT8,  # two offset-binary nibbles per byte
}
HUGE = 1 << 40


@dataclass(frozen=True)
class Heads:
    """The attention's head layout, the same for every compressed layer of a model: the decode branch bakes it
    in so that it runs no shape arithmetic."""

    query: int
    kv: int
    dim: int


RECALL_QUERY = "query"  # the output recall adds

# the function's formal names of the state tensors (spec.py's vocabulary; k and v are the new tokens' keys/values)
FORMAL = {"k": "k_cache", "v": "v_cache"}


def state_names(compression: Compression) -> tuple[str, ...]:
    """The state tensors of one layer, in input order, by their names in the function."""
    return tuple(FORMAL.get(name, name) for name in compressed_state(compression))


def inputs(compression: Compression, with_observe: bool = True) -> tuple[str, ...]:
    """The op's inputs. ``observe`` [1] bool comes last: False for a prompt chunk whose scores the next chunk
    replaces (the policy's update is skipped: ``reference.compressed_kv_attention``); one-token calls ignore it.
    ``with_observe=False``: without it (the one-token plugin's own node)."""
    observe = ("observe",) if with_observe else ()
    return ("q", "k", "v", "position_ids", "protect", *state_names(compression), *observe)


def outputs(compression: Compression) -> tuple[str, ...]:
    """The outputs: the attention, the updated state, and with recall (recall.py) the query of the call's last
    token, [B,H,D] after RoPE and the rotation — what the runtime scores its host tier's key summaries with."""
    recall = (RECALL_QUERY,) if compression.recall else ()
    return ("out", *(f"{name}_out" for name in state_names(compression)), *recall)


# --- storage -------------------------------------------------------------------------------------------------
def _fp8_table() -> onnx.TensorProto:
    import ml_dtypes
    import numpy as np

    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = np.where(np.isfinite(values), values, 0).astype(np.float32)  # NaN codes are never written
    return onnx.numpy_helper.from_array(values, "fp8_table")


def _dequantize(b: Body, stored: str, scale: str | None, compression: Compression) -> str:
    """Stored k or v [B,Hkv,C,Ds] → float32 [B,Hkv,C,D]."""
    values = _raw_values(b, stored, compression)
    if not compression.quantized:
        return values
    # int8: Cast + Mul — ONNX Runtime's blocked DequantizeLinear is slower on CPU (measured)
    return _scale_groups(b, values, scale, compression.group)


def _raw_values(b: Body, stored: str, compression: Compression, head_dim: int | None = None) -> str:
    """Stored k or v [B,Hkv,C,Ds] → float32 [B,Hkv,C,D] before the group scales (the values themselves for
    float storage). ``head_dim`` known lets int4 unpack without shape arithmetic."""
    dtype = compression.dtype
    if dtype == "fp32":
        return stored
    if dtype in ("fp16", "int8"):
        return b.op("Cast", stored, to=TensorProto.FLOAT)
    if dtype == "fp8":
        table = b.op("Constant", value=_fp8_table(), name="fp8_table")
        return b.op("Gather", table, b.op("Cast", stored, to=TensorProto.INT32))
    # int4: unpack the nibbles (low = even channel), offset-binary around 8
    low = b.op("BitwiseAnd", stored, b.u8(15))
    high = b.op("BitShift", stored, b.u8(4), direction="RIGHT")
    axis = b.i64([-1])
    pairs = b.op("Concat", b.op("Unsqueeze", low, axis), b.op("Unsqueeze", high, axis), axis=-1)
    if head_dim is not None:
        shape = b.i64([0, 0, -1, head_dim])
    else:  # explicit sizes, not -1: an empty slice (no filled slot yet) makes -1 ambiguous
        shape = b.op(
            "Concat", b.op("Shape", stored, end=3), b.op("Mul", b.op("Shape", stored, start=3), b.i64(2)), axis=0
        )
    return b.op("Sub", b.op("Cast", b.op("Reshape", pairs, shape), to=TensorProto.FLOAT), b.f32(8.0))


def _scale_groups(b: Body, values: str, scale: str, group: int) -> str:
    """values [B,Hkv,N,D] × scale [B,Hkv,N,D/G] per group of G channels."""
    groups = b.op("Div", b.op("Shape", values, start=3), b.i64(group))
    grouped_shape = b.op("Concat", b.op("Shape", values, end=3), groups, b.i64([group]), axis=0)
    grouped = b.op("Reshape", values, grouped_shape)
    scaled = b.op("Mul", grouped, b.op("Unsqueeze", scale, b.i64([-1])))
    return b.op("Reshape", scaled, b.op("Shape", values))


def _quantize(b: Body, x: str, compression: Compression) -> tuple[str, str | None]:
    """New k or v [B,Hkv,T,D] float32 → (stored, scale [B,Hkv,T,D/G] or None)."""
    dtype, group = compression.dtype, compression.group
    if dtype == "fp32":
        return x, None
    if dtype == "fp16":
        return b.op("Cast", x, to=TensorProto.FLOAT16), None
    # Reshape's 0 copies an axis: no shape arithmetic (a call always brings at least one token)
    grouped = b.op("Reshape", x, b.i64([0, 0, 0, -1, group]))
    absmax = b.op("ReduceMax", b.op("Abs", grouped), b.i64([-1]), keepdims=0)
    scale = b.op("Div", absmax, b.f32(QMAX[dtype]))
    safe = b.op("Where", b.op("Equal", scale, b.f32(0.0)), b.f32(1.0), scale)
    if dtype == "int8":
        stored = b.op("QuantizeLinear", x, safe, axis=3, block_size=group, output_dtype=TensorProto.INT8)
        return stored, scale
    if dtype == "fp8":
        return _encode_e4m3(
            b, b.op("Reshape", b.op("Div", grouped, b.op("Unsqueeze", safe, b.i64([-1]))), b.i64([0, 0, 0, -1]))
        ), scale
    zero_point = b.op("Expand", b.u8(8), b.op("Shape", safe))
    nibbles = b.op("QuantizeLinear", x, safe, zero_point, axis=3, block_size=group)  # uint8 in [1, 15]
    pairs = b.op("Reshape", nibbles, b.i64([0, 0, 0, -1, 2]))
    low, high = b.op("Split", pairs, axis=-1, num_outputs=2, outputs=2)
    four = b.u8(4)
    packed = b.op("BitwiseOr", low, b.op("BitShift", high, four, direction="LEFT"))
    return b.op("Squeeze", packed, b.i64([-1])), scale


def _encode_e4m3(b: Body, y: str) -> str:
    """float32 values within ±448 → e4m3fn codes (uint8), rounding to nearest even like a float8 cast."""
    magnitude = b.op("Abs", y)
    # exponent of the value, clamped to the subnormal range; log2 of an exact power of two may land a hair low
    log2 = b.op("Div", b.op("Log", magnitude), b.f32(0.6931471805599453))
    exponent = b.op("Max", b.op("Floor", b.op("Add", log2, b.f32(1e-6))), b.f32(-6.0))
    step = b.op("Pow", b.f32(2.0), b.op("Sub", exponent, b.f32(3.0)))
    rounded = b.op("Min", b.op("Mul", b.op("Round", b.op("Div", magnitude, step)), step), b.f32(448.0))
    # re-derive the exponent: rounding may carry into the next binade
    log2r = b.op("Div", b.op("Log", rounded), b.f32(0.6931471805599453))
    exponent_r = b.op("Max", b.op("Floor", b.op("Add", log2r, b.f32(1e-6))), b.f32(-6.0))
    normal = b.op("GreaterOrEqual", rounded, b.f32(2.0**-6))
    mantissa_normal = b.op("Sub", b.op("Div", rounded, b.op("Pow", b.f32(2.0), exponent_r)), b.f32(1.0))
    code_normal = b.op(
        "Add", b.op("Mul", b.op("Add", exponent_r, b.f32(7.0)), b.f32(8.0)), b.op("Mul", mantissa_normal, b.f32(8.0))
    )
    code_subnormal = b.op("Mul", rounded, b.f32(512.0))  # mantissa / 8 × 2^-6
    code = b.op("Where", normal, code_normal, code_subnormal)
    sign = b.op("Where", b.op("Less", y, b.f32(0.0)), b.f32(128.0), b.f32(0.0))
    return b.op("Cast", b.op("Round", b.op("Add", code, sign)), to=TensorProto.UINT8)


# --- the body ------------------------------------------------------------------------------------------------
def make_function(
    compression: Compression,
    default_opset: int,
    heads: Heads,
    data_dependent_shapes: bool = True,
    fused_attention: bool = False,
) -> onnx.FunctionProto:
    """The function body for one compression setting and head layout; ``default_opset`` must equal the model's.

    Two branches of one ``If``: the general call (any T) and a one-token decode step, which is the same
    meaning with less work — one query needs no causal mask, and its token, always in the recent window, is
    always kept, so it simply takes the weakest slot (ArgMin; the same tie rule as TopK). Decode is the hot
    path: the general branch runs ~220 nodes per layer, the decode branch about half.

    ``data_dependent_shapes=False`` (compilers that must know every shape from input shapes alone: TensorRT-RTX)
    gives the general branch alone, attending over every slot (empty ones masked) instead of the filled prefix:
    no ``If`` and no tensor whose shape depends on the cache's contents. The same meaning, more work per step.

    ``fused_attention`` (ONNX Runtime: ``com.microsoft`` ops): prompt chunks attend with GroupQueryAttention and
    are scored from their last queries where the policy allows (``_general``): a chunk costs what a plain
    cache's does, and its score matrix is never materialized.
    """
    if compression.decode_kernel == "gqa" and not compression.native_decode_fits():
        raise ValueError("GroupQueryAttention reads unrotated fp32 slots of one pool only (native_decode_fits)")
    b = Body()
    formal = list(inputs(compression))
    # with a rotation, the body below runs on rotated q, k, v (named as the inputs were) and its output is
    # rotated back at the end (rotation.py)
    body_out = {name: name for name in outputs(compression)}
    rotation = None
    if compression.rotation != "none":
        formal = [f"{name}_unrotated" if name in ("q", "k", "v") else name for name in formal]
        body_out["out"] = "out_rotated"
        rotation = matrix, query_signs, kv_signs, out_signs = _rotation_constants(b, compression, heads)
        for name, signs in (("q", query_signs), ("k", kv_signs), ("v", kv_signs)):
            b.named("MatMul", [b.op("Mul", f"{name}_unrotated", signs), matrix], name)
    if compression.recall:  # the last token's query, as the slots' keys see it (rotated where they are)
        b.named("Gather", ["q", b.i64(-1)], RECALL_QUERY, axis=2)
    state_outputs = [name for name in outputs(compression) if name != RECALL_QUERY]
    scale_attr = b.attribute_ref("value_float", "scale", AttributeProto.FLOAT)
    window_attr = b.attribute_ref("value_int", "window", AttributeProto.INT)
    if compression.mixed != "none":  # two slot pools (mixed_function.py): the same If, its own branches
        if not data_dependent_shapes:
            raise ValueError("a mixed-precision cache needs data-dependent shapes (ONNX Runtime targets)")
        from edgec.kvcache import mixed_function

        branches = {
            "decode": lambda body: mixed_function.decode(body, compression, scale_attr, window_attr, heads),
            "general": lambda body: mixed_function.body(body, compression, scale_attr, window_attr),
        }
        b.nodes.append(_if_decode(b, compression, branches, body_out, mixed_function.output_type))
        return _function(b, compression, default_opset, formal, rotation)
    if not data_dependent_shapes:
        results = _general(b, compression, scale_attr, window_attr, every_slot=True)
        for name in state_outputs:
            b.nodes.append(helper.make_node("Identity", [results[name]], [body_out[name]]))
        return _function(b, compression, default_opset, formal, rotation)
    is_decode = b.op("Equal", b.op("Squeeze", b.shape("k", 2)), b.i64(1))
    branches = {}
    for kind in ("decode", "general"):
        branch = Body(prefix=f"{kind[0]}_")
        if kind == "decode":
            decode = _decode_gqa if compression.decode_kernel == "gqa" else _decode
            results = decode(branch, compression, scale_attr, window_attr, heads)
        else:
            fused = heads if fused_attention else None
            results = _general(branch, compression, scale_attr, window_attr, fused=fused)
        output_type = partial(_output_type, compression)
        branches[kind] = _branch(branch, results, state_outputs, f"{kind}_step", "_result", output_type)
    b.nodes.append(
        helper.make_node(
            "If",
            [is_decode],
            [body_out[name] for name in state_outputs],
            then_branch=branches["decode"],
            else_branch=branches["general"],
        )
    )
    fused = fused_attention or compression.decode_kernel == "gqa"
    return _function(b, compression, default_opset, formal, rotation, fused)


def _if_decode(b: Body, compression: Compression, branches: dict, body_out: dict, output_type) -> onnx.NodeProto:
    """``If`` T = 1 then ``branches["decode"]`` else ``branches["general"]`` (each: Body → outputs by name)."""
    is_decode = b.op("Equal", b.op("Squeeze", b.shape("k", 2)), b.i64(1))
    graphs = {}
    for kind, write in branches.items():
        branch = Body(prefix=f"{kind[0]}_")
        results = write(branch)
        typed = partial(output_type, compression)
        graphs[kind] = _branch(branch, results, outputs(compression), f"{kind}_step", "_result", typed)
    return helper.make_node(
        "If",
        [is_decode],
        [body_out[name] for name in outputs(compression)],
        then_branch=graphs["decode"],
        else_branch=graphs["general"],
    )


def _branch(body: Body, results: dict[str, str], names, graph_name: str, suffix: str, output_type) -> onnx.GraphProto:
    """``body`` as an If branch whose outputs are ``results[name]`` for ``names``, in order, each through an
    Identity named ``{name}{suffix}`` and typed ``output_type(name)``."""
    graph_outputs = []
    for name in names:
        value = body.op("Identity", results[name], name=f"{name}{suffix}")
        graph_outputs.append(helper.make_tensor_value_info(value, output_type(name), None))
    return helper.make_graph(body.nodes, graph_name, [], graph_outputs)


BRANCHES = {"decode": ("then_branch", "decode_step"), "general": ("else_branch", "general_step")}


def single_branch(function: onnx.FunctionProto, kind: str) -> onnx.FunctionProto:
    """The op's body with its ``If`` replaced by one branch: ``general`` (any call: the same meaning) or
    ``decode`` (the one-token branch: calls of one token only; a call of more fails, its Reshape of q into
    [B,Hkv,G,D] cannot take them). A bundle whose prompt chunks run on a graph of their own
    (``prefill.onnx``) decodes on a graph holding only the decode branch: no ``If`` to run per layer and step.
    A body without the ``If``: a copy, as it is."""
    attribute, graph_name = BRANCHES[kind]
    body = onnx.FunctionProto()
    body.CopyFrom(function)
    switch = [node for node in body.node if node.op_type == "If"]
    if not switch:
        return body
    (node,) = switch
    branch = next(a.g for a in node.attribute if a.name == attribute)
    if branch.name != graph_name:
        raise ValueError(f"{function.name}: the If's {attribute} is {branch.name!r}, not {graph_name!r}")
    taken = list(branch.node)
    # the branch's results carry the If's output names (each branch ends in an Identity per output)
    renamed = {result.name: output for result, output in zip(branch.output, node.output, strict=True)}
    for inner in taken:
        inner.output[:] = [renamed.get(name, name) for name in inner.output]
    index = list(body.node).index(node)
    nodes = [*body.node[:index], *taken, *body.node[index + 1 :]]
    needed = set(body.output)
    kept = []
    for inner in reversed(nodes):  # drop what only the If's condition read (the Shape/Squeeze/Equal of T)
        if any(name in needed for name in inner.output):
            kept.append(inner)
            needed |= set(inner.input) | _subgraph_inputs(inner)
    del body.node[:]
    body.node.extend(reversed(kept))
    return body


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Every name a node's subgraphs (If branches) read, outer-scope names among them."""
    names: set[str] = set()
    for attribute in node.attribute:
        if attribute.type == AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= set(inner.input) | _subgraph_inputs(inner)
    return names


def _rotation_constants(b: Body, compression: Compression, heads: Heads) -> tuple[str, str, str, str]:
    """H/√D [D,D] and the signs shaped for q [B,H,T,D] ([H,1,D]), k/v [B,Hkv,T,D] ([Hkv,1,D]) and the output
    [B,T,H,D] ([H,D]); each query head takes its KV head's signs."""
    import numpy as np

    from edgec.kvcache import rotation

    kv_signs = rotation.signs(compression.rotation_seed, heads.kv, heads.dim)
    query_signs = np.repeat(kv_signs, heads.query // heads.kv, axis=0)

    def constant(name: str, value) -> str:
        return b.op("Constant", value=onnx.numpy_helper.from_array(np.ascontiguousarray(value), name), name=name)

    return (
        constant("rotation", rotation.hadamard(heads.dim)),
        constant("query_signs", query_signs[:, None, :]),
        constant("kv_signs", kv_signs[:, None, :]),
        constant("out_signs", query_signs),
    )


def _function(
    b: Body,
    compression: Compression,
    default_opset: int,
    formal: list[str],
    rotation: tuple[str, ...] | None,
    fused: bool = False,
) -> onnx.FunctionProto:
    opsets = [helper.make_opsetid("", default_opset)] + ([helper.make_opsetid("com.microsoft", 1)] if fused else [])
    if rotation is not None:  # the output back from the rotated space (H/√D is its own transpose and inverse)
        matrix, *_, out_signs = rotation
        b.named("Mul", [b.op("MatMul", "out_rotated", matrix), out_signs], "out")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        formal,
        list(outputs(compression)),
        b.nodes,
        opset_imports=opsets,
        attributes=["scale"],
        attribute_protos=[helper.make_attribute("window", 0)],
    )


def _output_type(compression: Compression, name: str) -> int:
    if name in ("k_cache_out", "v_cache_out", "k_cache_rows", "v_cache_rows"):
        return STORAGE_TYPES[compression.dtype]
    return TensorProto.INT64 if name in ("pos_out", WRITTEN_INDEX) else TensorProto.FLOAT


def _filled_slots(
    b: Body, filled: str, capacity: str, compression: Compression, every_slot: bool = False, sliced: bool = True
):
    """Attention reads slots [0, active) only, active = the last filled slot + 1: empty slots fill lowest first,
    so while a cache (or the large temporary one of an `end` prompt) fills up, its empty tail costs nothing.
    ``every_slot``: active = the capacity, a number the shapes give (empty slots are masked all the same).
    Returns active ([1]), a slicer for state tensors, and the dequantized old k and v of those slots (None with
    ``sliced`` False: every reader slices them in its own If branch, and a slice here would copy the slots)."""
    if every_slot:
        active = capacity

        def active_slots(name: str | None) -> str | None:
            return name

    else:
        active = _active(b, filled, capacity)

        def active_slots(name: str | None) -> str | None:
            return None if name is None else b.op("Slice", name, b.i64([0]), active, b.i64([2]))

    if not sliced:
        return active, active_slots, None, None
    scales = ("k_scale", "v_scale") if compression.quantized else (None, None)
    old_k = _dequantize(b, active_slots("k_cache"), active_slots(scales[0]), compression)
    old_v = _dequantize(b, active_slots("v_cache"), active_slots(scales[1]), compression)
    return active, active_slots, old_k, old_v


def _active(b: Body, filled: str, capacity: str) -> str:
    """[1]: the last filled slot + 1 over every head (0 when all are empty)."""
    slot_index = b.op("Range", b.i64(0), b.op("Squeeze", capacity), b.i64(1))
    filled_at = b.op("Where", filled, slot_index, b.i64(-1))
    return b.op("Reshape", b.op("Add", b.op("ReduceMax", filled_at, keepdims=0), b.i64(1)), b.i64([1]))


def _general(
    b: Body,
    compression: Compression,
    scale_attr: str,
    window_attr: str,
    every_slot: bool = False,
    fused: Heads | None = None,
) -> dict[str, str]:
    """Any number of new tokens: attention with causal masks, pairing, index-ordered writes.

    ``fused`` (the head layout; ONNX Runtime targets): where the policy judges a chunk by its last queries only
    (``prompt_needs`` without ``total``), the output comes from ``com.microsoft::GroupQueryAttention`` whenever
    the call simply extends the slots (``_extends``), and the scores from the last ``observe`` query rows: the
    call's full score matrix [G·T, slots + T] is never built. Otherwise every query's probabilities are.

    The ``observe`` input False (a prompt chunk whose scores the next chunk replaces): the policy's update is
    skipped — on the fused path the last rows' attention is not computed at all (an ``If``), on the other a
    ``Where`` picks the same result (the probabilities are there for the output anyway)."""
    policy = policies.get(compression.policy)
    capacity = b.shape("pos", 2)
    new = b.shape("k", 2)  # T
    kv_heads = b.shape("k", 1)
    heads = b.shape("q", 1)
    head_dim = b.shape("q", 3)

    filled = b.op("GreaterOrEqual", "pos", b.i64(0))
    # an unobserved chunk that only appends to the slots (every chunk of an `end` prompt but the last) needs none
    # of the judging below: an If gives it GroupQueryAttention and the direct write alone (_appending); what only
    # the judging reads is computed in its branch (j), so an appending chunk does not run it
    lean = fused is not None and not every_slot
    # fp32 slots there: the kernel reads the k/v state where it lies (_state_kernel) and k/v are written by one
    # ScatterND each outside every If (_scatter_rows) — no copy of the slots per call
    in_place = lean and compression.dtype == "fp32"
    active, active_slots, old_k, old_v = _filled_slots(b, filled, capacity, compression, every_slot, not in_place)

    observing = _observing(b, new)
    j = Body(prefix=f"{b.prefix}judged_") if lean else b

    # 1. attention over the slots and the new tokens; queries grouped per KV head: [B,Hkv,G·T,D]
    rows_shape = j.op("Concat", j.i64([0]), kv_heads, j.i64([-1]), head_dim, axis=0)
    bht = b.op("Concat", b.op("Shape", "k", end=2), new, axis=0)
    new_pos = b.op("Expand", b.op("Unsqueeze", "position_ids", b.i64([1])), bht)  # [B,Hkv,T]
    key_pos = j.op("Concat", "pos", new_pos, axis=2)  # [B,Hkv,C+T]: every candidate
    active_pos = j.op("Slice", "pos", j.i64([0]), active, j.i64([2])) if lean else active_slots("pos")
    attended_pos = j.op("Concat", active_pos, new_pos, axis=2)  # [B,Hkv,active+T]
    group_size = j.op("Div", heads, kv_heads)
    # fp32 slots are plain slices of the state: a branch re-slices them (_Attend.in_branch)
    sliced = active if compression.dtype == "fp32" and not every_slot else None
    attend = _Attend(old_k, old_v, attended_pos, rows_shape, group_size, scale_attr, window_attr, sliced)
    attend_j = attend.in_branch(j) if lean else attend
    needs = prompt_needs(policy) if fused is not None and not every_slot else policy.needs
    kernel = None
    if in_place:  # where its output is taken: the call extends the slots and fits after them
        uses = b.op("And", _extends(b, filled, active, window_attr), _room(b, active, new, capacity))
        b.nodes[-1].name = b.fresh(EXTENDS_AND_FITS)  # the extend graph replaces it by the runtime's proof
        if "total" in needs:  # an observed call computes every query's probabilities, and its output from them
            uses = b.op("And", uses, b.op("Not", observing))
        kernel = _Kernel(uses, _state_kernel(b, active, new, uses, fused))

    def statistics(
        body: Body, judged: str, judged_rows: str, heads_in: str, window_only: bool, group: str | None = None
    ) -> dict[str, str]:
        """2. what this call's attention says about each candidate: ``judged`` [B,h,G·n,K] over ``heads_in`` [1]
        KV heads (``group``: G where not every query head of a KV head's group is there); ``window_only``: its n
        rows are the observation window already (no Slice copying them)."""
        stats = {}
        shape = body.op("Concat", body.i64([0]), heads_in, group or group_size, judged_rows, body.i64([-1]), axis=0)
        per_query = body.op("Reshape", judged, shape)
        if "total" in needs:
            stats["total"] = body.op("ReduceSum", per_query, body.i64([2, 3]), keepdims=0)
        if "observed" in needs:
            observed = per_query
            if not window_only:
                window = body.i64([-compression.observe]), body.i64([HUGE]), body.i64([3])
                observed = body.op("Slice", per_query, *window)
            stats["observed"] = body.op("ReduceSum", observed, body.i64([2, 3]), keepdims=0)
        if "last" in needs:
            last = body.op("Slice", per_query, body.i64([-1]), body.i64([HUGE]), body.i64([3]))
            stats["last"] = body.op("ReduceMean", last, body.i64([2, 3]), keepdims=0)
        return stats

    def updated_in(body: Body, stats: dict[str, str]) -> str:
        """3. the policy's scores from the statistics [B,Hkv,K]."""
        stats = dict(stats)
        # back to one entry per candidate: the slots past `active` received nothing
        gap = body.op("Concat", body.i64([0, 0, 0, 0, 0]), body.op("Sub", capacity, active), axis=0)
        for name, stat in stats.items():
            old_part = body.op("Pad", body.op("Slice", stat, body.i64([0]), active, body.i64([-1])), gap, body.f32(0.0))
            tail = body.op("Slice", stat, active, body.i64([HUGE]), body.i64([-1]))
            stats[name] = body.op("Concat", old_part, tail, axis=-1)
        return policy.update_onnx(body, "score", stats, key_pos, new)

    if fused is None or every_slot or "total" in needs:  # every query's probabilities: the output comes with them
        probs = attend_j.probs(j, "q", "position_ids", new)
        out = attend_j.output(j, probs, active)
        # the probabilities are computed for the output anyway: the unobserved case is a choice, not a saving
        stats = statistics(j, probs, new, kv_heads, window_only=False) if needs else {}
        updated = j.op("Where", observing, updated_in(j, stats), _unobserved(j, "score", new))
    else:
        out = _fused_output(j, attend_j, filled, active, new, window_attr, fused, kernel)
        # the policy reads the last `observe` queries only: their rows alone, and only when the call observes
        branches = {}
        for kind in ("observed", "unobserved"):
            body = Body(prefix=f"{j.prefix}{kind}_")
            if kind == "observed":
                stats = {}
                if needs and fused.query == 1:
                    judged_q, judged_pos, judged_rows = _observation_window(body, compression)
                    judged = attend_j.in_branch(body).probs(body, judged_q, judged_pos, judged_rows)
                    stats = statistics(body, judged, judged_rows, kv_heads, window_only=True)
                elif needs:  # a query head at a time: each tensor over the prompt's keys a ninth as large (SmolLM2)
                    stats = _per_query_head(body, compression, attend_j, statistics, needs, fused)
                result = updated_in(body, stats)
            else:
                result = _unobserved(body, "score", new)
            value = body.op("Identity", result, name=f"{kind}_score")
            output = helper.make_tensor_value_info(value, TensorProto.FLOAT, None)
            branches[kind] = helper.make_graph(body.nodes, f"{kind}_scores", [], [output])
        updated = j.fresh("updated_score")
        j.nodes.append(
            helper.make_node(
                "If", [observing], [updated], then_branch=branches["observed"], else_branch=branches["unobserved"]
            )
        )
    inf = j.f32(float("inf"))
    old_protected = j.op("And", j.op("IsInf", "score", detect_negative=0), filled)
    protected = j.op("Concat", old_protected, j.op("Expand", j.op("Unsqueeze", "protect", j.i64([1])), bht), axis=2)
    score_all = j.op("Where", protected, inf, updated)

    # 3. keep-scores: forced candidates +inf, empty slots -inf
    newest = j.op("Unsqueeze", j.op("ReduceMax", "position_ids", j.i64([1]), keepdims=1), j.i64([2]))  # [B,1,1]
    forced = _forced(j, key_pos, newest, protected, compression)
    keep = j.op("Where", j.op("Less", key_pos, j.i64(0)), j.f32(float("-inf")), j.op("Where", forced, inf, score_all))

    # 4. write the new tokens: straight into the empty slots after the filled ones where they fit (every chunk of
    # an `end` prompt), else by pairing the weakest slots with the strongest new tokens — the same result there
    k_stored, k_scale = _quantize(j, "k", compression)
    v_stored, v_scale = _quantize(j, "v", compression)
    arriving = {"k_cache": k_stored, "v_cache": v_stored, "k_scale": k_scale, "v_scale": v_scale, "pos": new_pos}
    if every_slot:  # no If (compilers that must know every shape): the pairing always
        written = _paired_writes(j, compression, policy, keep, score_all, arriving, capacity, new, newest, out)
    else:
        written = _writes(
            j, compression, policy, keep, score_all, arriving, filled, active, capacity, new, newest, out, in_place
        )
    results = {"out": out} | {_written_output(compression, key): value for key, value in written.items()}
    if not lean:
        return results
    results = _appending(
        b, j, results, compression, attend, filled, active, new, new_pos, observing, window_attr, fused, kernel
    )
    return _scatter_rows(b, results) if in_place else results


def _observation_window(b: Body, compression: Compression) -> tuple[str, str, str]:
    """The call's last ``observe`` queries: their q rows [B,H,n,D], positions [B,n] and n ([1])."""
    window = b.i64([-compression.observe]), b.i64([HUGE])
    queries = b.op("Slice", "q", *window, b.i64([2]))
    positions = b.op("Slice", "position_ids", *window, b.i64([1]))
    return queries, positions, b.shape(positions, 1)


# how a statistic over a KV head's group of query heads combines theirs (policies/base.py: what each one is)
_OVER_THE_GROUP = {"total": "ReduceSum", "observed": "ReduceSum", "last": "ReduceMean"}


def _per_query_head(
    b: Body, compression: Compression, attend: _Attend, statistics: Callable, needs: tuple[str, ...], heads: Heads
) -> dict[str, str]:
    """The statistics ``needs`` names, [B,Hkv,K], over the observation window, computed a query head at a time in
    a ``Loop`` over the query heads (``statistics``: ``_general``'s, one query head's [B,1,K] each), then combined
    over each KV head's group: every tensor over the prompt's keys is then [B,1,n,K], a ``heads.query``-th of the whole
    window's (SmolLM2, 8K prompt: 1 MB instead of 9.2). One copy of the nodes, not one per head: ONNX Runtime
    keeps ~5 KiB of memory per node from the moment a session opens. The window and the keys are sliced inside
    the body (ONNX Runtime's optimizer warns when a subgraph reads an outer Slice's output)."""
    body = Body(prefix=f"{b.prefix}head_")
    iteration, carried = body.fresh("iteration"), body.fresh("condition")
    query = body.op("Unsqueeze", iteration, body.i64([0]))
    queries, positions, rows = _observation_window(body, compression)
    probs = attend.query_head_probs(body, query, heads, queries, positions, rows)
    stats = statistics(body, probs, rows, body.i64([1]), window_only=True, group=body.i64([1]))
    outputs = [body.op("Identity", carried, name="condition_out")]
    outputs += [body.op("Identity", stats[name], name=f"{name}_head") for name in needs]
    graph = helper.make_graph(
        body.nodes,
        "observation_per_head",
        [
            helper.make_tensor_value_info(iteration, TensorProto.INT64, []),
            helper.make_tensor_value_info(carried, TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(outputs[0], TensorProto.BOOL, [])]
        + [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs[1:]],
    )
    # a condition given (True), not left empty: onnx_ir drops a trailing empty input, and Loop requires two
    stacked = b.op("Loop", b.i64(heads.query), b.boolean(True), outputs=len(needs), name="per_head", body=graph)
    stacked = [stacked] if len(needs) == 1 else stacked
    combined = {}
    for name, per_query in zip(needs, stacked, strict=True):
        per_query = b.op("Squeeze", per_query, b.i64([2]))  # [H,B,K]
        grouped = b.op("Concat", b.i64([heads.kv, heads.query // heads.kv, -1]), b.shape(per_query, -1), axis=0)
        over_group = b.op(_OVER_THE_GROUP[name], b.op("Reshape", per_query, grouped), b.i64([1]), keepdims=0)
        combined[name] = b.op("Transpose", over_group, perm=[1, 0, 2])  # [Hkv,B,K] → [B,Hkv,K]
    return combined


@dataclass(frozen=True)
class _Kernel:
    """GroupQueryAttention over the k/v state itself (``_state_kernel``): its output, right where ``uses``."""

    uses: str  # [] bool
    out: str  # [B,T,H,D]


# what the branches of a call on fp32 slots give for k and v (the rows and where they go), scattered after them
DEFERRED = ("k_cache", "v_cache")
STATE_KERNEL = "state_kernel"  # the kernel's node name (prefill_graph finds it by it)
# the If branches of the two choices a call that only extends the slots makes one way, by their graphs' names:
# the kernel's output (not the fallback attention) and the direct write (not the pairing). The extend graph
# (edgec/extend_graph.py) keeps the first of each pair alone
EXTEND_CHOICES = {("kernel_attention", "fallback_attention"), ("direct_writes", "paired_writes")}
# the If (``_appending``) between an unobserved call that only appends and the whole call, by its branches' graphs'
# names: the extend graph keeps the second alone, which with the first two choices made gives the first's answer
APPEND_OR_JUDGE = ("append_chunk", "judged_chunk")
# the node testing, on fp32 slots, that a call extends the slots and fits after them (the kernel's ``uses``), by
# name: the runtime proves both before it runs a call on the extend graph, which holds a constant True there
EXTENDS_AND_FITS = "extends_and_fits"
WRITTEN_INDEX = "written_index"  # [B,Hkv,T,3] int64: where each new row lands (batch, head, slot), for ScatterND


def _written_keys(compression: Compression, deferred: bool) -> list[str]:
    """What a write step returns: the state tensors it writes whole; with ``deferred`` k and v as rows."""
    names = state_names(compression)
    if not deferred:
        return list(names)
    return [name for name in names if name not in DEFERRED] + [WRITTEN_INDEX, *(f"{name}_rows" for name in DEFERRED)]


def _written_output(compression: Compression, key: str) -> str:
    """The call's result name for a write step's key: ``{name}_out`` for a whole state tensor."""
    return f"{key}_out" if key in state_names(compression) else key


def _state_kernel(b: Body, active: str, new: str, uses: str, heads: Heads) -> str:
    """``com.microsoft::GroupQueryAttention`` with the k/v state as its past (static-cache mode: it reads slots
    [0, active) where they lie, and writes the new rows into slots [active, active + T) of its present). Nothing
    reads its present in the body; ``prefill_graph`` makes it a graph output, which the runtime binds to the
    state's own buffer where a call is known to append (``OrtCacheState``): then that write is the direct
    write's, in place, and no slot is copied. The output [B,T,H,D] is right where ``uses`` (the call extends the
    slots and fits after them); elsewhere the kernel runs on the last query alone — cheap, never out of the
    buffer (total = active + 1: static, or exactly past + 1 where the slots are full), and its one write lands in
    slot ``active``, an empty one — and its output is not taken."""
    rows = b.op("Where", uses, new, b.i64([1]))  # [1]
    return _kernel(b, "k_cache", "v_cache", active, rows, heads, first=b.op("Sub", new, rows), name=STATE_KERNEL)


def _scatter_rows(b: Body, results: dict[str, str]) -> dict[str, str]:
    """k and v written: one ScatterND each of the branches' whole rows into their slots, on the state input
    (bound in place by the runtime: only the T rows move — ScatterElements would move them element by element,
    ~15x slower). It runs after the If that computed the rows, so after every reader of the slots: the kernel,
    whose output the If takes, and everything inside the If."""
    index = results.pop(WRITTEN_INDEX)
    for name in DEFERRED:
        results[f"{name}_out"] = b.op("ScatterND", name, index, results.pop(f"{name}_rows"))
    return results


def _appending(
    b: Body,
    judged: Body,
    judged_results: dict[str, str],
    compression: Compression,
    attend: _Attend,
    filled: str,
    active: str,
    new: str,
    new_pos: str,
    observing: str,
    window_attr: str,
    heads: Heads,
    kernel: _Kernel | None = None,
) -> dict[str, str]:
    """The general call as an ``If``: where it does not observe and only appends to the slots (``_appends``), its
    meaning reduces to GroupQueryAttention over the active slots and new token i written into slot ``active + i``
    — the slots keep their scores, the new tokens score 0 (+inf where protected), nothing is evicted; else the
    whole call, as ``judged`` built it (``judged_results``). Per layer and chunk of an `end` prompt that is ~60
    nodes instead of ~230. With ``kernel`` (fp32 slots) the attention is its output, and k/v come out as rows
    (``_scatter_rows`` writes them)."""
    names = state_names(compression)
    deferred = kernel is not None
    append = Body(prefix=f"{b.prefix}append_")
    if deferred:  # the If's condition implies the kernel's: its output is right here
        out = append.op("Identity", kernel.out)
    else:
        out = _gqa_output(append, attend.in_branch(append), active, new, heads)
    k_stored, k_scale = _quantize(append, "k", compression)
    v_stored, v_scale = _quantize(append, "v", compression)
    protect = append.op("Expand", append.op("Unsqueeze", "protect", append.i64([1])), append.op("Shape", new_pos))
    score_new = append.op("Where", protect, append.f32(float("inf")), append.f32(0.0))
    incoming = {"k_cache": k_stored, "v_cache": v_stored, "k_scale": k_scale, "v_scale": v_scale}
    incoming |= {"pos": new_pos, "score": score_new}
    current = {name: name for name in names}
    # with the kernel the output is its own, computed before the If like every read of the old state: no wait
    waits_for = None if deferred else out
    written = _direct_writes(append, compression, current, incoming, active, new, waits_for, deferred)
    appended = {"out": out} | {_written_output(compression, key): value for key, value in written.items()}
    every = ("out", *(_written_output(compression, key) for key in _written_keys(compression, deferred)))
    typed = partial(_output_type, compression)
    graphs = {
        kind: _branch(body, results, every, f"{kind}_chunk", "_chunk", typed)
        for kind, body, results in (("append", append, appended), ("judged", judged, judged_results))
    }
    condition = _appends(b, filled, active, observing, new, window_attr, kernel.uses if kernel else None)
    results = {name: b.fresh(f"{name}_chunk") for name in every}
    b.nodes.append(
        helper.make_node(
            "If", [condition], list(results.values()), then_branch=graphs["append"], else_branch=graphs["judged"]
        )
    )
    return results


def _appends(
    b: Body, filled: str, active: str, observing: str, new: str, window_attr: str, fits: str | None = None
) -> str:
    """True when the call does not observe, extends the slots (``_extends``), fits the empty slots after them,
    and no filled slot scores -inf (which the pairing would take before an empty slot; a NaN fails too).
    ``fits``: those two tests already made (the kernel over the state's ``uses``), not made again."""
    if fits is None:
        fits = b.op("And", _extends(b, filled, active, window_attr), _room(b, active, new, b.shape("pos", 2)))
    above = b.op("Or", b.op("Greater", "score", b.f32(float("-inf"))), b.op("Not", filled))
    finite = b.op("Equal", b.op("ReduceMin", b.op("Cast", above, to=TensorProto.INT64), keepdims=0), b.i64(1))
    return b.op("And", b.op("And", b.op("Not", observing), fits), finite)


def _writes(
    b: Body,
    compression: Compression,
    policy,
    keep: str,
    score_all: str,
    arriving: dict[str, str],
    filled: str,
    active: str,
    capacity: str,
    new: str,
    newest: str,
    out: str,
    deferred: bool = False,
) -> dict[str, str]:
    """Step 4 of the general call as an ``If``: the direct write where the call fits the empty slots
    (``_fits_empty_slots``), else the pairing. Both give the reference's state; the direct one skips the pairing's
    TopKs, its gathers of the old and new rows and its element-wise scatters — most of an `end` prompt chunk's
    bookkeeping. ``deferred``: k and v come out as rows and their slots (``_written_keys``)."""
    condition = _fits_empty_slots(b, filled, active, keep, capacity, new)
    names = state_names(compression)
    keys = _written_keys(compression, deferred)
    graphs = {}
    for kind in ("direct", "paired"):
        body = Body(prefix=f"{b.prefix}{kind}_")
        if kind == "direct":
            current = {name: name for name in names}
            current["score"] = body.op("Slice", score_all, body.i64([0]), capacity, body.i64([-1]))
            incoming = arriving | {"score": body.op("Slice", score_all, capacity, body.i64([HUGE]), body.i64([-1]))}
            written = _direct_writes(body, compression, current, incoming, active, new, out, deferred)
        else:
            written = _paired_writes(
                body, compression, policy, keep, score_all, arriving, capacity, new, newest, out, deferred
            )
        typed = partial(_output_type, compression)
        named = {_written_output(compression, key): value for key, value in written.items()}
        outputs = [_written_output(compression, key) for key in keys]
        graphs[kind] = _branch(body, named, outputs, f"{kind}_writes", "_written", typed)
    results = {key: b.fresh(f"{key}_written") for key in keys}
    b.nodes.append(
        helper.make_node(
            "If",
            [condition],
            [results[key] for key in keys],
            then_branch=graphs["direct"],
            else_branch=graphs["paired"],
        )
    )
    return results


def _fits_empty_slots(b: Body, filled: str, active: str, keep: str, capacity: str, new: str) -> str:
    """True when the pairing would write new token i into slot ``active + i``: slots [0, active) filled on every
    head and at least T empty slots after them (TopK takes the lowest-index of the tied empty slots, -inf), every
    filled slot keeping more than an empty one and every new token more than that (each pair replaces). A NaN
    score fails the test (the pairing decides)."""
    per_head = b.op("ReduceSum", b.op("Cast", filled, to=TensorProto.INT64), b.i64([-1]), keepdims=0)
    no_holes = b.op("Equal", b.op("ReduceMin", per_head, keepdims=0), b.op("Squeeze", active))
    room = _room(b, active, new, capacity)
    candidates = b.op(
        "Concat",
        filled,
        b.op("Expand", b.boolean(True), b.op("Concat", b.op("Shape", filled, end=2), new, axis=0)),
        axis=2,
    )
    above_empty = b.op("Or", b.op("Greater", keep, b.f32(float("-inf"))), b.op("Not", candidates))
    all_above = b.op("Equal", b.op("ReduceMin", b.op("Cast", above_empty, to=TensorProto.INT64), keepdims=0), b.i64(1))
    return b.op("And", b.op("And", no_holes, room), all_above)


def _room(b: Body, active: str, new: str, capacity: str) -> str:
    """Whether the T new tokens fit the slots after the first ``active``."""
    return b.op("LessOrEqual", b.op("Squeeze", b.op("Add", active, new)), b.op("Squeeze", capacity))


def _direct_writes(
    b: Body,
    compression: Compression,
    current: dict[str, str],
    incoming: dict[str, str],
    active: str,
    new: str,
    out: str | None,
    deferred: bool = False,
) -> dict[str, str]:
    """New token i into slot ``active + i`` on every head: one ScatterND per state tensor (``current[name]``, the
    state input or a fresh tensor in its place), whole rows of ``incoming[name]``, indices [B,Hkv,T,3] (batch,
    head, slot). The slot indices wait for the attention output ``out``, which reads the old state (None: it was
    computed before this body runs). ``deferred``: k and v as their rows and the index instead
    (``_written_keys``)."""
    first = b.op("Squeeze", active)
    slots = b.op("Range", first, b.op("Add", first, b.op("Squeeze", new)), b.i64(1))  # [T]
    if out is not None:
        slots = _after(b, slots, out)
    written = {}
    names = state_names(compression)
    index = _row_index(b, b.op("Reshape", slots, b.i64([1, 1, -1])), incoming["pos"])
    if deferred:
        names = tuple(name for name in names if name not in DEFERRED)
        written[WRITTEN_INDEX] = index
        written |= {f"{name}_rows": incoming[name] for name in DEFERRED}  # the branch's Identity passes them on
    return written | {name: b.op("ScatterND", current[name], index, incoming[name]) for name in names}


def _row_index(b: Body, slots: str, like: str | None = None, heads_per_buffer: int | None = None) -> str:
    """ScatterND's indices [B,Hkv,T,3] (batch, head, slot) for ``slots`` [B,Hkv,T] (or one row of them that
    broadcasts to ``like``'s shape). ``heads_per_buffer``: the heads axis concatenates several buffers' heads, this
    many each (a batched eviction's layers): each index names the head within its own buffer."""
    like = like or slots
    grid = b.op("Concat", b.op("Shape", like), b.i64([1]), axis=0)  # [B,Hkv,T,1]
    batch = b.op("Reshape", b.op("Range", b.i64(0), b.op("Squeeze", b.shape(like, 0)), b.i64(1)), b.i64([-1, 1, 1, 1]))
    heads = b.op("Range", b.i64(0), b.op("Squeeze", b.shape(like, 1)), b.i64(1))
    if heads_per_buffer is not None:
        heads = b.op("Mod", heads, b.i64(heads_per_buffer))
    heads = b.op("Reshape", heads, b.i64([1, -1, 1, 1]))
    at_slot = b.op("Unsqueeze", slots, b.i64([-1]))
    return b.op("Concat", *(b.op("Expand", axis, grid) for axis in (batch, heads, at_slot)), axis=-1)


def _paired_writes(
    b: Body,
    compression: Compression,
    policy,
    keep: str,
    score_all: str,
    arriving: dict[str, str],
    capacity: str,
    new: str,
    newest: str,
    out: str,
    deferred: bool = False,
) -> dict[str, str]:
    """Pair the T weakest slots with the T strongest new tokens and write each pair's winner into the slot; prune.
    ``deferred``: k and v as the rows for those slots and the slots (``_written_keys``), not written."""
    keep_old = b.op("Slice", keep, b.i64([0]), capacity, b.i64([-1]))
    keep_new = b.op("Slice", keep, capacity, b.i64([HUGE]), b.i64([-1]))
    weak_values, weakest = b.op("TopK", keep_old, new, axis=-1, largest=0, sorted=1, outputs=2)
    strong_values, strongest = b.op("TopK", keep_new, new, axis=-1, largest=1, sorted=1, outputs=2)
    replace = b.op("Greater", strong_values, weak_values)  # [B,Hkv,T], a prefix of the pairs
    # re-pair the prefix in index order on both sides, so a cache with room fills slots in position order
    tail = b.op("Add", b.op("Range", b.i64(0), b.op("Squeeze", new), b.i64(1)), b.i64(HUGE))
    weakest = _index_order(b, weakest, replace, tail, new)
    strongest = _index_order(b, strongest, replace, tail, new)
    arriving = dict(arriving)
    arriving["score"] = b.op("Slice", score_all, capacity, b.i64([HUGE]), b.i64([-1]))
    current = {name: name for name in state_names(compression)} | {
        "score": b.op("Slice", score_all, b.i64([0]), capacity, b.i64([-1]))
    }
    # every reader of a state input must run before the in-place scatters that overwrite it. The attention output
    # reads v, v_scale (and k, for a policy that reads no attention or only some query rows) and, on the fused
    # path, pos (whether the call extends the slots); nothing the writes need depends on it, and the pruning
    # reads the evicted slots' old positions: make the slot indices wait for both
    evicted = _evicted(b, weakest, replace) if policy.prunes else None
    slots = _after(b, weakest, out, *([evicted] if evicted is not None else []))
    written = {}
    for name in state_names(compression):
        trailing = name not in ("score", "pos")
        if deferred and name in DEFERRED:
            written[f"{name}_rows"] = _write(
                b, current[name], arriving[name], slots, strongest, replace, trailing, scatter=False
            )
            if WRITTEN_INDEX not in written:
                written[WRITTEN_INDEX] = _row_index(b, slots)
        else:
            written[name] = _write(b, current[name], arriving[name], slots, strongest, replace, trailing)
    if policy.prunes:
        written["pos"] = _prune(b, policy, written, evicted, newest, compression)
    return written


def _observing(b: Body, new: str) -> str:
    """Whether the call updates the policy's scores: the ``observe`` input, or T = 1 (one token always observes)."""
    return b.op("Or", b.op("Squeeze", "observe", b.i64([0])), b.op("Equal", b.op("Squeeze", new), b.i64(1)))


def _unobserved(b: Body, score: str, new: str) -> str:
    """The scores of a call that does not observe: the slots keep theirs, the ``new`` tokens start at zero."""
    return b.op("Pad", score, b.op("Concat", b.i64([0, 0, 0, 0, 0]), new, axis=0), b.f32(0.0))


def _infinities(b: Body, condition: str) -> str:
    """+inf where ``condition``, -inf elsewhere (float, its shape): ``Max(x, ·)`` is ``Where(condition, +inf, x)``
    and ``Min(x, ·)`` is ``Where(condition, x, -inf)`` for every x but NaN (a NaN x stays NaN). Large selections
    are made this way because ONNX Runtime's Where is slow: 150 against 55 µs for this and the Max over
    [1,90,1024] (the batched eviction of SmolLM2's 30 layers; three such selections a step)."""
    as_float = b.op("Cast", condition, to=TensorProto.FLOAT)
    return b.op("Mul", b.op("Sub", as_float, b.f32(0.5)), b.f32(float("inf")))


def _after(b: Body, indices: str, *values: str) -> str:
    """``indices`` (non-negative int64), unchanged, but computed after every one of ``values``: ONNX Runtime runs
    a node once its inputs exist, so this orders the in-place scatters after the reads (Max with 0, or -1 for a
    NaN, leaves the indices as they are)."""
    for value in values:
        as_float = b.op("Cast", b.op("ReduceMax", value, keepdims=0), to=TensorProto.FLOAT)
        indices = b.op("Max", indices, b.op("Neg", b.op("Cast", b.op("IsNaN", as_float), to=TensorProto.INT64)))
    return indices


@dataclass(frozen=True)
class _Attend:
    """The general call's attention over [active slots; new tokens], for any set of query rows."""

    old_k: str  # [B,Hkv,active,D] float
    old_v: str
    key_pos: str  # [B,Hkv,active+T]
    rows_shape: str  # [0, Hkv, -1, D]
    group_size: str  # [1]: query heads per KV head
    scale: str
    window: str
    sliced_to: str | None = None  # [1] active, where old_k/old_v are Slices of the fp32 state up to it
    new_k: str = "k"  # [B,Hkv,T,D]: the new tokens' keys

    def probs(self, b: Body, q: str, positions: str, rows: str) -> str:
        """Probabilities [B,Hkv,G·n,active+T] of queries q [B,H,n,D] at positions [B,n] (n = ``rows``), masked
        as the reference masks them: empty slots, future positions, outside a sliding window."""
        queries = b.op("Reshape", q, self.rows_shape)
        transpose = {"perm": [0, 1, 3, 2]}
        scores_old = b.op("MatMul", queries, b.op("Transpose", self.old_k, **transpose))
        scores_new = b.op("MatMul", queries, b.op("Transpose", self.new_k, **transpose))
        scores = b.op("Mul", b.op("Concat", scores_old, scores_new, axis=-1), self.scale)  # [B,Hkv,G·n,K]
        # which keys a query sees depends on its position, not on which head of its group asks: the mask is made
        # once per position, [B,Hkv,1,n,K], and broadcast over the G heads (rows g·n + t hold position t) — a G-th
        # of the comparisons and of the bias over the largest tensor an observing prompt chunk masks
        query_pos = b.op("Unsqueeze", positions, b.i64([1, 2, 4]))  # [B,1,1,n,1]
        keys = b.op("Unsqueeze", self.key_pos, b.i64([2, 3]))  # [B,Hkv,1,1,K]
        lowest = _lowest_visible(b, query_pos, self.window)
        valid = b.op("And", b.op("GreaterOrEqual", keys, lowest), b.op("LessOrEqual", keys, query_pos))
        grouped = b.op("Concat", b.op("Shape", scores, end=2), self.group_size, rows, b.i64([-1]), axis=0)
        # Where(valid, scores, -inf) as a Min (_infinities): ONNX Runtime's Where is slower
        masked = b.op("Min", b.op("Reshape", scores, grouped), _infinities(b, valid))  # [B,Hkv,G,n,K]
        return b.op("Softmax", b.op("Reshape", masked, b.op("Shape", scores)), axis=-1)

    def query_head_probs(self, b: Body, query: str, heads: Heads, q: str, positions: str, rows: str) -> str:
        """``probs`` of query head ``query`` ([1] int64: a Loop's iteration) alone, [B,1,n,active+T], from its
        rows of q [B,H,n,D] over its KV head's keys: every tensor over the keys a ``heads.query``-th of the whole
        call's. The keys are sliced for that KV head alone (from the fp32 state itself where ``sliced_to``), never
        the whole past first."""
        kv_head = b.op("Div", query, b.i64([heads.query // heads.kv]))
        after = b.op("Add", kv_head, b.i64([1]))

        def one(name: str, first: str = kv_head, end: str = after) -> str:
            return b.op("Slice", name, first, end, b.i64([1]))

        if self.sliced_to is None:
            old_k = one(self.old_k)
        else:  # the KV head's filled slots, read from the state in one Slice
            starts = b.op("Concat", kv_head, b.i64([0]), axis=0)
            old_k = b.op("Slice", FORMAL["k"], starts, b.op("Concat", after, self.sliced_to, axis=0), b.i64([1, 2]))
        attend = replace(
            self,
            old_k=old_k,
            old_v="",  # probabilities only: no output from this view
            key_pos=one(self.key_pos),
            rows_shape=b.i64([0, 1, -1, heads.dim]),
            group_size=b.i64([1]),
            sliced_to=None,
            new_k=one(self.new_k),
        )
        return attend.probs(b, one(q, query, b.op("Add", query, b.i64([1]))), positions, rows)

    def in_branch(self, b: Body) -> _Attend:
        """The same attention for use inside ``b``, an If branch: fp32 slots sliced from the state there, since
        ONNX Runtime's optimizer warns on every load when a subgraph reads an outer Slice's output."""
        if self.sliced_to is None:
            return self
        slices = (b.op("Slice", name, b.i64([0]), self.sliced_to, b.i64([2])) for name in ("k_cache", "v_cache"))
        return replace(self, old_k=next(slices), old_v=next(slices))

    def output(self, b: Body, probs: str, active: str) -> str:
        """The attention output [B,T,H,D] from every query's probabilities."""
        probs_old = b.op("Slice", probs, b.i64([0]), active, b.i64([-1]))
        probs_new = b.op("Slice", probs, active, b.i64([HUGE]), b.i64([-1]))
        context = b.op("Add", b.op("MatMul", probs_old, self.old_v), b.op("MatMul", probs_new, "v"))  # [B,Hkv,G·T,D]
        return b.op("Transpose", b.op("Reshape", context, b.op("Shape", "q")), perm=[0, 2, 1, 3])


def _extends(b: Body, filled: str, active: str, window_attr: str) -> str:
    """True when the call only extends the slots: slots [0, active) all filled on every head, every new position
    after every cached one and increasing, no sliding window. Then each query sees every slot and the new
    tokens up to itself — GroupQueryAttention's causal mask over a past of ``active`` keys."""
    per_head = b.op("ReduceSum", b.op("Cast", filled, to=TensorProto.INT64), b.i64([-1]), keepdims=0)
    no_holes = b.op("Equal", b.op("ReduceMin", per_head, keepdims=0), b.op("Squeeze", active))
    after = b.op("Less", b.op("ReduceMax", "pos", keepdims=0), b.op("ReduceMin", "position_ids", keepdims=0))
    steps = b.op(
        "Sub",
        b.op("Slice", "position_ids", b.i64([1]), b.i64([HUGE]), b.i64([1])),
        b.op("Slice", "position_ids", b.i64([0]), b.i64([-1]), b.i64([1])),
    )  # T > 1 in the general branch: never empty
    increasing = b.op("Greater", b.op("ReduceMin", steps, keepdims=0), b.i64(0))
    no_window = b.op("Not", b.op("Greater", window_attr, b.i64(0)))
    return b.op("And", b.op("And", no_holes, after), b.op("And", increasing, no_window))


def _fused_output(
    b: Body,
    attend: _Attend,
    filled: str,
    active: str,
    new: str,
    window_attr: str,
    heads: Heads,
    kernel: _Kernel | None = None,
) -> str:
    """The attention output [B,T,H,D]: GroupQueryAttention over a past of the active slots when the call extends
    them (no score matrix is materialized; ONNX Runtime's kernel), else every query's probabilities. With
    ``kernel`` (fp32 slots): its output where it is right, this otherwise (in an If's other branch)."""
    outer = b
    if kernel is not None:
        b = Body(prefix=f"{outer.prefix}fallback_")
    fast, full = Body(prefix=f"{b.prefix}gqa_"), Body(prefix=f"{b.prefix}full_")
    attend_full = attend.in_branch(full)
    fast_out = _gqa_output(fast, attend.in_branch(fast), active, new, heads)
    full_out = attend_full.output(full, attend_full.probs(full, "q", "position_ids", new), active)
    branches = {}
    for kind, body, result in (("fast", fast, fast_out), ("full", full, full_out)):
        value = body.op("Identity", result, name="out_result")
        output = helper.make_tensor_value_info(value, TensorProto.FLOAT, None)
        branches[kind] = helper.make_graph(body.nodes, f"{kind}_attention", [], [output])
    out = b.fresh("attention_out")
    condition = _extends(b, filled, active, window_attr)
    fast_branch, full_branch = branches["fast"], branches["full"]
    b.nodes.append(helper.make_node("If", [condition], [out], then_branch=fast_branch, else_branch=full_branch))
    if kernel is None:
        return out
    taken = Body(prefix=f"{outer.prefix}state_kernel_")
    results = {"kernel": taken.op("Identity", kernel.out, name="out_result"), "fallback": b.op("Identity", out)}
    graphs = {}
    for kind, body in (("kernel", taken), ("fallback", b)):
        output = helper.make_tensor_value_info(results[kind], TensorProto.FLOAT, None)
        graphs[kind] = helper.make_graph(body.nodes, f"{kind}_attention", [], [output])
    chosen = outer.fresh("attention_out")
    outer.nodes.append(
        helper.make_node("If", [kernel.uses], [chosen], then_branch=graphs["kernel"], else_branch=graphs["fallback"])
    )
    return chosen


def _gqa_output(b: Body, attend: _Attend, active: str, new: str, heads: Heads) -> str:
    """The attention output [B,T,H,D] from ``com.microsoft::GroupQueryAttention`` over a past of the active slots
    (``attend.old_k``/``old_v``, slots [0, active)): right only where the call extends them (``_extends``)."""
    return _kernel(b, attend.old_k, attend.old_v, active, new, heads)


def _kernel(
    b: Body,
    past_k: str,
    past_v: str,
    active: str,
    rows: str,
    heads: Heads,
    first: str | None = None,
    name: str = "gqa",
) -> str:
    """``com.microsoft::GroupQueryAttention`` of ``rows`` new tokens (the last ones of q, k, v from ``first``; all
    of them without it) after ``active`` past slots of ``past_k``/``past_v``; its output [B,rows,H,D]. The node
    is named ``name`` (made unique), its presents left for a caller that wants them (``prefill_graph``)."""

    def packed(x: str, width: int) -> str:  # [B,H,T,D] → the kernel's [B,T,H·D]
        whole = b.op("Reshape", b.op("Transpose", x, perm=[0, 2, 1, 3]), b.i64([0, 0, width]))
        return whole if first is None else b.op("Slice", whole, first, b.i64([HUGE]), b.i64([1]))

    query = packed("q", heads.query * heads.dim)
    key, value = packed("k", heads.kv * heads.dim), packed("v", heads.kv * heads.dim)
    total = b.op("Add", active, rows)  # [1]
    batch = b.op("Shape", "position_ids", end=1)
    seqlens = b.op("Cast", b.op("Expand", b.op("Sub", total, b.i64([1])), batch), to=TensorProto.INT32)
    total_length = b.op("Cast", b.op("Squeeze", total), to=TensorProto.INT32)
    fused = [b.fresh(f"{name}_out"), b.fresh(f"{name}_present_k"), b.fresh(f"{name}_present_v")]
    node = helper.make_node(
        "GroupQueryAttention",
        [query, key, value, past_k, past_v, seqlens, total_length],
        fused,
        name=b.fresh(name),
        domain="com.microsoft",
        num_heads=heads.query,
        kv_num_heads=heads.kv,
    )
    scale = helper.make_attribute_ref("scale", AttributeProto.FLOAT)
    scale.ref_attr_name = "scale"
    node.attribute.append(scale)
    b.nodes.append(node)
    return b.op("Reshape", fused[0], b.i64([0, 0, heads.query, heads.dim]))


def _lowest_visible(b: Body, query_pos: str, window: str) -> str:
    """The lowest key position each query may see: 0, or with a sliding window (``window`` > 0) q − window + 1."""
    span = b.op("Where", b.op("Greater", window, b.i64(0)), window, b.i64(HUGE))
    return b.op("Max", b.op("Sub", query_pos, b.op("Sub", span, b.i64(1))), b.i64(0))


def _hidden(b: Body, slot_pos: str, position: str, window: str) -> str:
    """A one-token step's additive mask over slots: 0 where the token may see the slot, -inf for an empty slot
    (pos -1) or one below the sliding window. slot_pos [B,Hkv,A], position [B,1,1] → [B,Hkv,A]."""
    lowest = _lowest_visible(b, position, window)
    return b.op("Where", b.op("GreaterOrEqual", slot_pos, lowest), b.f32(0.0), b.f32(float("-inf")))


def _decode(b: Body, compression: Compression, scale_attr: str, window_attr: str, heads: Heads) -> dict[str, str]:
    """One new token per sequence (T = 1): the general meaning, specialised. Every node runs once per layer and
    token, so the head layout is baked in (no shape arithmetic) and quantized slots are never dequantized: the
    group scales are applied to the few query/probability rows instead of to every cached value (see
    ``_scaled_scores``), which is most of the work at 1K+ slots."""
    policy = policies.get(compression.policy)
    per_kv = heads.query // heads.kv  # query heads per KV head
    capacity = b.shape("pos", 2)
    filled = b.op("GreaterOrEqual", "pos", b.i64(0))
    # attention reads slots [0, active): empty slots fill lowest first. At least one slot, so no tensor is
    # empty (an empty slot is masked like any other)
    active = b.op("Max", _active(b, filled, capacity), b.i64([1]))

    def active_slots(name: str) -> str:
        return b.op("Slice", name, b.i64([0]), active, b.i64([2]))

    # the query heads of each KV head as rows: [B,Hkv,G,D]
    queries = b.op("Reshape", "q", b.i64([0, heads.kv, per_kv, heads.dim]))
    raw_k = _raw_values(b, active_slots("k_cache"), compression, heads.dim)
    raw_v = _raw_values(b, active_slots("v_cache"), compression, heads.dim)
    if compression.quantized:
        k_scale = b.op("Transpose", active_slots("k_scale"), perm=[0, 1, 3, 2])  # [B,Hkv,D/G,A]
        v_scale = b.op("Transpose", active_slots("v_scale"), perm=[0, 1, 3, 2])
        group_mask = _group_mask(b, heads, compression.group)
        scores_old = _scaled_scores(b, queries, raw_k, k_scale, group_mask, heads, compression.group)
    else:
        scores_old = b.op("MatMul", queries, b.op("Transpose", raw_k, perm=[0, 1, 3, 2]))  # [B,Hkv,G,A]
    scores_new = b.op("MatMul", queries, b.op("Transpose", "k", perm=[0, 1, 3, 2]))  # [B,Hkv,G,1]
    # every filled slot is in the past of the one query; a sliding window still bounds it from below
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    # masked by adding 0 or -inf: a Where broadcast over the query rows is several times slower in ORT
    hidden = _hidden(b, active_slots("pos"), position, window_attr)
    masked_old = b.op("Add", scores_old, b.op("Unsqueeze", hidden, b.i64([2])))  # [B,Hkv,G,A] + [B,Hkv,1,A]
    probs = b.op("Softmax", b.op("Mul", b.op("Concat", masked_old, scores_new, axis=-1), scale_attr), axis=-1)
    probs_old = b.op("Slice", probs, b.i64([0]), active, b.i64([-1]))
    probs_new = b.op("Slice", probs, active, b.i64([HUGE]), b.i64([-1]))  # [B,Hkv,G,1]
    if compression.quantized:
        context_old = _scaled_context(b, probs_old, raw_v, v_scale, group_mask, heads, compression.group)
    else:
        context_old = b.op("MatMul", probs_old, raw_v)
    context = b.op("Add", context_old, b.op("Mul", probs_new, "v"))  # [B,Hkv,G,D]
    out = b.op("Reshape", context, b.i64([0, 1, heads.query, heads.dim]))  # [B,1,H,D]

    # scores of every candidate (C slots + the token) from this step's attention
    total = None
    if policy.needs:
        total = b.op("ReduceSum", probs, b.i64([2]), keepdims=0)  # [B,Hkv,A+1]
        gap = b.op("Concat", b.i64([0, 0, 0, 0, 0]), b.op("Sub", capacity, active), axis=0)
        old_part = b.op("Pad", b.op("Slice", total, b.i64([0]), active, b.i64([-1])), gap, b.f32(0.0))
        total = b.op("Concat", old_part, b.op("Slice", total, active, b.i64([HUGE]), b.i64([-1])), axis=-1)
    current = {name: name for name in state_names(compression)}
    step = _Step(capacity, filled, position)
    return {"out": out} | _evict_into_weakest(b, compression, heads, step, total, current, after_out=context)


@dataclass(frozen=True)
class _Step:
    """What a one-token step computes once and its eviction reads again."""

    capacity: str  # [1]: C, the slots
    filled: str  # [B,Hkv,C] bool: pos ≥ 0
    position: str  # [B,1,1]: the token's position


def _evict_into_weakest(
    b: Body,
    compression: Compression,
    heads: Heads,
    step: _Step,
    total: str | None,
    current: dict[str, str],
    after_out: str | None,
    after_all: str | None = None,
) -> dict[str, str]:
    """The one-token step's update after its attention: the policy's scores from ``total`` (the token's
    probabilities summed over each KV head's query heads, [B,Hkv,C+1]: the C slots, then the token; None for a
    policy that reads none), the weakest evictable slot per KV head, and the token's rows, position and score
    scattered into it. ``current``: the state to write into, by state name (the inputs, or for k/v the buffers
    GroupQueryAttention wrote); ``after_out``: a value the v writes must wait for (the attention output, where v
    is read in place); ``after_all``: one every write must wait for (where the weakest slot is not computed from
    the attention, yet ``pos`` is read by it). Returns the ``*_out`` state outputs."""
    policy = policies.get(compression.policy)
    per_kv = heads.query // heads.kv
    capacity, filled, position = step.capacity, step.filled, step.position
    stats = {}
    if policy.needs:
        stats = {"total": total, "observed": total}  # one query: it is the whole observation window
        if "last" in policy.needs:
            stats["last"] = b.op("Div", total, b.f32(float(per_kv)))
    new_pos = b.op("Expand", position, b.i64([1, heads.kv, 1]))  # [B,Hkv,1]
    key_pos = b.op("Concat", "pos", new_pos, axis=2)
    updated = policy.update_onnx(b, "score", stats, key_pos, None)
    inf = b.f32(float("inf"))
    old_protected = b.op("And", b.op("IsInf", "score", detect_negative=0), filled)
    # Where(old_protected, +inf, ·) over every slot, as a Max (see _infinities)
    score_old = b.op("Max", b.op("Slice", updated, b.i64([0]), capacity, b.i64([-1])), _infinities(b, old_protected))
    new_protected = b.op("Unsqueeze", "protect", b.i64([1]))  # [B,1,1]
    score_new = b.op("Where", new_protected, inf, b.op("Slice", updated, capacity, b.i64([HUGE]), b.i64([-1])))
    # the weakest slot takes the token (which, inside the recent window, is always kept); protected slots
    # already score +inf, so only sinks and the recent window are forced here: to +inf (Max), and empty slots to
    # -inf (Min), so that ArgMin takes an empty slot first
    sink = b.op("Less", "pos", b.i64(compression.sink))
    recent = b.op("Greater", "pos", b.op("Sub", position, b.i64(compression.window)))
    keep_old = b.op("Max", score_old, _infinities(b, b.op("Or", sink, recent)))
    keep_old = b.op("Min", keep_old, _infinities(b, filled))
    weakest = b.op("ArgMin", keep_old, axis=-1, keepdims=1)  # [B,Hkv,1]
    weakest = _after(b, weakest, after_all) if after_all is not None else weakest
    # see _general: the pruning reads the old positions, v is read by the output only
    replace = b.op("Expand", b.boolean(True), b.op("Shape", weakest)) if policy.prunes else None
    evicted = _evicted(b, weakest, replace) if policy.prunes else None
    weakest = _after(b, weakest, evicted) if policy.prunes else weakest
    weakest_after_out = _after(b, weakest, after_out) if after_out is not None else weakest
    k_stored, k_scale_new = _quantize(b, "k", compression)
    v_stored, v_scale_new = _quantize(b, "v", compression)
    arriving = {"k_cache": k_stored, "v_cache": v_stored, "k_scale": k_scale_new, "v_scale": v_scale_new}
    arriving |= {"pos": new_pos, "score": score_new}
    current = current | {"score": score_old}
    # one slot index for all channels of the arriving row (Expand broadcasts [B,Hkv,1,1] to [B,Hkv,1,W])
    stored = heads.dim // 2 if compression.dtype == "int4" else heads.dim
    groups = heads.dim // compression.group
    widths = {"k_cache": stored, "v_cache": stored, "k_scale": groups, "v_scale": groups}
    slot_rows = {}
    written = {}
    for name in state_names(compression):
        slots = weakest_after_out if name in ("v_cache", "v_scale") else weakest
        if name not in ("score", "pos"):
            if slots not in slot_rows:
                slot_rows[slots] = b.op("Unsqueeze", slots, b.i64([-1]))
            slots = b.op("Expand", slot_rows[slots], b.i64([1, 1, 1, widths[name]]))
        written[name] = b.op("ScatterElements", current[name], slots, arriving[name], axis=2)
    if policy.prunes:
        written["pos"] = _prune(b, policy, written, evicted, position, compression)
    return {f"{name}_out": value for name, value in written.items()}


def _decode_gqa(b: Body, compression: Compression, scale_attr: str, window_attr: str, heads: Heads) -> dict[str, str]:
    """The one-token step over fp32 slots with ONNX Runtime's GroupQueryAttention reading them in place
    (``Compression.decode_kernel`` gqa): the same meaning as ``_decode``, without its slices and transposes of
    every slot. k/v carry one spare row after the C slots; in its static-cache mode (``seqlens_k`` = C, total
    C + 1) the kernel writes the token's k/v into that row, attends over all C + 1 rows — empty slots and those
    below a sliding window masked by an attention bias built from ``pos``, as ``_decode`` masks them — and returns
    the query's probabilities (``qk_output``), from which ``_evict_into_weakest`` scores and writes the token into
    its slot of the kernel's present. Bound in place (the present and the new state one buffer with the input,
    ``prefill_graph.expose_decode_present``) nothing is copied; unbound, the kernel copies the past first — the
    same values."""
    per_kv = heads.query // heads.kv
    capacity = b.shape("pos", 2)  # [1]: C
    rows = b.op("Add", capacity, b.i64([1]))  # [1]: C + 1, the buffer's rows
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    # the slots as _decode masks them; the spare row (the token) is seen: [B,Hkv,C+1], then one row per query
    # head, as the kernel wants it: [B,H,1,C+1]
    hidden = _hidden(b, "pos", position, window_attr)
    bias = b.op("Pad", hidden, b.i64([0, 0, 0, 0, 0, 1]), b.f32(0.0))
    grouped_rows = b.op("Concat", b.i64([1, heads.kv, per_kv]), rows, axis=0)  # Expand broadcasts 1 to B
    bias = b.op("Expand", b.op("Unsqueeze", bias, b.i64([2])), grouped_rows)  # [B,Hkv,G,C+1]
    bias = b.op("Reshape", bias, b.op("Concat", b.i64([0, heads.query, 1]), rows, axis=0))
    # q [B,H,1,D] and k, v [B,Hkv,1,D] hold their one row in the kernel's [B,1,H·D] order already
    query = b.op("Reshape", "q", b.i64([0, 1, heads.query * heads.dim]))
    key = b.op("Reshape", "k", b.i64([0, 1, heads.kv * heads.dim]))
    value = b.op("Reshape", "v", b.i64([0, 1, heads.kv * heads.dim]))
    batch = b.op("Shape", "position_ids", end=1)
    seqlens = b.op("Cast", b.op("Expand", capacity, batch), to=TensorProto.INT32)
    total_length = b.op("Cast", b.op("Squeeze", rows), to=TensorProto.INT32)
    fused = [b.fresh("gqa_out"), b.fresh("gqa_present_k"), b.fresh("gqa_present_v"), b.fresh("gqa_probs")]
    node = helper.make_node(
        "GroupQueryAttention",
        [query, key, value, "k_cache", "v_cache", seqlens, total_length, "", "", "", bias],
        fused,
        domain="com.microsoft",
        num_heads=heads.query,
        kv_num_heads=heads.kv,
        qk_output=2,  # the probabilities after the softmax: [B,H,1,C+1]
    )
    scale = helper.make_attribute_ref("scale", AttributeProto.FLOAT)
    scale.ref_attr_name = "scale"
    node.attribute.append(scale)
    b.nodes.append(node)
    out = b.op("Reshape", fused[0], b.i64([0, 1, heads.query, heads.dim]))  # [B,1,H,D]
    total = None
    if policies.get(compression.policy).needs:
        grouped = b.op("Reshape", fused[3], b.op("Concat", b.i64([0, heads.kv, per_kv]), rows, axis=0))
        total = b.op("ReduceSum", grouped, b.i64([2]), keepdims=0)  # [B,Hkv,C+1]
    current = {name: name for name in state_names(compression)}
    current |= {"k_cache": fused[1], "v_cache": fused[2]}  # written after the kernel: no ordering needed
    step = _Step(capacity, b.op("GreaterOrEqual", "pos", b.i64(0)), position)
    # the attention bias reads pos before its in-place write: a policy that scores from the probabilities orders
    # the writes after the kernel already; one that reads none (streaming) must wait for the kernel's output
    wait = fused[0] if total is None else None
    return {"out": out} | _evict_into_weakest(b, compression, heads, step, total, current, None, after_all=wait)


def _group_mask(b: Body, heads: Heads, group: int) -> str:
    """[D/G, 1, D] float: row g is 1 on the channels of group g."""
    import numpy as np

    groups = heads.dim // group
    mask = (np.arange(heads.dim)[None, :] // group == np.arange(groups)[:, None]).astype(np.float32)
    return b.op("Constant", value=onnx.numpy_helper.from_array(mask[:, None, :], "group_mask"), name="group_mask")


def _scaled_scores(b: Body, queries: str, raw_k: str, k_scale: str, group_mask: str, heads: Heads, group: int) -> str:
    """q · (raw k × its group scales) without scaling k: one product per (group, query row), each masked to
    its group's channels, then the per-slot scales weight the groups — D/G × G rows of work instead of A × D.
    queries [B,Hkv,Gq,D], raw_k [B,Hkv,A,D], k_scale [B,Hkv,D/G,A] → [B,Hkv,Gq,A]."""
    groups, per_kv = heads.dim // group, heads.query // heads.kv
    split = b.op("Mul", b.op("Unsqueeze", queries, b.i64([2])), group_mask)  # [B,Hkv,D/G,Gq,D]
    split = b.op("Reshape", split, b.i64([0, 0, groups * per_kv, heads.dim]))
    partial = b.op("MatMul", split, b.op("Transpose", raw_k, perm=[0, 1, 3, 2]))  # [B,Hkv,D/G·Gq,A]
    partial = b.op("Reshape", partial, b.i64([0, 0, groups, per_kv, -1]))
    weighted = b.op("Mul", partial, b.op("Unsqueeze", k_scale, b.i64([3])))
    return b.op("ReduceSum", weighted, b.i64([2]), keepdims=0)


def _scaled_context(b: Body, probs: str, raw_v: str, v_scale: str, group_mask: str, heads: Heads, group: int) -> str:
    """probs · (raw v × its group scales): the scales weight the probabilities once per group, the product
    runs on the raw values, and each group keeps its own channels. probs [B,Hkv,Gq,A], raw_v [B,Hkv,A,D],
    v_scale [B,Hkv,D/G,A] → [B,Hkv,Gq,D]."""
    groups, per_kv = heads.dim // group, heads.query // heads.kv
    weighted = b.op("Mul", b.op("Unsqueeze", probs, b.i64([2])), b.op("Unsqueeze", v_scale, b.i64([3])))
    weighted = b.op("Reshape", weighted, b.i64([0, 0, groups * per_kv, -1]))  # [B,Hkv,D/G·Gq,A]
    partial = b.op("Reshape", b.op("MatMul", weighted, raw_v), b.i64([0, 0, groups, per_kv, heads.dim]))
    return b.op("ReduceSum", b.op("Mul", partial, group_mask), b.i64([2]), keepdims=0)


def _index_order(b: Body, indices: str, replace: str, tail: str, count: str) -> str:
    key = b.op("Where", replace, indices, tail)
    _, order = b.op("TopK", key, count, axis=-1, largest=0, sorted=1, outputs=2)
    return b.op("GatherElements", indices, order, axis=-1)


def _forced(b: Body, key_pos: str, newest: str, protected: str, compression: Compression) -> str:
    filled = b.op("GreaterOrEqual", key_pos, b.i64(0))
    sink = b.op("Less", key_pos, b.i64(compression.sink))
    recent = b.op("Greater", key_pos, b.op("Sub", newest, b.i64(compression.window)))
    return b.op("Or", protected, b.op("And", filled, b.op("Or", sink, recent)))


def _write(
    b: Body, old: str, arriving: str, weakest: str, strongest: str, replace: str, trailing: bool, scatter: bool = True
) -> str:
    """Scatter, into the T weakest slots, either the paired new token or the slot's own value (``scatter`` False:
    those values, [B,Hkv,T(,D)], for a scatter after the If)."""
    if trailing:  # k/v/scales carry a channel axis: broadcast the slot indices over it
        axis = b.i64([-1])
        width = b.shape(old, 3)
        slots = b.op("Expand", b.op("Unsqueeze", weakest, axis), b.op("Concat", b.op("Shape", weakest), width, axis=0))
        picks = b.op(
            "Expand", b.op("Unsqueeze", strongest, axis), b.op("Concat", b.op("Shape", strongest), width, axis=0)
        )
        choose = b.op("Unsqueeze", replace, axis)
    else:
        slots, picks, choose = weakest, strongest, replace
    chosen = b.op("GatherElements", arriving, picks, axis=2)
    kept = b.op("GatherElements", old, slots, axis=2)
    updates = b.op("Where", choose, chosen, kept)
    return b.op("ScatterElements", old, slots, updates, axis=2) if scatter else updates


def _evicted(b: Body, weakest: str, replace: str) -> str:
    """[B,Hkv,1] bool: the heads on which this call replaces a filled slot (read before the writes)."""
    evicted_filled = b.op("GreaterOrEqual", b.op("GatherElements", "pos", weakest, axis=2), b.i64(0))
    return b.op(
        "Cast",
        b.op(
            "ReduceMax",
            b.op("Cast", b.op("And", replace, evicted_filled), to=TensorProto.INT32),
            b.i64([-1]),
            keepdims=1,
        ),
        to=TensorProto.BOOL,
    )


def _prune(b: Body, policy, written: dict[str, str], evicted: str, newest: str, compression) -> str:
    """Empty (pos = -1) every evictable slot the policy drops, on heads that evicted in this call."""
    pos, score = written["pos"], written["score"]
    protected = b.op("IsInf", score, detect_negative=0)
    forced = _forced(b, pos, newest, protected, compression)
    evictable = b.op("And", b.op("And", b.op("GreaterOrEqual", pos, b.i64(0)), b.op("Not", forced)), evicted)
    dropped = policy.prune_onnx(b, score, evictable)
    return b.op("Where", dropped, b.i64(-1), pos)


def make_schema(compression: Compression) -> onnx.defs.OpSchema:
    """An OpSchema for the op (tracing tools and checkers know its inputs and outputs)."""
    storage = onnx.helper.tensor_dtype_to_string(STORAGE_TYPES[compression.dtype])
    kinds = {"q": "T", "k": "T", "v": "T", "position_ids": "I", "protect": "B", "score": "F", "pos": "I"}
    kinds["observe"] = "B"
    kinds |= {"k_cache": "S", "v_cache": "S", "k_scale": "F", "v_scale": "F"}
    kinds |= {"k_hi": "W", "v_hi": "W", "k_hi_scale": "F", "v_hi_scale": "F", "score_hi": "F", "pos_hi": "I"}
    wide = STORAGE_TYPES.get(compression.mixed)  # a mixed cache's wide pool
    wide = [("W", [onnx.helper.tensor_dtype_to_string(wide)], "wide pool storage")] if wide is not None else []
    param = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        inputs=[param(name, kinds[name]) for name in inputs(compression)],
        outputs=[
            param(name, "T" if name in ("out", RECALL_QUERY) else kinds[name[:-4]]) for name in outputs(compression)
        ],
        type_constraints=[
            ("T", ["tensor(float)"], "compute dtype"),
            ("S", [storage], "cache storage"),
            ("F", ["tensor(float)"], "scales and scores"),
            ("I", ["tensor(int64)"], "positions"),
            ("B", ["tensor(bool)"], "protect flags, observe"),
            *wide,
        ],
        attributes=[
            onnx.defs.OpSchema.Attribute("scale", onnx.defs.OpSchema.AttrType.FLOAT, "softmax scale"),
            onnx.defs.OpSchema.Attribute("window", onnx.defs.OpSchema.AttrType.INT, "sliding window, 0 = none"),
        ],
    )
