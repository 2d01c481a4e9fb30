"""The body of ``ai.edgec::CompressedKVAttention`` for a mixed-precision cache: two slot pools, a wide one (int8 or
fp16: the sinks, the recent window, protected tokens) and a narrow one (e.g. int4: everything else). Its meaning is
``reference._mixed``; read that first. ``compressed_function.make_function`` wraps it (the rotation too).

The same ``If`` on T = 1 as the one-pool op: ``body`` for any T — the general call's steps over the slots [wide;
narrow] and the new tokens — and ``decode`` for one token, which bakes the head layout in and never dequantizes
the narrow slots (the scale trick of the one-pool decode branch). Both then place the same way (``_place``): the
wide pool keeps its strongest by the wide key (+inf for sinks and protected, else the position), and the T
candidates it displaces compete for the narrow pool by keep-score, re-quantized from their wide values. Prompt
chunks do not use the fused GroupQueryAttention path yet (docs/kv-cache.md says what that costs).

In place: every node that reads a state input must run before the scatter that overwrites it. The wide pool's
values are read twice (attention, and the displaced tokens' values for the narrow pool), so every scatter's slot
indices are made to wait for the attention output and the displaced values (``Max`` with a non-positive number
they determine); positions and scores are read through copies (``Concat``) that the pairings depend on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from onnx import TensorProto

from edgec.kvcache import policies
from edgec.kvcache.compressed_function import (
    HUGE,
    STORAGE_TYPES,
    Heads,
    _active,
    _Attend,
    _dequantize,
    _forced,
    _group_mask,
    _index_order,
    _observing,
    _quantize,
    _raw_values,
    _scaled_context,
    _scaled_scores,
    _unobserved,
    _write,
)
from edgec.kvcache.compression import Compression
from edgec.kvcache.onnx_body import Body
from edgec.kvcache.spec import compressed_state

FORMAL = {"k": "k_cache", "v": "v_cache"}


def _slice(b: Body, x: str, start: str | list[int], end: str | list[int]) -> str:
    """x[..., start:end] along the last axis (start/end: names of [1] int64 tensors, or lists)."""
    start = b.i64(start) if isinstance(start, list) else start
    end = b.i64(end) if isinstance(end, list) else end
    return b.op("Slice", x, start, end, b.i64([-1]))


def _rows(b: Body, values: str, index: str) -> str:
    """values [B,Hkv,N,D] at index [B,Hkv,n] along axis 2 → [B,Hkv,n,D]."""
    width = b.shape(values, 3)
    rows = b.op("Expand", b.op("Unsqueeze", index, b.i64([-1])), b.op("Concat", b.op("Shape", index), width, axis=0))
    return b.op("GatherElements", values, rows, axis=2)


def _not_nan(b: Body, *values: str) -> str:
    """A non-positive int64 scalar that depends on every one of ``values`` (float tensors): 0, or -1 for a NaN."""
    flags = [
        b.op("Cast", b.op("IsNaN", b.op("ReduceMax", value, keepdims=0)), to=TensorProto.INT64) for value in values
    ]
    total = flags[0]
    for flag in flags[1:]:
        total = b.op("Add", total, flag)
    return b.op("Neg", total)


@dataclass(frozen=True)
class _Scored:
    """What the attention half of a call hands to the placement half (names in the body)."""

    out: str  # [B,T,H,D]
    key_pos: str  # [B,Hkv,hi+lo+T]: every candidate, a copy of the state's positions
    new_pos: str  # [B,Hkv,T]
    bht: str  # [3]: B, Hkv, T
    old_pos: str  # [B,Hkv,hi+lo]
    old_score: str
    updated: str  # the policy's scores of every candidate
    hi_k: str  # the wide pool's values, dequantized [B,Hkv,hi,D]
    hi_v: str


def body(b: Body, compression: Compression, scale_attr: str, window_attr: str) -> dict[str, str]:
    """Any T: every output of the op by its formal name (``out``, ``k_cache_out``, …, ``pos_hi_out``)."""
    new = b.shape("k", 2)  # T
    return _place(b, compression, _attend_general(b, compression, scale_attr, window_attr, new), new)


def decode(b: Body, compression: Compression, scale_attr: str, window_attr: str, heads: Heads) -> dict[str, str]:
    """T = 1, the same meaning: the head layout baked in, and the narrow slots never dequantized (the group
    scales weight the query and probability rows instead, as the one-pool decode branch does)."""
    return _place(b, compression, _attend_decode(b, compression, scale_attr, window_attr, heads), b.i64([1]))


def _pools(compression: Compression) -> tuple[Compression, Compression]:
    """(narrow, wide): each pool's storage as a one-pool setting."""
    return replace(compression, mixed="none"), replace(compression, dtype=compression.mixed, mixed="none")


