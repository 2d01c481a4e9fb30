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


def test_state_is_named_and_allocated_by_the_spec():
    from edgec.kvcache.spec import compressed_state

    compression = Compression(capacity=8, dtype="int4", group=16)
    spec = CacheSpec(
        layers=(
            LayerCache(0, 2, 32, 16, state=("k", "v")),  # positions implicit (a GQA lowering)
            LayerCache(1, 2, 32, 8, compressed=True, state=compressed_state(compression)),
        ),
        compression=compression,
    )
    assert [t.input for t in spec.tensors()] == [
        "cache.0.k",
        "cache.0.v",
        "cache.1.k",
        "cache.1.v",
        "cache.1.k_scale",
        "cache.1.v_scale",
        "cache.1.score",
        "cache.1.pos",
    ]
    arrays = dict((t.input, a) for t, a in spec.empty_state(compressed_slots=30))
    assert arrays["cache.1.k"].shape == (1, 2, 30, 16) and arrays["cache.1.k"].dtype.name == "uint8"  # int4 packed
    assert arrays["cache.1.k_scale"].shape == (1, 2, 30, 2) and (arrays["cache.1.pos"] == -1).all()
    assert arrays["cache.0.k"].shape == (1, 2, 16, 32)
    feeds = spec.empty_feeds(tokens=3)
    assert feeds["protect"].shape == (1, 3) and set(feeds) == {*arrays, "protect", "observe"}
    assert feeds["observe"].tolist() == [True]
    inputs = set(spec.state_inputs())
    outputs = {t.output for t in spec.tensors()}
    assert spec.mismatch(inputs, outputs) is None
    assert "missing cache.1.score" in spec.mismatch(inputs - {"cache.1.score"}, outputs)
    assert "extra cache.0.pos" in spec.mismatch(inputs | {"cache.0.pos"}, outputs)
    assert CacheSpec.from_json(spec.to_json()) == spec


def test_a_v1_cache_record_gets_the_state_v1_implied():
    v1 = {
        "dtype": "float32",
        "positions": False,
        "compression": None,
        "layers": [{"layer": 0, "num_kv_heads": 1, "head_dim": 8, "capacity": 4, "window": 0}],
    }
    assert CacheSpec.from_json(v1).layers[0].state == ("k", "v")
    assert CacheSpec.from_json(v1 | {"positions": True}).layers[0].state == ("k", "v", "pos")
