"""What the cache state of a built model looks like: shapes and dtypes per layer, as graph inputs/outputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LayerCache:
    """The slot cache of one attention layer: ``num_kv_heads`` × ``capacity`` slots of ``head_dim`` channels."""

    layer: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    window: int = 0  # sliding-window layers attend to the last `window` positions only; 0 = global

    def input_names(self) -> tuple[str, str, str]:
        return (f"cache.{self.layer}.k", f"cache.{self.layer}.v", f"cache.{self.layer}.pos")

    def output_names(self) -> tuple[str, str, str]:
        return (f"new_cache.{self.layer}.k", f"new_cache.{self.layer}.v", f"new_cache.{self.layer}.pos")


@dataclass(frozen=True)
class CacheSpec:
    """The cache of every layer plus its storage dtype; serialised into the bundle manifest."""

    layers: tuple[LayerCache, ...]
    dtype: str = "float32"
    positions: bool = True  # False where a lowering (e.g. to ORT's GQA) made the pos state implicit

    @property
    def capacity(self) -> int:
        return max(layer.capacity for layer in self.layers)

    def bytes_per_token(self) -> int:
        """KV bytes one cached token costs across all layers (k + v + its int64 position)."""
        itemsize = {"float32": 4, "float16": 2}[self.dtype]
        position = 8 if self.positions else 0
        return sum(layer.num_kv_heads * (2 * layer.head_dim * itemsize + position) for layer in self.layers)

    def total_bytes(self) -> int:
        """Bytes of the whole cache state at full capacity."""
        itemsize = {"float32": 4, "float16": 2}[self.dtype]
        position = 8 if self.positions else 0
        return sum(
            layer.num_kv_heads * layer.capacity * (2 * layer.head_dim * itemsize + position) for layer in self.layers
        )

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "positions": self.positions, "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_json(cls, data: dict) -> CacheSpec:
        return cls(
            layers=tuple(LayerCache(**layer) for layer in data["layers"]),
            dtype=data["dtype"],
            positions=data.get("positions", True),
        )