def _wide_values(b: Body, wide: Compression) -> tuple[str, str]:
    scales = ("k_hi_scale", "v_hi_scale") if wide.quantized else (None, None)
    return _dequantize(b, "k_hi", scales[0], wide), _dequantize(b, "v_hi", scales[1], wide)


def _attend_general(b: Body, compression: Compression, scale_attr: str, window_attr: str, new: str) -> _Scored:
    policy = policies.get(compression.policy)
    narrow, wide = _pools(compression)
    kv_heads = b.shape("k", 1)
    heads = b.shape("q", 1)
    head_dim = b.shape("q", 3)
    hi = b.shape("pos_hi", 2)
    lo = b.shape("pos", 2)

    # the narrow pool's filled prefix (empty slots fill lowest first); the wide pool is small: all of it
    active = _active(b, b.op("GreaterOrEqual", "pos", b.i64(0)), lo)

    def narrow_slots(name: str | None) -> str | None:
        return None if name is None else b.op("Slice", name, b.i64([0]), active, b.i64([2]))

    quantized = ("k_scale", "v_scale") if narrow.quantized else (None, None)
    hi_k, hi_v = _wide_values(b, wide)
    lo_k = _dequantize(b, narrow_slots("k_cache"), narrow_slots(quantized[0]), narrow)
    lo_v = _dequantize(b, narrow_slots("v_cache"), narrow_slots(quantized[1]), narrow)

    # 1. attention over [wide; narrow filled prefix; new]
    bht = b.op("Concat", b.op("Shape", "k", end=2), new, axis=0)
    new_pos = b.op("Expand", b.op("Unsqueeze", "position_ids", b.i64([1])), bht)  # [B,Hkv,T]
    old_pos = b.op("Concat", "pos_hi", "pos", axis=2)  # a copy: later reads of positions read it
    key_pos = b.op("Concat", old_pos, new_pos, axis=2)  # [B,Hkv,hi+lo+T]
    attended = b.op("Add", hi, active)
    attended_pos = b.op("Concat", "pos_hi", narrow_slots("pos"), new_pos, axis=2)
    rows_shape = b.op("Concat", b.i64([0]), kv_heads, b.i64([-1]), head_dim, axis=0)
    group_size = b.op("Div", heads, kv_heads)
    old_k = b.op("Concat", hi_k, lo_k, axis=2)
    old_v = b.op("Concat", hi_v, lo_v, axis=2)
    attend = _Attend(old_k, old_v, attended_pos, rows_shape, group_size, scale_attr, window_attr)
    probs = attend.probs(b, "q", "position_ids", new)
    out = attend.output(b, probs, attended)

    # 2. scores of every candidate [wide; narrow; new] (the narrow slots past `active` received nothing)
    stats = {}
    if policy.needs:
        shape = b.op("Concat", b.i64([0]), kv_heads, group_size, new, b.i64([-1]), axis=0)
        per_query = b.op("Reshape", probs, shape)
    if "total" in policy.needs:
        stats["total"] = b.op("ReduceSum", per_query, b.i64([2, 3]), keepdims=0)
    if "observed" in policy.needs:
        observed = b.op("Slice", per_query, b.i64([-compression.observe]), b.i64([HUGE]), b.i64([3]))
        stats["observed"] = b.op("ReduceSum", observed, b.i64([2, 3]), keepdims=0)
    if "last" in policy.needs:
        last = b.op("Slice", per_query, b.i64([-1]), b.i64([HUGE]), b.i64([3]))
        stats["last"] = b.op("ReduceMean", last, b.i64([2, 3]), keepdims=0)
    stats = _per_candidate(b, stats, attended, lo, active)
    old_score = b.op("Concat", "score_hi", "score", axis=2)
    updated = policy.update_onnx(b, old_score, stats, key_pos, new)
    # `observe` false (a prompt chunk whose scores the next one replaces); the probabilities are there for the
    # output anyway: a choice, not a saving
    updated = b.op("Where", _observing(b, new), updated, _unobserved(b, old_score, new))
    return _Scored(out, key_pos, new_pos, bht, old_pos, old_score, updated, hi_k, hi_v)


