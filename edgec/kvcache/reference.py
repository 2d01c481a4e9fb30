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
    """A fresh compressed layer's state, as every backend allocates it (``CacheSpec``)."""
    from edgec.kvcache.spec import CacheSpec, LayerCache, compressed_state

    layer = LayerCache(0, num_kv_heads, head_dim, capacity, compressed=True, state=compressed_state(compression))
    return CacheSpec((layer,), compression=compression).empty_layer(layer)


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
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """q [B,H,T,D], k/v [B,Hkv,T,D], position_ids [B,T], protect [B,T] bool → (out [B,T,H,D], new state).
    With a rotation (rotation.py) the op is the same on rotated q, k, v, its output rotated back."""
    if compression.rotation != "none":
        return _rotated(q, k, v, position_ids, protect, state, compression, scale, window)
    from edgec.kvcache import policies
    from edgec.kvcache.quantize import dequantize, quantize

    policy = policies.get(compression.policy)
    batch, num_heads, new, head_dim = q.shape
    num_kv_heads, capacity = state["pos"].shape[1:]
    if new > capacity:
        raise ValueError(f"{new} new tokens do not fit {capacity} slots: feed at most capacity per call")
    group_size = num_heads // num_kv_heads
    dtype, group = compression.dtype, compression.group
    old_k = dequantize(state["k"], state.get("k_scale"), dtype, group)
    old_v = dequantize(state["v"], state.get("v_scale"), dtype, group)

    # 1. attention over slots + new tokens
    keys = np.concatenate([old_k, k], axis=2).astype(np.float64)
    values = np.concatenate([old_v, v], axis=2).astype(np.float64)
    new_pos = np.broadcast_to(position_ids[:, None, :], (batch, num_kv_heads, new))
    key_pos = np.concatenate([state["pos"], new_pos], axis=2)  # [B,Hkv,L]
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
    observe = min(compression.observe, new)
    stats = {
        "total": probs.sum(axis=(2, 3)).astype(np.float32),
        "observed": probs[:, :, :, new - observe :].sum(axis=(2, 3)).astype(np.float32),
        "last": probs[:, :, :, -1].mean(axis=2).astype(np.float32),
    }
    score_all = policy.update(state["score"], stats, key_pos, new)
    protected = np.concatenate(
        [np.isposinf(state["score"]) & (state["pos"] >= 0), np.broadcast_to(protect[:, None, :], new_pos.shape)],
        axis=2,
    )
    score_all = np.where(protected, np.float32(np.inf), score_all).astype(np.float32)

    # 3. keep-scores
    newest = position_ids.max(axis=1)[:, None, None]
    keep = np.where(forced(key_pos, newest, protected, compression), np.float32(np.inf), score_all)
    keep[..., :capacity] = np.where(state["pos"] < 0, -np.inf, keep[..., :capacity])

    # 4. pair the weakest slots with the strongest new tokens
    weakest = np.argsort(keep[..., :capacity], axis=-1, kind="stable")[..., :new]  # [B,Hkv,T]
    strongest = np.argsort(-keep[..., capacity:], axis=-1, kind="stable")[..., :new]
    replace = np.take_along_axis(keep[..., capacity:], strongest, -1) > np.take_along_axis(
        keep[..., :capacity], weakest, -1
    )
    # the replacing pairs form a prefix; within it, put both sides in index order so that a cache with room
    # fills slot after slot in position order (the pairing is the same set either way)
    tail = (1 << 40) + np.arange(new)
    weakest = np.take_along_axis(weakest, np.argsort(np.where(replace, weakest, tail), -1, kind="stable"), -1)
    strongest = np.take_along_axis(strongest, np.argsort(np.where(replace, strongest, tail), -1, kind="stable"), -1)
    k_stored, k_scale = quantize(k, dtype, group)
    v_stored, v_scale = quantize(v, dtype, group)
    incoming = {"k": k_stored, "v": v_stored, "k_scale": k_scale, "v_scale": v_scale}
    result = {}
    for name in state:
        old = state[name] if name != "score" else score_all[..., :capacity]
        if name == "score":
            arriving = score_all[..., capacity:]
        elif name == "pos":
            arriving = new_pos
        else:
            arriving = incoming[name]
        extra = old.ndim - 3  # trailing channel axes of k/v/scales
        index = weakest.reshape(weakest.shape + (1,) * extra)
        chosen = np.take_along_axis(arriving, strongest.reshape(strongest.shape + (1,) * extra), axis=2)
        kept = np.take_along_axis(old, index, axis=2)
        updates = np.where(replace.reshape(replace.shape + (1,) * extra), chosen, kept)
        updated = old.copy()
        np.put_along_axis(updated, np.broadcast_to(index, updates.shape), updates, axis=2)
        result[name] = updated

    # 5. pruning policies free more room on heads that had to evict
    if policy.prunes:
        evicted = (replace & (np.take_along_axis(state["pos"], weakest, -1) >= 0)).any(-1, keepdims=True)
        slot_protected = np.isposinf(result["score"])
        evictable = (result["pos"] >= 0) & ~forced(result["pos"], newest, slot_protected, compression) & evicted
        result["pos"] = np.where(policy.prune(result["score"], evictable), -1, result["pos"])
    return out, result


def _rotated(q, k, v, position_ids, protect, state, compression, scale, window):
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
    )
    return rotation.unrotate(out, q_signs, matrix).astype(q.dtype), result


def select_slots(
    state: dict[str, np.ndarray], compression, newest: int, capacity: int, pooled_from: int | None = None
) -> dict[str, np.ndarray]:
    """Compress a state to ``capacity`` slots per head at once (``prefill_compress = end``): keep the forced
    candidates and then the highest scores, in slot order (the numpy twin of step 4 for a whole prompt).
    A pooling policy (snapkv) pools the scores over neighbouring positions here, except for positions
    ≥ ``pooled_from``: the last call's new tokens, which the op pooled already."""
    from edgec.kvcache import policies

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
    result = {}
    for name, value in state.items():
        extra = value.ndim - 3
        result[name] = np.ascontiguousarray(
            np.take_along_axis(value, chosen.reshape(chosen.shape + (1,) * extra), axis=2)
        )
    return result
