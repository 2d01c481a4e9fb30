"""The meaning of ``ai.edgec::KVAttention`` in numpy. Every other implementation is tested against this.

State per layer (batch B, KV heads Hkv, capacity C, head dim D):
  k, v: [B, Hkv, C, D]   keys (after RoPE) and values, one token per slot
  pos:  [B, Hkv, C]      absolute position of the token in each slot, -1 = empty

One call with T new tokens at explicit positions:
  1. choose a slot per token: ``position mod C`` (no eviction yet: with C ≥ context this is the position;
     for a sliding-window layer with C = window it reuses slots in order, which is exact);
  2. scatter the new k, v and positions into their slots;
  3. attend from each query over the updated slots, masking empty slots, future positions and, for a
     sliding-window layer, positions at or before ``q_pos - window``.
"""

from __future__ import annotations

import numpy as np


def choose_slots(position_ids: np.ndarray, capacity: int) -> np.ndarray:
    """Slot of each new token, [B, T]."""
    return np.mod(position_ids, capacity)


def kv_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    position_ids: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    pos_cache: np.ndarray,
    scale: float,
    window: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q [B,H,T,D], k/v [B,Hkv,T,D], position_ids [B,T] → (out [B,T,H,D], k_cache', v_cache', pos_cache')."""
    batch, num_heads, seq, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    k_cache, v_cache, pos_cache = k_cache.copy(), v_cache.copy(), pos_cache.copy()
    slots = choose_slots(position_ids, capacity)
    for b in range(batch):
        for t in range(seq):
            k_cache[b, :, slots[b, t]] = k[b, :, t]
            v_cache[b, :, slots[b, t]] = v[b, :, t]
            pos_cache[b, :, slots[b, t]] = position_ids[b, t]

    group = num_heads // num_kv_heads
    out = np.zeros((batch, seq, num_heads, head_dim), dtype=q.dtype)
    for b in range(batch):
        for h in range(num_heads):
            kv_head = h // group
            scores = (q[b, h] @ k_cache[b, kv_head].T).astype(np.float64) * scale  # [T, C]
            key_pos = pos_cache[b, kv_head][None, :]
            query_pos = position_ids[b][:, None]
            valid = (key_pos >= 0) & (key_pos <= query_pos)
            if window > 0:
                valid &= key_pos > query_pos - window
            scores = np.where(valid, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[b, :, h] = (probs @ v_cache[b, kv_head].astype(np.float64)).astype(q.dtype)
    return out, k_cache, v_cache, pos_cache


# --- the compressed cache -----------------------------------------------------------------------------------
# State per layer: k, v in the storage dtype ([B,Hkv,C,D], int4 packed [B,Hkv,C,D/2]); k_scale, v_scale
# [B,Hkv,C,D/G] (quantized dtypes only); score [B,Hkv,C] float32 (+inf = protected); pos [B,Hkv,C] (-1 = empty).
#
# One call with T ≤ C new tokens:
#   1. attend from each query over the dequantized slots plus the call's own new tokens (full precision),
#      masking empty slots, future positions and (sliding window) positions at or before q_pos - window;
#   2. score every candidate (C slots + T new tokens) with the policy, from this call's attention;
#   3. keep-score = +inf for sinks (pos < sink), the recent window (pos > newest - window) and protected
#      tokens, -inf for empty slots, else the score;
#   4. pair the T weakest slots (ascending keep-score) with the T strongest new tokens (descending): the i-th
#      new token replaces the i-th slot iff its keep-score is strictly higher (a prefix of the pairs, which is
#      then re-paired in index order on both sides). This keeps exactly the C best of
#      the C + T candidates, and every write lands in a distinct slot (a kept slot is written back unchanged),
#      so the op updates its state in place with one ScatterElements per tensor;
#   5. a pruning policy (adaptive) then empties every evictable slot below its threshold, on heads that had
#      to evict in this call.
# With ``rotation`` on, all of this runs on q, k, v rotated per head (rotation.py), and the output is rotated back.
# Ties go to the lower index (ONNX TopK's rule): empty slots fill from slot 0 in order, so with C ≥ context
# slot == position and the result equals the uncompressed cache exactly.


def empty_compressed_state(num_kv_heads: int, capacity: int, head_dim: int, compression) -> dict[str, np.ndarray]:
    """A fresh compressed layer's state, as every backend allocates it (``CacheSpec``) — the slots alone: a
    kernel's spare rows (``Compression.spare_rows``) are the graph's layout, not the meaning."""
    from dataclasses import replace

    from edgec.kvcache.spec import CacheSpec, LayerCache, compressed_state

    meaning = replace(compression, decode_kernel="none")
    layer = LayerCache(0, num_kv_heads, head_dim, capacity, compressed=True, state=compressed_state(meaning))
    return CacheSpec((layer,), compression=meaning).empty_layer(layer)


def _softmax(scores: np.ndarray) -> np.ndarray:
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    return probs / probs.sum(axis=-1, keepdims=True)


def forced(key_pos: np.ndarray, newest: np.ndarray, protected: np.ndarray, compression) -> np.ndarray:
    """Candidates that are never evicted: sinks, the recent window, protected. newest [B,1,1]."""
    filled = key_pos >= 0
    return protected | (filled & ((key_pos < compression.sink) | (key_pos > newest - compression.window)))


def compressed_kv_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    position_ids: np.ndarray,
    protect: np.ndarray,
    state: dict[str, np.ndarray],
    compression,
    scale: float,
    window: int = 0,
    observe: bool = True,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """q [B,H,T,D], k/v [B,Hkv,T,D], position_ids [B,T], protect [B,T] bool → (out [B,T,H,D], new state).
    With a rotation (rotation.py) the op is the same on rotated q, k, v, its output rotated back; with mixed
    precision (``compression.mixed``) the slots are two pools (``_mixed``).

    ``observe`` False (the op's ``observe`` input; read by calls of T > 1 only): the call's attention does not
    update the policy's scores — the slots keep theirs, the new tokens score 0 (+inf where protected). The
    runtime passes it for a prompt chunk whose scores the next chunk replaces (``prompt_overwrites``)."""
    if compression.rotation != "none":
        return _rotated(q, k, v, position_ids, protect, state, compression, scale, window, observe)
    if compression.mixed != "none":
        return _mixed(q, k, v, position_ids, protect, state, compression, scale, window, observe)
    from edgec.kvcache import policies
    from edgec.kvcache.quantize import dequantize, quantize

    policy = policies.get(compression.policy)
    batch, num_heads, new, head_dim = q.shape
    num_kv_heads, capacity = state["pos"].shape[1:]
    if new > capacity:
        raise ValueError(f"{new} new tokens do not fit {capacity} slots: feed at most capacity per call")
    dtype, group = compression.dtype, compression.group
    old_k = dequantize(state["k"], state.get("k_scale"), dtype, group)
    old_v = dequantize(state["v"], state.get("v_scale"), dtype, group)

    # 1-3. attention over slots + new tokens, every candidate's score and keep-score
    out, key_pos, score_all, protected, keep = _attend_and_score(
        q,
        k,
        v,
        position_ids,
        protect,
        old_k,
        old_v,
        state["pos"],
        state["score"],
        policy,
        compression,
        scale,
        window,
        observe,
    )
    newest = position_ids.max(axis=1)[:, None, None]

    # 4. pair the weakest slots with the strongest new tokens
    weakest, strongest, replace = _pair(keep[..., :capacity], keep[..., capacity:])
    k_stored, k_scale = quantize(k, dtype, group)
    v_stored, v_scale = quantize(v, dtype, group)
    incoming = {"k": k_stored, "v": v_stored, "k_scale": k_scale, "v_scale": v_scale}
    incoming |= {"score": score_all[..., capacity:], "pos": key_pos[..., capacity:]}
    current = dict(state) | {"score": score_all[..., :capacity]}
    result = {name: _write(current[name], incoming[name], weakest, strongest, replace) for name in state}

    # 5. pruning policies free more room on heads that had to evict
    if policy.prunes:
        evicted = (replace & (np.take_along_axis(state["pos"], weakest, -1) >= 0)).any(-1, keepdims=True)
        result["pos"] = _prune(policy, result, evicted, newest, compression)
    return out, result


def _attend_and_score(
    q, k, v, position_ids, protect, old_k, old_v, old_pos, old_score, policy, compression, scale, window, observe=True
):
    """Steps 1-3 over the slots (dequantized old_k/old_v, their positions and scores) and the new tokens →
    (out [B,T,H,D], key_pos, score_all, protected, keep), the last four [B,Hkv,slots+T]."""
    batch, num_heads, new, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    keys = np.concatenate([old_k, k], axis=2).astype(np.float64)
    values = np.concatenate([old_v, v], axis=2).astype(np.float64)
    new_pos = np.broadcast_to(position_ids[:, None, :], (batch, num_kv_heads, new))
    key_pos = np.concatenate([old_pos, new_pos], axis=2)  # [B,Hkv,L]
    q_grouped = q.reshape(batch, num_kv_heads, group_size, new, head_dim).astype(np.float64)
    scores = np.einsum("bhgtd,bhld->bhgtl", q_grouped, keys) * scale
    query_pos = position_ids[:, None, None, :, None]
    kp = key_pos[:, :, None, None, :]
    valid = (kp >= 0) & (kp <= query_pos)
    if window > 0:
        valid &= kp > query_pos - window
    probs = _softmax(np.where(valid, scores, -np.inf))
    out = np.einsum("bhgtl,bhld->bhgtd", probs, values).reshape(batch, num_heads, new, head_dim)
    out = out.transpose(0, 2, 1, 3).astype(q.dtype)

    # 2. scores
    rows = min(compression.observe, new)
    stats = {
        "total": probs.sum(axis=(2, 3)).astype(np.float32),
        "observed": probs[:, :, :, new - rows :].sum(axis=(2, 3)).astype(np.float32),
        "last": probs[:, :, :, -1].mean(axis=2).astype(np.float32),
    }
    if observe or new == 1:
        score_all = policy.update(old_score, stats, key_pos, new)
    else:  # not observed: the slots keep their scores, the new tokens start at zero
        score_all = np.concatenate([old_score, np.zeros(new_pos.shape, np.float32)], axis=-1)
    protected = np.concatenate(
        [np.isposinf(old_score) & (old_pos >= 0), np.broadcast_to(protect[:, None, :], new_pos.shape)], axis=2
    )
    score_all = np.where(protected, np.float32(np.inf), score_all).astype(np.float32)

    # 3. keep-scores
    slots = old_pos.shape[-1]
    newest = position_ids.max(axis=1)[:, None, None]
    keep = np.where(forced(key_pos, newest, protected, compression), np.float32(np.inf), score_all)
    keep[..., :slots] = np.where(old_pos < 0, -np.inf, keep[..., :slots])
    return out, key_pos, score_all, protected, keep


def _pair(keep_old: np.ndarray, keep_new: np.ndarray, index_order: bool = True):
    """Step 4's pairing: the n = min(T, slots) weakest slots (ascending keep) with the n strongest candidates
    (descending); the i-th replaces the i-th slot iff strictly stronger. Keeps the best ``slots`` of
    slots + T, every write in a distinct slot. → (weakest, strongest, replace), each [B,Hkv,n]."""
    count = min(keep_old.shape[-1], keep_new.shape[-1])
    weakest = np.argsort(keep_old, axis=-1, kind="stable")[..., :count]  # [B,Hkv,n]
    strongest = np.argsort(-keep_new, axis=-1, kind="stable")[..., :count]
    replace = np.take_along_axis(keep_new, strongest, -1) > np.take_along_axis(keep_old, weakest, -1)
    if index_order:
        # the replacing pairs form a prefix; within it, put both sides in index order so that a cache with room
        # fills slot after slot in position order (the pairing is the same set either way)
        tail = (1 << 40) + np.arange(count)
        weakest = np.take_along_axis(weakest, np.argsort(np.where(replace, weakest, tail), -1, kind="stable"), -1)
        strongest = np.take_along_axis(strongest, np.argsort(np.where(replace, strongest, tail), -1, kind="stable"), -1)
    return weakest, strongest, replace


def _rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """values [B,Hkv,N,...] at index [B,Hkv,n] along axis 2 (non-negative; ``index`` may broadcast over B or Hkv),
    as one gather over the flattened rows: ``take_along_axis`` builds index arrays of the output's whole shape —
    8x slower for 1,024 of 8,000 k/v rows."""
    batch, heads, count = values.shape[:3]
    flat = np.arange(batch * heads).reshape(batch, heads, 1) * count + index
    rows = values.reshape(batch * heads * count, *values.shape[3:])[flat.reshape(-1)]
    return rows.reshape(*flat.shape, *values.shape[3:])


def _write(old, arriving, weakest, strongest, replace):
    """Into the paired slots: the paired candidate where it replaces, else the slot's own value."""
    extra = old.ndim - 3  # trailing channel axes of k/v/scales
    index = weakest.reshape(weakest.shape + (1,) * extra)
    updates = np.where(replace.reshape(replace.shape + (1,) * extra), _rows(arriving, strongest), _rows(old, weakest))
    updated = old.copy()
    np.put_along_axis(updated, np.broadcast_to(index, updates.shape), updates, axis=2)
    return updated


def _prune(policy, result, evicted, newest, compression):
    """Step 5: empty every evictable slot the policy drops, on heads that ``evicted`` [B,Hkv,1] a token the
    cache held before the call."""
    slot_protected = np.isposinf(result["score"])
    evictable = (result["pos"] >= 0) & ~forced(result["pos"], newest, slot_protected, compression) & evicted
    return np.where(policy.prune(result["score"], evictable), -1, result["pos"])


# --- mixed precision: two slot pools ------------------------------------------------------------------------
# State: the narrow pool (k, v, k_scale, v_scale, score, pos: ``dtype``, e.g. int4) and the wide pool (k_hi, v_hi,
# k_hi_scale, v_hi_scale, score_hi, pos_hi: ``mixed``, int8 or fp16) of ``hi_slots`` = sink + window slots.
# One call with T new tokens (any T):
#   1-3. as above over the slots of both pools [wide; narrow] and the new tokens (one attention, one score each);
#   4a. the wide pool keeps the hi_slots strongest of its slots and the new tokens by the wide key: +inf for
#       sinks and protected tokens, else the position (the newest; an empty slot lowest). Paired as in step 4
#       (n = min(T, hi_slots) pairs, no index re-ordering). The T candidates that lose their pair, or have none
#       (the weakest new tokens of a chunk longer than the pool), are *displaced*: a wide slot's token leaves
#       the window, or a new token never enters it;
#   4b. the displaced candidates, re-quantized from their wide values (or quantized from the new k, v), compete
#       for the narrow pool exactly as new tokens do in step 4, by keep-score (a displaced token is no longer in
#       the recent window unless protected tokens crowd the wide pool: then it stays forced, only narrower);
#   5.  pruning (adaptive) on the narrow pool only: the wide one holds forced tokens only.
# With both dtypes fp32 this keeps the same tokens as one pool of hi_slots + narrow slots
# (tests/kvcache/test_mixed.py): the wide pool only ever holds candidates that step 3 forces anyway.
WIDE_KEY_FORCED = np.float32(np.inf)


def _mixed(q, k, v, position_ids, protect, state, compression, scale, window, observe=True):
    from dataclasses import replace

    from edgec.kvcache import policies
    from edgec.kvcache.quantize import dequantize, quantize

    policy = policies.get(compression.policy)
    new = q.shape[2]
    wide, narrow, group = compression.mixed, compression.dtype, compression.group
    hi, lo = state["pos_hi"].shape[-1], state["pos"].shape[-1]
    slots = hi + lo
    hi_k = dequantize(state["k_hi"], state.get("k_hi_scale"), wide, group)
    hi_v = dequantize(state["v_hi"], state.get("v_hi_scale"), wide, group)
    lo_k = dequantize(state["k"], state.get("k_scale"), narrow, group)
    lo_v = dequantize(state["v"], state.get("v_scale"), narrow, group)
    old_pos = np.concatenate([state["pos_hi"], state["pos"]], axis=2)
    old_score = np.concatenate([state["score_hi"], state["score"]], axis=2)
    out, key_pos, score_all, protected, keep = _attend_and_score(
        q,
        k,
        v,
        position_ids,
        protect,
        np.concatenate([hi_k, lo_k], axis=2),
        np.concatenate([hi_v, lo_v], axis=2),
        old_pos,
        old_score,
        policy,
        replace(compression, mixed="none"),
        scale,
        window,
        observe,
    )
    newest = position_ids.max(axis=1)[:, None, None]

    # 4a. the wide pool: sinks and protected, then the newest
    wide_key = np.where(
        key_pos < 0,
        -np.float32(np.inf),
        np.where(protected | (key_pos < compression.sink), WIDE_KEY_FORCED, key_pos.astype(np.float32)),
    ).astype(np.float32)
    pair_hi = min(new, hi)
    weakest, strongest, admitted = _pair(wide_key[..., :hi], wide_key[..., slots:], index_order=False)
    order = np.argsort(-wide_key[..., slots:], axis=-1, kind="stable")  # every new token, strongest first
    k_wide, k_wide_scale = quantize(k, wide, group)
    v_wide, v_wide_scale = quantize(v, wide, group)
    incoming = {"k_hi": k_wide, "v_hi": v_wide, "k_hi_scale": k_wide_scale, "v_hi_scale": v_wide_scale}
    incoming |= {"score_hi": score_all[..., slots:], "pos_hi": key_pos[..., slots:]}
    current = {name: state[name] for name in state} | {"score_hi": score_all[..., :hi]}
    result = {
        name: _write(current[name], incoming[name], weakest, strongest, admitted) for name in state if "_hi" in name
    }

    # the displaced: per pair, the loser (the slot's old token when admitted, else the new token); then the
    # new tokens that had no pair
    rest = new - pair_hi
    from_slot = np.concatenate([admitted, np.zeros(admitted.shape[:2] + (rest,), bool)], axis=-1)
    slot = np.concatenate([weakest, np.zeros(weakest.shape[:2] + (rest,), weakest.dtype)], axis=-1)

    def displaced(old: np.ndarray, arriving: np.ndarray) -> np.ndarray:
        choose = from_slot.reshape(from_slot.shape + (1,) * (old.ndim - 3))
        return np.where(choose, _rows(old, slot), _rows(arriving, order))

    out_k = displaced(hi_k, k.astype(np.float32))
    out_v = displaced(hi_v, v.astype(np.float32))
    out_pos = displaced(key_pos[..., :hi], key_pos[..., slots:])
    out_score = displaced(score_all[..., :hi], score_all[..., slots:])
    out_keep = displaced(keep[..., :hi], keep[..., slots:])

    # 4b. the displaced compete for the narrow pool as new tokens do
    weakest, strongest, replace_lo = _pair(keep[..., hi:slots], out_keep)
    k_stored, k_scale = quantize(out_k, narrow, group)
    v_stored, v_scale = quantize(out_v, narrow, group)
    incoming = {"k": k_stored, "v": v_stored, "k_scale": k_scale, "v_scale": v_scale, "score": out_score}
    incoming["pos"] = out_pos
    current = {name: state[name] for name in state} | {"score": score_all[..., hi:slots]}
    for name in state:
        if "_hi" not in name:
            result[name] = _write(current[name], incoming[name], weakest, strongest, replace_lo)

    # 5. pruning: the narrow pool, on heads that dropped a token they held: a narrow slot overwritten, or a
    # token displaced from the wide pool that found no narrow slot
    if policy.prunes:
        placed = np.zeros(out_keep.shape, bool)
        np.put_along_axis(placed, strongest, replace_lo, axis=-1)
        dropped = from_slot & (out_pos >= 0) & ~placed
        overwritten = replace_lo & (np.take_along_axis(state["pos"], weakest, -1) >= 0)
        evicted = overwritten.any(-1, keepdims=True) | dropped.any(-1, keepdims=True)
        result["pos"] = _prune(policy, result, evicted, newest, compression)
    return out, {name: result[name] for name in state}


def _rotated(q, k, v, position_ids, protect, state, compression, scale, window, observe=True):
    from dataclasses import replace

    from edgec.kvcache import rotation

    num_heads, head_dim = q.shape[1], q.shape[3]
    num_kv_heads = k.shape[1]
    matrix = rotation.hadamard(head_dim)
    kv_signs = rotation.signs(compression.rotation_seed, num_kv_heads, head_dim)
    q_signs = np.repeat(kv_signs, num_heads // num_kv_heads, axis=0)  # each query head takes its KV head's
    out, result = compressed_kv_attention(
        rotation.rotate(q, q_signs, matrix),
        rotation.rotate(k, kv_signs, matrix),
        rotation.rotate(v, kv_signs, matrix),
        position_ids,
        protect,
        state,
        replace(compression, rotation="none"),
        scale,
        window,
        observe,
    )
    return rotation.unrotate(out, q_signs, matrix).astype(q.dtype), result


def select_slots(
    state: dict[str, np.ndarray], compression, newest: int, capacity: int, pooled_from: int | None = None
) -> dict[str, np.ndarray]:
    """Compress a state to ``capacity`` slots per head at once (``prefill_compress = end``): keep the forced
    candidates and then the highest scores, in slot order (the numpy twin of step 4 for a whole prompt).
    A pooling policy (snapkv) pools the scores over neighbouring positions here, except for positions
    ≥ ``pooled_from``: the last call's new tokens, which the op pooled already. A mixed cache's ``capacity``
    counts both pools: its wide pool (sinks, window, protected) is kept whole, the narrow one selected."""
    from edgec.kvcache import policies

    if compression.mixed != "none":
        from dataclasses import replace

        narrow = {name: value for name, value in state.items() if "_hi" not in name}
        kept = select_slots(
            narrow, replace(compression, mixed="none"), newest, capacity - compression.hi_slots, pooled_from
        )
        return {name: kept[name] if name in kept else np.ascontiguousarray(value) for name, value in state.items()}

    protected = np.isposinf(state["score"]) & (state["pos"] >= 0)
    score = state["score"]
    policy = policies.get(compression.policy)
    if hasattr(policy, "pool"):
        already = state["pos"] >= (newest + 1 if pooled_from is None else pooled_from)
        order = np.argsort(np.where(state["pos"] < 0, np.iinfo(np.int64).max, state["pos"]), axis=-1, kind="stable")
        raw = np.where(protected | already, -np.inf, score)
        pooled = policy.pool(np.take_along_axis(raw, order, -1))
        unsorted = np.empty_like(pooled)
        np.put_along_axis(unsorted, order, pooled, -1)
        score = np.where(already | protected, score, unsorted)
    keep = np.where(forced(state["pos"], np.full((1, 1, 1), newest), protected, compression), np.float32(np.inf), score)
    keep = np.where(state["pos"] < 0, -np.inf, keep)
    if state["pos"].shape[-1] <= capacity:
        chosen = np.broadcast_to(np.arange(state["pos"].shape[-1]), state["pos"].shape)
    else:
        chosen = np.sort(np.argsort(-keep, axis=-1, kind="stable")[..., :capacity], axis=-1)
    return {name: _rows(value, chosen) for name, value in state.items()}  # a gather: new, contiguous arrays
