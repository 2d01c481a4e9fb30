"""What the manifest says a cache costs: per-token bytes only for caches that grow with the context."""

from __future__ import annotations

import pytest

from edgec.kvcache.compression import Compression
from edgec.kvcache.spec import CacheSpec, LayerCache


def _gemma_like(compressed: bool) -> CacheSpec:
    """Two ring layers (window 512, 1024 slots) and one global layer of 8192 slots, 1 KV head of 256."""
    rings = tuple(LayerCache(i, 1, 256, 1024, window=512) for i in range(2))
    global_layer = LayerCache(2, 1, 256, 4096 if compressed else 8192, compressed=compressed)
    compression = Compression(capacity=4096, dtype="int8", group=32) if compressed else None
    return CacheSpec(layers=(*rings, global_layer), dtype="float32", compression=compression)


def test_rings_cost_fixed_bytes_not_bytes_per_token():
    plain = _gemma_like(compressed=False)
    assert plain.kv_bytes_per_token() == 2 * 256 * 4  # the global layer's k + v in fp32
    assert plain.ring_kv_bytes() == 2 * 1024 * 2 * 256 * 4


@pytest.mark.parametrize("dtype, per_value", [("int8", 1 + 4 / 32), ("int4", 0.5 + 4 / 32), ("fp16", 2)])
def test_compressed_global_layer_bytes(dtype, per_value):
    spec = _gemma_like(compressed=True)
    spec = CacheSpec(layers=spec.layers, dtype=spec.dtype, compression=Compression(capacity=4096, dtype=dtype))
    assert spec.kv_bytes_per_token() == pytest.approx(2 * 256 * per_value)
    assert spec.ring_kv_bytes() == 2 * 1024 * 2 * 256 * 4  # rings keep the compute dtype
