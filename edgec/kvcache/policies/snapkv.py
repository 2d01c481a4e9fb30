"""SnapKV: a prompt is judged by the attention of its last ``observe`` queries (the question sits at the end),
pooled over neighbouring new tokens so that a kept token keeps its context; decode steps accumulate as H2O.

Pooling runs over the call's new tokens only: they are contiguous in position, the cached slots are not."""

from __future__ import annotations

import numpy as np

from edgec.kvcache.policies.base import accumulate, accumulate_onnx

name = "snapkv"
needs = ("total", "observed")
prompt_needs = ("observed",)  # a prompt chunk is judged by its last queries only
prompt_overwrites = True  # a prompt chunk's scores replace the old ones
prunes = False
DECAY = 0.99
POOL = 7  # SnapKV's max-pool kernel


def pool(x: np.ndarray) -> np.ndarray:
    """Max over each token's neighbours (``POOL`` wide) along the last axis."""
    half = POOL // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=-np.inf)
    # POOL - 1 whole-array maxima: a max over a sliding-window view was 24x slower (1 ms a layer of an 8K prompt)
    length = x.shape[-1]
    pooled = padded[..., :length].copy()
    for offset in range(1, POOL):
        np.maximum(pooled, padded[..., offset : offset + length], out=pooled)
    return pooled


def update(score, stats, key_pos, new):
    if new == 1:
        return accumulate(score, stats["total"], DECAY)
    observed = stats["observed"]
    capacity = score.shape[-1]
    return np.concatenate([observed[..., :capacity], pool(observed[..., capacity:])], axis=-1).astype(np.float32)


def update_onnx(body, score, stats, key_pos, new) -> str:
    """Without ``total`` in ``stats`` the caller guarantees T > 1 (a prompt chunk): no decode half."""
    decode = accumulate_onnx(body, score, stats["total"], DECAY, new) if "total" in stats else None
    if new is None:  # the decode branch: one token, no prompt to observe
        return decode
    observed = stats["observed"]
    capacity = body.shape(score, -1)
    old_part = body.op("Slice", observed, body.i64([0]), capacity, body.i64([-1]))
    new_part = body.op("Slice", observed, capacity, body.i64([1 << 40]), body.i64([-1]))
    # MaxPool wants [N, channels, length]: fold B·Hkv into N
    folded_shape = body.op("Concat", body.i64([-1, 1]), body.shape(new_part, -1), axis=0)
    folded = body.op("Reshape", new_part, folded_shape)
    pooled = body.op("MaxPool", folded, kernel_shape=[POOL], pads=[POOL // 2, POOL // 2], strides=[1])
    pooled_back = body.op("Reshape", pooled, body.op("Shape", new_part))
    prefill = body.op("Concat", old_part, pooled_back, axis=-1)
    if decode is None:
        return prefill
    is_decode = body.op("Equal", new, body.i64(1))
    return body.op("Where", is_decode, decode, prefill)
