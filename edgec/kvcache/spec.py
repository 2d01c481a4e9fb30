"""What the cache state of a built model looks like: shapes and dtypes per layer, as graph inputs/outputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import bytes_per_value

PLAIN_STATE = ("k", "v", "pos")
COMPRESSED_STATE = ("k", "v", "k_scale", "v_scale", "score", "pos")
STORAGE_NUMPY = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8, "fp8": np.uint8, "int4": np.uint8}


@dataclass(frozen=True)
class LayerCache:
    """The slot cache of one attention layer: ``num_kv_heads`` × ``capacity`` slots of ``head_dim`` channels."""

    layer: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    window: int = 0  # sliding-window layers attend to the last `window` positions only; 0 = global
    compressed: bool = False  # pruned/quantized (CompressedKVAttention) with the spec's Compression

    def state(self, compression: Compression | None) -> tuple[str, ...]:
        if not self.compressed:
            return PLAIN_STATE
        return tuple(n for n in COMPRESSED_STATE if n not in ("k_scale", "v_scale") or compression.quantized)

    def input_names(self, compression: Compression | None = None) -> tuple[str, ...]:
        return tuple(f"cache.{self.layer}.{name}" for name in self.state(compression))

    def output_names(self, compression: Compression | None = None) -> tuple[str, ...]:
        return tuple(f"new_cache.{self.layer}.{name}" for name in self.state(compression))


@dataclass(frozen=True)
class CacheSpec:
    """The cache of every layer plus its storage dtype; serialised into the bundle manifest."""

    layers: tuple[LayerCache, ...]
    dtype: str = "float32"  # plain layers' storage (the compute dtype)
    positions: bool = True  # False where a lowering (e.g. to ORT's GQA) made the pos state implicit
    compression: Compression | None = None  # the compressed layers' settings

    @property
    def capacity(self) -> int:
        return max(layer.capacity for layer in self.layers)

    def empty_state(self, layer: LayerCache, slots: int | None = None) -> dict[str, np.ndarray]:
        """Fresh state arrays of one layer (``slots`` overrides a compressed layer's capacity)."""
        capacity = slots or layer.capacity
        shape = (1, layer.num_kv_heads, capacity, layer.head_dim)
        if not layer.compressed:
            dtype = np.float16 if self.dtype == "float16" else np.float32
            return {"k": np.zeros(shape, dtype), "v": np.zeros(shape, dtype), "pos": np.full(shape[:3], -1, np.int64)}
        compression = self.compression
        storage = STORAGE_NUMPY[compression.dtype]
        stored_shape = shape[:3] + (layer.head_dim // 2 if compression.dtype == "int4" else layer.head_dim,)
        state = {"k": np.zeros(stored_shape, storage), "v": np.zeros(stored_shape, storage)}
        if compression.quantized:
            scale_shape = shape[:3] + (layer.head_dim // compression.group,)
            state |= {"k_scale": np.zeros(scale_shape, np.float32), "v_scale": np.zeros(scale_shape, np.float32)}
        return state | {"score": np.zeros(shape[:3], np.float32), "pos": np.full(shape[:3], -1, np.int64)}

    def _slot_bytes(self, layer: LayerCache) -> float:
        """Bytes one cached token costs in one KV head of ``layer``."""
        if layer.compressed:
            return self.compression.bytes_per_slot(layer.head_dim)
        itemsize = {"float32": 4, "float16": 2}[self.dtype]
        return 2 * layer.head_dim * itemsize + (8 if self.positions else 0)

    def bytes_per_token(self) -> int:
        """KV bytes one cached token costs across all layers (k + v, scales, score, position)."""
        return int(sum(layer.num_kv_heads * self._slot_bytes(layer) for layer in self.layers))

    def _kv_value_bytes(self, layer: LayerCache) -> float:
        plain = {"float32": "fp32", "float16": "fp16"}[self.dtype]
        dtype = self.compression.dtype if layer.compressed else plain
        group = self.compression.group if layer.compressed else 32
        return layer.num_kv_heads * 2 * layer.head_dim * bytes_per_value(dtype, group)

    def kv_bytes_per_token(self) -> float:
        """k + v bytes (scales included, bookkeeping excluded) per cached token in the layers whose cache grows
        with the context (global layers): what compression ratios compare. Sliding-window rings hold a fixed
        number of tokens whatever the context: ``ring_kv_bytes``."""
        return sum(self._kv_value_bytes(layer) for layer in self.layers if not layer.window or layer.compressed)

    def ring_kv_bytes(self) -> int:
        """k + v bytes of the sliding-window rings (fixed: they never hold more than their slots)."""
        return int(
            sum(
                self._kv_value_bytes(layer) * layer.capacity
                for layer in self.layers
                if layer.window and not layer.compressed
            )
        )

    def total_bytes(self) -> int:
        """Bytes of the whole cache state at full capacity."""
        return int(sum(layer.num_kv_heads * layer.capacity * self._slot_bytes(layer) for layer in self.layers))

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "positions": self.positions,
            "compression": self.compression.to_json() if self.compression else None,
            "layers": [asdict(layer) for layer in self.layers],
        }

    @classmethod
    def from_json(cls, data: dict) -> CacheSpec:
        compression = data.get("compression")
        return cls(
            layers=tuple(LayerCache(**layer) for layer in data["layers"]),
            dtype=data["dtype"],
            positions=data.get("positions", True),
            compression=Compression.from_json(compression) if compression else None,
        )
