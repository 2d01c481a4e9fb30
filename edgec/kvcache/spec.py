"""The cache state of a built model: which tensors each layer carries between steps, their names in the graph,
shapes and dtypes. The one owner of that contract: the export names the graph's state after it, the passes that
change the state (kv_cache, kv_attention_gqa, float16) take a spec and return the new one, the manifest records
it, and every runtime backend, ``edgec verify`` and the tests allocate and feed state through it.

State names: layer ``i``'s tensor ``name`` is the graph input ``cache.{i}.{name}`` and the output
``new_cache.{i}.{name}``; compressed layers also read the one shared ``protect`` input (flags for the new tokens)
and the one shared ``observe`` input (whether a prompt chunk updates the policy's scores; absent in graphs built
before it existed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import QMAX, bytes_per_value

PLAIN_STATE = ("k", "v", "pos")
COMPRESSED_STATE = ("k", "v", "k_scale", "v_scale", "score", "pos")
# a mixed-precision cache's second pool (Compression.mixed): the same tensors, ``hi_slots`` slots, wider storage
MIXED_STATE = ("k_hi", "v_hi", "k_hi_scale", "v_hi_scale", "score_hi", "pos_hi")
SCALES = ("k_scale", "v_scale")
HI_SCALES = ("k_hi_scale", "v_hi_scale")
POSITIONS = ("pos", "pos_hi")  # -1 = an empty slot
PROTECT_INPUT = "protect"
# [1] bool: False for a prompt chunk whose scores the next chunk replaces (the op skips its observation); graphs
# built before it existed lack it, and always observe
OBSERVE_INPUT = "observe"
SLOT_DIM = "kv_slots"  # a compressed layer's slot count: symbolic, the graph runs on any number of slots
ROW_DIM = "kv_rows"  # the k/v rows of a compressed layer whose buffers carry a spare row (Compression.spare_rows)
STORAGE_NUMPY = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8, "fp8": np.uint8, "int4": np.uint8}
FLOAT_NUMPY = {"float32": np.float32, "float16": np.float16}


def input_name(layer: int, name: str) -> str:
    return f"cache.{layer}.{name}"


def output_name(layer: int, name: str) -> str:
    return f"new_cache.{layer}.{name}"


def present_name(layer: int, name: str) -> str:
    """A decode graph's extra output with ``Compression.decode_kernel`` gqa: GroupQueryAttention's present of a
    compressed layer's k or v, which the runtime binds to that state's own buffer (no copy of the slots)."""
    return f"present.{layer}.{name}"


def recall_query_name(layer: int) -> str:
    """The graph output that carries a compressed layer's last query when the bundle is built with recall."""
    return f"recall.{layer}.query"


def compressed_state(compression: Compression) -> tuple[str, ...]:
    """The state tensors of a compressed layer, in graph order (scales only for quantized storage; the second
    pool only for a mixed-precision cache)."""
    names = tuple(name for name in COMPRESSED_STATE if name not in SCALES or compression.quantized)
    if compression.mixed == "none":
        return names
    return names + tuple(name for name in MIXED_STATE if name not in HI_SCALES or compression.mixed in QMAX)