def _per_candidate(b: Body, stats: dict[str, str], attended: str, lo: str, active: str) -> dict[str, str]:
    """Statistics over [wide; narrow active; new] → over every candidate [wide; narrow; new] (zeros between)."""
    gap = b.op("Concat", b.i64([0, 0, 0, 0, 0]), b.op("Sub", lo, active), axis=0)
    result = {}
    for name, stat in stats.items():
        old_part = b.op("Pad", _slice(b, stat, [0], attended), gap, b.f32(0.0))
        result[name] = b.op("Concat", old_part, _slice(b, stat, attended, [HUGE]), axis=-1)
    return result


def _attend_decode(b: Body, compression: Compression, scale_attr: str, window_attr: str, heads: Heads) -> _Scored:
    policy = policies.get(compression.policy)
    narrow, wide = _pools(compression)
    per_kv = heads.query // heads.kv
    hi = b.shape("pos_hi", 2)
    lo = b.shape("pos", 2)
    # at least one narrow slot, so no tensor is empty (an empty slot is masked like any other)
    active = b.op("Max", _active(b, b.op("GreaterOrEqual", "pos", b.i64(0)), lo), b.i64([1]))

    def narrow_slots(name: str) -> str:
        return b.op("Slice", name, b.i64([0]), active, b.i64([2]))

    queries = b.op("Reshape", "q", b.i64([0, heads.kv, per_kv, heads.dim]))  # [B,Hkv,G,D]
    transpose = {"perm": [0, 1, 3, 2]}
    hi_k, hi_v = _wide_values(b, wide)
    scores_hi = b.op("MatMul", queries, b.op("Transpose", hi_k, **transpose))  # [B,Hkv,G,hi]
    raw_k = _raw_values(b, narrow_slots("k_cache"), narrow, heads.dim)
    raw_v = _raw_values(b, narrow_slots("v_cache"), narrow, heads.dim)
    if narrow.quantized:
        k_scale = b.op("Transpose", narrow_slots("k_scale"), **transpose)  # [B,Hkv,D/G,A]
        v_scale = b.op("Transpose", narrow_slots("v_scale"), **transpose)
        group_mask = _group_mask(b, heads, narrow.group)
        scores_lo = _scaled_scores(b, queries, raw_k, k_scale, group_mask, heads, narrow.group)
    else:
        scores_lo = b.op("MatMul", queries, b.op("Transpose", raw_k, **transpose))
    scores_new = b.op("MatMul", queries, b.op("Transpose", "k", **transpose))  # [B,Hkv,G,1]
    # every filled slot is in the past of the one query; a sliding window still bounds it from below
    position = b.op("Unsqueeze", "position_ids", b.i64([1]))  # [B,1,1]
    has_window = b.op("Greater", window_attr, b.i64(0))
    span = b.op("Where", has_window, window_attr, b.i64(HUGE))
    lowest = b.op("Max", b.op("Sub", position, b.op("Sub", span, b.i64(1))), b.i64(0))
    attended_pos = b.op("Concat", "pos_hi", narrow_slots("pos"), axis=2)
    hidden = b.op("Where", b.op("GreaterOrEqual", attended_pos, lowest), b.f32(0.0), b.f32(float("-inf")))
    scores_old = b.op("Add", b.op("Concat", scores_hi, scores_lo, axis=-1), b.op("Unsqueeze", hidden, b.i64([2])))
    probs = b.op("Softmax", b.op("Mul", b.op("Concat", scores_old, scores_new, axis=-1), scale_attr), axis=-1)
    attended = b.op("Add", hi, active)
    probs_lo = _slice(b, probs, hi, attended)
    if narrow.quantized:
        context_lo = _scaled_context(b, probs_lo, raw_v, v_scale, group_mask, heads, narrow.group)
    else:
        context_lo = b.op("MatMul", probs_lo, raw_v)
    context = b.op("Add", b.op("MatMul", _slice(b, probs, [0], hi), hi_v), context_lo)
    context = b.op("Add", context, b.op("Mul", _slice(b, probs, attended, [HUGE]), "v"))  # [B,Hkv,G,D]
    out = b.op("Reshape", context, b.i64([0, 1, heads.query, heads.dim]))  # [B,1,H,D]

    stats = {}
    if policy.needs:
        total = b.op("ReduceSum", probs, b.i64([2]), keepdims=0)  # [B,Hkv,attended+1]
        stats = {"total": total, "observed": total}  # one query: it is the whole observation window
        if "last" in policy.needs:
            stats["last"] = b.op("Div", total, b.f32(float(per_kv)))
        stats = _per_candidate(b, stats, attended, lo, active)
    new_pos = b.op("Expand", position, b.i64([1, heads.kv, 1]))  # [B,Hkv,1]
    old_pos = b.op("Concat", "pos_hi", "pos", axis=2)
    key_pos = b.op("Concat", old_pos, new_pos, axis=2)
    old_score = b.op("Concat", "score_hi", "score", axis=2)
    updated = policy.update_onnx(b, old_score, stats, key_pos, None)
    bht = b.op("Concat", b.op("Shape", "k", end=2), b.i64([1]), axis=0)
    return _Scored(out, key_pos, new_pos, bht, old_pos, old_score, updated, hi_k, hi_v)


