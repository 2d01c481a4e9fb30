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
