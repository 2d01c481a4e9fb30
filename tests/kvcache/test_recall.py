"""The hierarchical cache's numpy half (edgec/kvcache/recall.py): block summaries and scores, the choice of
tokens to recall, the host tier's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import dequantize, quantize
from edgec.kvcache.recall import HostTier, block_scores, choose

RNG = np.random.default_rng(7)


def _tier(dtype: str, heads: int = 2, dim: int = 32, block: int = 8) -> HostTier:
    compression = Compression(capacity=64, window=8, dtype=dtype, group=16, recall=2, recall_block=block)
    stored_dim = dim // 2 if dtype == "int4" else dim
    numpy_dtype = {"fp32": np.float32, "int8": np.int8, "int4": np.uint8}[dtype]
    stored = {"k": ((stored_dim,), numpy_dtype), "v": ((stored_dim,), numpy_dtype)}
    if dtype != "fp32":
        stored |= {"k_scale": ((dim // 16,), np.float32), "v_scale": ((dim // 16,), np.float32)}
    return HostTier(heads, dim, compression, stored)


def _fill(tier: HostTier, keys: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """Add keys [H, n, D] (values: the keys too) at ``positions`` [n] on every head; returns the stored bytes."""
    dtype, group = tier.compression.dtype, tier.compression.group
    k, k_scale = quantize(keys, dtype, group)
    stored = {"k": k, "v": k} | ({"k_scale": k_scale, "v_scale": k_scale} if k_scale is not None else {})
    heads = np.repeat(np.arange(keys.shape[0]), len(positions))
    flat_positions = np.tile(positions, keys.shape[0])
    tier.add(heads, flat_positions, {name: a.reshape(-1, *a.shape[2:]) for name, a in stored.items()}, False)
    return stored


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_summaries_are_the_blocks_mean_key_and_score_against_the_query(dtype):
    tier = _tier(dtype)
    keys = RNG.normal(size=(2, 50, 32)).astype(np.float32)
    order = RNG.permutation(50)  # added out of order, in two calls
    _fill(tier, keys[:, order[:30]], order[:30])
    _fill(tier, keys[:, order[30:]], order[30:])
    scale = tier.arrays["k_scale"][:, :50] if dtype != "fp32" else None
    seen = dequantize(tier.arrays["k"][:, :50], scale, dtype, 16)  # what the op attends with
    blocks = -(-50 // 8)
    for b in range(blocks):
        np.testing.assert_allclose(
            tier.mean[:, b], seen[:, b * 8 : min(50, b * 8 + 8)].mean(axis=1), rtol=1e-5, atol=1e-6
        )
    query = RNG.normal(size=(4, 32)).astype(np.float32)  # 2 query heads per KV head
    score = block_scores(query, tier.mean[:, :blocks])
    want = np.einsum("hgd,hbd->hgb", query.reshape(2, 2, 32), tier.mean[:, :blocks]).max(axis=1)
    np.testing.assert_allclose(score, want, rtol=1e-5, atol=1e-5)


def test_the_block_holding_the_matching_key_is_recalled():
    tier = _tier("int8", heads=2)
    keys = RNG.normal(scale=0.3, size=(2, 160, 32)).astype(np.float32)
    direction = RNG.normal(size=32).astype(np.float32)
    direction /= np.linalg.norm(direction)
    keys[0, 93] += 4 * direction  # head 0's key at position 93 (block 11); head 1 has it at 21 (block 2)
    keys[1, 21] += 4 * direction
    _fill(tier, keys, np.arange(160))
    query = np.repeat(direction[None], 4, axis=0) * 3
    resident = np.tile(np.arange(0, 8), (2, 1))  # the first block sits in the op's slots
    chosen = tier.recall(query, resident, newest=159, slots=16)
    # recent window (pos > 159 - 8) first: they are forced; then the matching block
    assert set(range(152, 160)) <= set(chosen[0]) and set(range(152, 160)) <= set(chosen[1])
    assert set(range(88, 96)) <= set(chosen[0]), chosen[0]
    assert set(range(16, 24)) <= set(chosen[1]), chosen[1]
    other = tier.recall(-query, resident, newest=159, slots=16)  # the opposite query does not pick it
    assert 93 not in other[0] and 21 not in other[1]


def test_choose_skips_resident_tokens_puts_forced_first_and_pads():
    score = np.array([[5.0, 9.0, 1.0]])  # blocks of 4: order 1, 0, 2
    candidate = np.ones((1, 10), bool)
    candidate[0, [4, 5]] = False  # in the op's slots
    forced = np.zeros((1, 10), bool)
    forced[0, 9] = True  # e.g. a recent token in the reserved slots: kept before any block
    chosen = choose(score, candidate, forced, block=4, slots=5)
    # the forced token, then the rest of its block (2), then block 1 (less 4, 5), then block 0
    assert chosen.tolist() == [[9, 8, 6, 7, 0]]
    few = choose(score, candidate, np.zeros_like(forced), block=4, slots=12)
    assert sorted(few[0][few[0] >= 0].tolist()) == [0, 1, 2, 3, 6, 7, 8, 9] and (few[0] == -1).sum() == 4
    none = choose(score, np.zeros_like(candidate), forced, block=4, slots=3)
    assert (none == -1).all()


def test_host_tier_keeps_the_exact_bytes_and_grows():
    tier = _tier("int4", heads=1, block=16)
    keys = RNG.normal(size=(1, 3000, 32)).astype(np.float32)
    stored = _fill(tier, keys, np.arange(3000))
    assert tier.length == 3000 and tier.present[:, :3000].all()
    for name, array in stored.items():
        np.testing.assert_array_equal(tier.arrays[name][:, :3000], array)
    assert tier.nbytes() > 0


def test_a_sliding_window_row_recalls_only_what_its_next_query_sees():
    tier = _tier("int8", heads=2)
    keys = RNG.normal(scale=0.3, size=(2, 160, 32)).astype(np.float32)
    direction = np.zeros(32, np.float32)
    direction[3] = 1.0
    keys[:, 20] += 5 * direction  # a strong match, early
    _fill(tier, keys, np.arange(160))
    resident = np.tile(np.r_[0:4, 152:160], (2, 1))  # the op holds the sinks and the recent window
    query = np.repeat(direction[None], 4, axis=0)
    lowest = np.array([0, 100])  # row 1 is a sliding-window layer's: positions < 100 are masked for it
    chosen = tier.recall(query, resident, newest=159, slots=16, lowest=lowest)
    assert 20 in chosen[0] and (chosen[1][chosen[1] >= 0] >= 100).all()