def _pool(
    layer: LayerCache, slots: int, dtype: str, group: int, suffix: str, spare_rows: int = 0
) -> dict[str, np.ndarray]:
    """Empty arrays of one slot pool of a compressed layer (``suffix`` "_hi": the mixed cache's wide pool;
    ``spare_rows``: k and v rows beyond the slots, ``Compression.spare_rows``)."""
    shape = (1, layer.num_kv_heads, slots)
    stored = (1, layer.num_kv_heads, slots + spare_rows, layer.head_dim // 2 if dtype == "int4" else layer.head_dim)
    scales = shape + (layer.head_dim // group,)
    return {
        f"k{suffix}": np.zeros(stored, STORAGE_NUMPY[dtype]),
        f"v{suffix}": np.zeros(stored, STORAGE_NUMPY[dtype]),
        f"k{suffix}_scale": np.zeros(scales, np.float32),
        f"v{suffix}_scale": np.zeros(scales, np.float32),
        f"score{suffix}": np.zeros(shape, np.float32),
        f"pos{suffix}": np.full(shape, -1, np.int64),
    }


@dataclass(frozen=True)
class StateTensor:
    """One tensor of cache state: read as ``input``, written as ``output`` of the same shape and dtype."""

    layer: int
    name: str

    @property
    def input(self) -> str:
        return input_name(self.layer, self.name)

    @property
    def output(self) -> str:
        return output_name(self.layer, self.name)


@dataclass(frozen=True)
class LayerCache:
    """The slot cache of one attention layer: ``num_kv_heads`` × ``capacity`` slots of ``head_dim`` channels."""

    layer: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    window: int = 0  # sliding-window layers attend to the last `window` positions only; 0 = global
    compressed: bool = False  # pruned/quantized (CompressedKVAttention) with the spec's Compression
    state: tuple[str, ...] = PLAIN_STATE  # the tensors this layer's graph carries (pos may be implicit)

    def tensors(self) -> tuple[StateTensor, ...]:
        return tuple(StateTensor(self.layer, name) for name in self.state)


@dataclass(frozen=True)
class CacheSpec:
    """The cache of every layer plus its storage dtype; serialised into the bundle manifest."""

    layers: tuple[LayerCache, ...]
    dtype: str = "float32"  # plain layers' storage (the compute dtype)
    compression: Compression | None = None  # the compressed layers' settings

    # --- the graph contract ------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return max(layer.capacity for layer in self.layers)

    def tensors(self) -> list[StateTensor]:
        """Every state tensor, in graph input order."""
        return [tensor for layer in self.layers for tensor in layer.tensors()]

    @property
    def protected(self) -> bool:
        """Whether the graph takes the ``protect`` input (any layer is compressed)."""
        return any(layer.compressed for layer in self.layers)

    def state_inputs(self) -> list[str]:
        return [tensor.input for tensor in self.tensors()] + ([PROTECT_INPUT, OBSERVE_INPUT] if self.protected else [])

    def mismatch(self, graph_inputs: set[str], graph_outputs: set[str]) -> str | None:
        """What differs between this spec and a graph's inputs/outputs (None when they agree)."""
        missing = [t.input for t in self.tensors() if t.input not in graph_inputs]
        missing += [t.output for t in self.tensors() if t.output not in graph_outputs]
        if self.protected and PROTECT_INPUT not in graph_inputs:
            missing.append(PROTECT_INPUT)
        expected = set(self.state_inputs())
        step_flags = (PROTECT_INPUT, OBSERVE_INPUT)
        state_like = {name for name in graph_inputs if name.startswith("cache.") or name in step_flags}
        extra = sorted(state_like - expected)
        parts = [
            f"missing {', '.join(missing[:4])}" if missing else "",
            f"extra {', '.join(extra[:4])}" if extra else "",
        ]
        return "; ".join(part for part in parts if part) or None

    def keeping(self, graph_inputs: set[str]) -> CacheSpec:
        """Only the state tensors a graph has: a format-v1 manifest recorded them in part (``positions``)."""
        return replace(
            self,
            layers=tuple(
                replace(layer, state=tuple(t.name for t in layer.tensors() if t.input in graph_inputs))
                for layer in self.layers
            ),
        )

    # --- state arrays --------------------------------------------------------------------------------------------
    def empty_layer(self, layer: LayerCache, slots: int | None = None) -> dict[str, np.ndarray]:
        """Fresh state arrays of one layer, by state name (``slots`` overrides a compressed layer's capacity)."""
        capacity = slots or layer.capacity
        shape = (1, layer.num_kv_heads, capacity, layer.head_dim)
        arrays: dict[str, np.ndarray] = {"pos": np.full(shape[:3], -1, np.int64)}
        if not layer.compressed:
            dtype = FLOAT_NUMPY[self.dtype]
            arrays |= {"k": np.zeros(shape, dtype), "v": np.zeros(shape, dtype)}
        else:
            compression = self.compression
            # a mixed cache's ``capacity`` counts both pools: the wide one has hi_slots, the narrow one the rest
            hi = compression.hi_slots
            arrays = _pool(layer, capacity - hi, compression.dtype, compression.group, "", compression.spare_rows)
            if hi:
                arrays |= _pool(layer, hi, compression.mixed, compression.group, "_hi")
        return {name: arrays[name] for name in layer.state}

    def empty_state(
        self, compressed_slots: int | None = None, compressed_only: bool = False
    ) -> list[tuple[StateTensor, np.ndarray]]:
        """Fresh arrays for every state tensor, in graph order (compressed layers with ``compressed_slots``;
        ``compressed_only``: theirs alone — an `end` prompt's temporary state, ``end_prompt_bytes``)."""
        entries = []
        for layer in self.layers:
            if compressed_only and not layer.compressed:
                continue
            arrays = self.empty_layer(layer, compressed_slots if layer.compressed else None)
            entries += [(StateTensor(layer.layer, name), array) for name, array in arrays.items()]
        return entries

    def empty_feeds(self, tokens: int) -> dict[str, np.ndarray]:
        """Graph inputs of an empty cache for a step of ``tokens`` new tokens: the state plus ``protect`` and
        ``observe`` (a graph built before ``observe`` existed does not take it: drop what it lacks)."""
        feeds = {tensor.input: array for tensor, array in self.empty_state()}
        if self.protected:
            feeds[PROTECT_INPUT] = np.zeros((1, tokens), bool)
            feeds[OBSERVE_INPUT] = np.ones(1, bool)
        return feeds

    # --- the changes passes make ---------------------------------------------------------------------------------
    def compress(self, layers: set[int], compression: Compression) -> CacheSpec:
        """``layers`` become compressed caches of ``compression.capacity`` slots."""
        state = compressed_state(compression)
        return replace(
            self,
            compression=compression,
            layers=tuple(
                replace(layer, compressed=True, capacity=compression.capacity, state=state)
                if layer.layer in layers
                else layer
                for layer in self.layers
            ),
        )

    def without(self, layers: set[int], name: str) -> CacheSpec:
        """``layers`` no longer carry the state tensor ``name`` (a lowering made it implicit)."""
        return replace(
            self,
            layers=tuple(
                replace(layer, state=tuple(n for n in layer.state if n != name)) if layer.layer in layers else layer
                for layer in self.layers
            ),
        )

    def with_capacity(self, capacity: int) -> CacheSpec:
        """Compressed layers with ``capacity`` slots (the graph takes any number)."""
        compression = replace(self.compression, capacity=capacity)
        layers = tuple(replace(layer, capacity=capacity) if layer.compressed else layer for layer in self.layers)
        return replace(self, layers=layers, compression=compression)

    # --- sizes ---------------------------------------------------------------------------------------------------
    def _mixed(self, layer: LayerCache) -> bool:
        return layer.compressed and self.compression.hi_slots > 0

    def _layer_bytes(self, layer: LayerCache, slots: int) -> float:
        """Bytes ``slots`` cached tokens cost in all KV heads of ``layer`` (a mixed cache fills its wide pool
        first)."""
        if self._mixed(layer):
            return layer.num_kv_heads * self.compression.bytes_for_slots(layer.head_dim, slots)
        return layer.num_kv_heads * slots * self._slot_bytes(layer) + self._spare_bytes(layer)

    def _spare_bytes(self, layer: LayerCache) -> int:
        """The k and v rows a compressed layer's buffers carry beyond its slots (``Compression.spare_rows``)."""
        compression = self.compression
        if not layer.compressed or not compression.spare_rows:
            return 0
        row = layer.head_dim // 2 if compression.dtype == "int4" else layer.head_dim
        itemsize = np.dtype(STORAGE_NUMPY[compression.dtype]).itemsize
        return layer.num_kv_heads * compression.spare_rows * 2 * row * itemsize

    def _slot_bytes(self, layer: LayerCache) -> float:
        """Bytes one cached token costs in one KV head of ``layer``: a mixed cache's mean over its capacity."""
        if self._mixed(layer):
            return self.compression.bytes_for_slots(layer.head_dim, layer.capacity) / layer.capacity
        if layer.compressed:
            return self.compression.bytes_per_slot(layer.head_dim)
        itemsize = {"float32": 4, "float16": 2}[self.dtype]
        return 2 * layer.head_dim * itemsize + (8 if "pos" in layer.state else 0)

    def bytes_per_token(self) -> int:
        """KV bytes one cached token costs across all layers (k + v, scales, score, position; a mixed cache's
        mean over its two pools at full capacity)."""
        return int(sum(layer.num_kv_heads * self._slot_bytes(layer) for layer in self.layers))

    def _kv_value_bytes(self, layer: LayerCache) -> float:
        compression = self.compression
        if self._mixed(layer):
            mean = compression.bytes_for_slots(layer.head_dim, layer.capacity, bookkeeping=False) / layer.capacity
            return layer.num_kv_heads * mean
        if layer.compressed:
            return layer.num_kv_heads * 2 * layer.head_dim * bytes_per_value(compression.dtype, compression.group)
        plain = {"float32": "fp32", "float16": "fp16"}[self.dtype]
        return layer.num_kv_heads * 2 * layer.head_dim * bytes_per_value(plain, 32)

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

    def bytes_for(self, tokens: int) -> int:
        """Bytes of the cache state that ``tokens`` tokens of context fill: each layer holds min(its slots, tokens)
        (compressed layers and sliding-window rings stop growing at their capacity; ``total_bytes`` is what the
        runtime allocates)."""
        return int(sum(self._layer_bytes(layer, min(layer.capacity, tokens)) for layer in self.layers))

    def total_bytes(self) -> int:
        """Bytes of the whole cache state at full capacity."""
        return int(sum(self._layer_bytes(layer, layer.capacity) for layer in self.layers))

    def end_prompt_bytes(self, length: int) -> int:
        """Bytes of the temporary state an `end` prompt of ``length`` tokens is read into (the compressed layers at
        its length, beside the slots: the runtime's ``begin_prompt``); 0 where none is needed."""
        compression = self.compression
        if compression is None or compression.prefill_compress != "end" or length <= compression.capacity:
            return 0
        return self.with_capacity(length).compressed_bytes()

    def compressed_bytes(self) -> int:
        """Bytes of the compressed layers' state at their capacity (``with_capacity(n)``: an `end` prompt's
        temporary state for n tokens)."""
        return int(sum(self._layer_bytes(layer, layer.capacity) for layer in self.layers if layer.compressed))

    # --- the manifest --------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "compression": self.compression.to_json() if self.compression else None,
            "layers": [asdict(layer) | {"state": list(layer.state)} for layer in self.layers],
        }

    @classmethod
    def from_json(cls, data: dict) -> CacheSpec:
        """A spec as the manifest records it. Format v1 manifests name no per-layer state: each layer then carries
        the state its kind had in v1, and a v1 ``positions: false`` drops every plain layer's pos."""
        compression = Compression.from_json(data["compression"]) if data.get("compression") else None
        layers = []
        for entry in data["layers"]:
            fields = {key: entry[key] for key in ("layer", "num_kv_heads", "head_dim", "capacity", "window")}
            compressed = bool(entry.get("compressed", False))
            if "state" in entry:
                state = tuple(entry["state"])
            elif compressed:
                state = compressed_state(compression)
            else:
                state = PLAIN_STATE if data.get("positions", True) else ("k", "v")
            layers.append(LayerCache(**fields, compressed=compressed, state=state))
        return cls(layers=tuple(layers), dtype=data["dtype"], compression=compression)