def _place(b: Body, compression: Compression, scored: _Scored, new: str) -> dict[str, str]:
    """Steps 3-5 for any T (``new``: [1] int64): keep-scores, the wide pool's pairing, the demotion into the
    narrow pool, pruning; every state output."""
    policy = policies.get(compression.policy)
    narrow, wide = _pools(compression)
    out, key_pos, new_pos, bht, old_pos = scored.out, scored.key_pos, scored.new_pos, scored.bht, scored.old_pos
    hi_k, hi_v = scored.hi_k, scored.hi_v
    hi = b.shape("pos_hi", 2)
    lo = b.shape("pos", 2)
    slots = b.op("Add", hi, lo)
    inf = b.f32(float("inf"))
    old_score = scored.old_score
    old_protected = b.op("And", b.op("IsInf", old_score, detect_negative=0), b.op("GreaterOrEqual", old_pos, b.i64(0)))
    protected = b.op("Concat", old_protected, b.op("Expand", b.op("Unsqueeze", "protect", b.i64([1])), bht), axis=2)
    score_all = b.op("Where", protected, inf, scored.updated)

    # 3. keep-scores
    newest = b.op("Unsqueeze", b.op("ReduceMax", "position_ids", b.i64([1]), keepdims=1), b.i64([2]))  # [B,1,1]
    empty = b.op("Less", key_pos, b.i64(0))
    forced = _forced(b, key_pos, newest, protected, narrow)
    keep = b.op("Where", empty, b.f32(float("-inf")), b.op("Where", forced, inf, score_all))

    # 4a. the wide pool keeps its strongest by the wide key: sinks and protected, then the newest
    first = b.op("Or", protected, b.op("Less", key_pos, b.i64(compression.sink)))
    wide_key = b.op(
        "Where", empty, b.f32(float("-inf")), b.op("Where", first, inf, b.op("Cast", key_pos, to=TensorProto.FLOAT))
    )
    pairs = b.op("Min", new, hi)
    weak_values, weakest = b.op("TopK", _slice(b, wide_key, [0], hi), pairs, axis=-1, largest=0, sorted=1, outputs=2)
    new_key = _slice(b, wide_key, slots, [HUGE])
    _, order = b.op("TopK", new_key, new, axis=-1, largest=1, sorted=1, outputs=2)  # every new token
    strongest = _slice(b, order, [0], pairs)
    admitted = b.op("Greater", b.op("GatherElements", new_key, strongest, axis=2), weak_values)  # [B,Hkv,n]

    # the displaced: per pair the loser, then the new tokens without a pair
    unpaired = b.op("Concat", b.op("Shape", "k", end=2), b.op("Sub", new, pairs), axis=0)
    from_slot = b.op("Concat", admitted, b.op("Expand", b.boolean(False), unpaired), axis=2)  # [B,Hkv,T]
    slot = b.op("Concat", weakest, b.op("Expand", b.i64(0), unpaired), axis=2)

    def displaced(old: str, arriving: str) -> str:
        if old in (hi_k, hi_v):
            return b.op(
                "Where", b.op("Unsqueeze", from_slot, b.i64([-1])), _rows(b, old, slot), _rows(b, arriving, order)
            )
        picked = (b.op("GatherElements", value, index, axis=2) for value, index in ((old, slot), (arriving, order)))
        return b.op("Where", from_slot, *picked)

    out_k, out_v = displaced(hi_k, "k"), displaced(hi_v, "v")
    out_pos = displaced(_slice(b, key_pos, [0], hi), new_pos)
    out_score = displaced(_slice(b, score_all, [0], hi), _slice(b, score_all, slots, [HUGE]))
    out_keep = displaced(_slice(b, keep, [0], hi), _slice(b, keep, slots, [HUGE]))

    # every scatter waits for the reads of the state it overwrites (see the module's docstring)
    after_reads = _not_nan(b, out, out_k, out_v)
    k_wide, k_wide_scale = _quantize(b, "k", wide)
    v_wide, v_wide_scale = _quantize(b, "v", wide)
    arriving = {"k_hi": k_wide, "v_hi": v_wide, "k_hi_scale": k_wide_scale, "v_hi_scale": v_wide_scale}
    arriving |= {"pos_hi": new_pos, "score_hi": _slice(b, score_all, slots, [HUGE])}
    current = {"score_hi": _slice(b, score_all, [0], hi)}
    weakest_after = b.op("Max", weakest, after_reads)
    written = {}
    for name in compressed_state(compression):
        if "_hi" in name:
            trailing = name not in ("score_hi", "pos_hi")
            written[name] = _write(
                b, current.get(name, name), arriving[name], weakest_after, strongest, admitted, trailing
            )

    # 4b. the displaced compete for the narrow pool as new tokens do (re-paired in index order)
    keep_lo = _slice(b, keep, hi, slots)
    count = b.op("Min", new, lo)
    weak_lo, weakest_lo = b.op("TopK", keep_lo, count, axis=-1, largest=0, sorted=1, outputs=2)
    strong_lo, strongest_lo = b.op("TopK", out_keep, count, axis=-1, largest=1, sorted=1, outputs=2)
    placed = b.op("Greater", strong_lo, weak_lo)
    tail = b.op("Add", b.op("Range", b.i64(0), b.op("Squeeze", count), b.i64(1)), b.i64(HUGE))
    weakest_lo = _index_order(b, weakest_lo, placed, tail, count)
    strongest_lo = _index_order(b, strongest_lo, placed, tail, count)
    k_stored, k_scale = _quantize(b, out_k, narrow)
    v_stored, v_scale = _quantize(b, out_v, narrow)
    arriving = {"k_cache": k_stored, "v_cache": v_stored, "k_scale": k_scale, "v_scale": v_scale}
    arriving |= {"pos": out_pos, "score": out_score}
    current = {"score": _slice(b, score_all, hi, slots)}
    weakest_lo_after = b.op("Max", weakest_lo, after_reads)
    for name in compressed_state(compression):
        if "_hi" not in name:
            formal = FORMAL.get(name, name)
            trailing = name not in ("score", "pos")
            old = current.get(formal, formal)
            written[formal] = _write(b, old, arriving[formal], weakest_lo_after, strongest_lo, placed, trailing)

    # 5. pruning (adaptive), the narrow pool, on heads that dropped a token they held
    if policy.prunes:
        old_lo_pos = _slice(b, key_pos, hi, slots)  # the copy, not the state the scatter overwrites
        overwritten = b.op(
            "And", placed, b.op("GreaterOrEqual", b.op("GatherElements", old_lo_pos, weakest_lo, axis=2), b.i64(0))
        )
        zeros = b.op("Expand", b.boolean(False), bht)
        was_placed = b.op("ScatterElements", zeros, strongest_lo, placed, axis=2)
        dropped = b.op(
            "And", b.op("And", from_slot, b.op("GreaterOrEqual", out_pos, b.i64(0))), b.op("Not", was_placed)
        )
        held = b.op(
            "Or",
            b.op("Cast", _any(b, overwritten), to=TensorProto.BOOL),
            b.op("Cast", _any(b, dropped), to=TensorProto.BOOL),
        )
        pos, score = written["pos"], written["score"]
        evictable = b.op(
            "And",
            b.op(
                "And",
                b.op("GreaterOrEqual", pos, b.i64(0)),
                b.op("Not", _forced(b, pos, newest, b.op("IsInf", score, detect_negative=0), narrow)),
            ),
            held,
        )
        written["pos"] = b.op("Where", policy.prune_onnx(b, score, evictable), b.i64(-1), pos)
    return {"out": out} | {f"{name}_out": value for name, value in written.items()}


def _any(b: Body, flags: str) -> str:
    """[B,Hkv,n] bool → [B,Hkv,1] int32: 1 where any is set."""
    return b.op("ReduceMax", b.op("Cast", flags, to=TensorProto.INT32), b.i64([-1]), keepdims=1)


def output_type(compression: Compression, name: str) -> int:
    """The ONNX element type of an output (``k_cache_out``, …, ``pos_hi_out``)."""
    storage = {"k_cache_out": compression.dtype, "v_cache_out": compression.dtype}
    storage |= {"k_hi_out": compression.mixed, "v_hi_out": compression.mixed}
    if name in storage:
        return STORAGE_TYPES[storage[name]]
    return TensorProto.INT64 if name.startswith("pos") else TensorProto.FLOAT
