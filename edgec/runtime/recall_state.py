"""The hierarchical cache on ONNX Runtime's CPU provider: a cache state whose compressed layers keep a host tier of
every token and recall the best blocks into reserved slots between steps (``edgec/kvcache/recall.py`` has the
tiers, summaries and choice; docs/kv-cache.md, "Recall", what runs where and what it costs).

What the graph does: the op as always over all ``C`` slots, plus one output per compressed layer, the query of the
call's last token (``recall.{i}.query``, bound to a buffer of this state). It never evicts the reserved slots
(they score +inf, like protected tokens). What this state does, in numpy, after every call: copy the tokens that
entered the slots (positions ≥ the call's first) into the host tier — one token per head and layer on a decode
step — and then, every ``recall_every`` decode steps and once after each prompt, rewrite the reserved slots (the
last ``R`` of each head) with the best blocks' tokens, scored against the query the step left. The state buffers
are the very arrays ONNX Runtime reads (``OrtValue.numpy()`` shares the CPU buffer; checked here), so a recall is
a few numpy writes, no copy of the cache. The next step therefore reads what the previous step's query chose.

A prompt longer than the capacity (``prefill_compress = end``) is read whole into the temporary state, whose
every token enters the host tier as it is read; the selection then keeps the best ``C - R`` per head in the op's
slots (``reference.select_slots``) and the first recall fills the other ``R`` with the prompt's last query.
"""

from __future__ import annotations

import time

import numpy as np

from edgec.errors import BundleError
from edgec.kvcache.recall import HostTier
from edgec.kvcache.reference import select_slots
from edgec.kvcache.spec import CacheSpec, recall_query_name
from edgec.runtime.backend_ort import OrtCacheState, OrtGraph, PromptGraphs

KEPT = ("k", "v", "k_scale", "v_scale")  # what the host tier stores of a token (score and pos are its own)


def check_recall_graph(graph: OrtGraph, spec: CacheSpec) -> None:
    """A bundle loaded with recall on must have been built with it: its graph gives each compressed layer's query."""
    if graph.device.kind != "cpu":
        raise BundleError(f"recall writes the cache state between steps in host memory; not on {graph.device.kind}")
    outputs = {value.name for value in graph.session.get_outputs()}
    missing = [recall_query_name(layer.layer) for layer in spec.layers if layer.compressed]
    missing = [name for name in missing if name not in outputs]
    if missing:
        raise BundleError(
            f"recall needs the compressed layers' queries, which this bundle's graph does not give ({missing[0]}): "
            "rebuild it with --kv-recall, or load it with kv_recall=0"
        )


class RecallCacheState(OrtCacheState):
    """An ``OrtCacheState`` with a host tier per compressed layer and recall into reserved slots."""

    def __init__(
        self, graph: OrtGraph, vocab_size: int, spec: CacheSpec | None = None, prompts: PromptGraphs | None = None
    ) -> None:
        spec = spec or graph.spec
        compression = spec.compression
        self._layers = [layer for layer in spec.layers if layer.compressed]
        shapes = {value.name: value.shape for value in graph.session.get_outputs()}
        # the query buffers exist before the base class binds its one-token step (``_binding`` binds them)
        self._queries = {
            layer.layer: np.zeros((1, shapes[recall_query_name(layer.layer)][1], layer.head_dim), np.float32)
            for layer in self._layers
        }
        super().__init__(graph, vocab_size, spec=spec, prompts=prompts)
        self._views = self._compressed_views(self._state)
        self.reserved = compression.recall_slots
        self.every = compression.recall_every
        # one host tier for every compressed layer: its rows are (layer, KV head) pairs, layer-major, so each step's
        # work is one set of numpy calls whatever the number of layers (they share one head layout)
        self.kv_heads = self._layers[0].num_kv_heads
        first = self._views[self._layers[0].layer]
        stored = {name: (first[name].shape[3:], first[name].dtype) for name in KEPT if name in first}
        self.tier = HostTier(len(self._layers) * self.kv_heads, self._layers[0].head_dim, compression, stored)
        # a sliding-window layer's next query sees positions > its position − window only: older ones are not recalled
        self._windows = np.repeat([layer.window or -1 for layer in self._layers], self.kv_heads)
        self._query_rows = np.zeros((len(self._layers), *next(iter(self._queries.values())).shape[1:]), np.float32)
        self._reading = False
        self._steps = 0
        self.recall_seconds = 0.0  # the runtime's own time in host-tier copies and recalls (benchmarks read it)
        self.recalls = 0

    def rows(self, layer: int) -> slice:
        """The host tier's rows of a compressed layer (one per KV head)."""
        index = [entry.layer for entry in self._layers].index(layer)
        return slice(index * self.kv_heads, (index + 1) * self.kv_heads)

    def _compressed_views(self, entries) -> dict[int, dict[str, np.ndarray]]:
        """numpy arrays over the state buffers ONNX Runtime reads and writes (no copies)."""
        compressed = {layer.layer for layer in self._layers}
        views: dict[int, dict[str, np.ndarray]] = {}
        for tensor, value in entries:
            if tensor.layer in compressed:
                array = value.numpy()
                if array.ctypes.data != value.data_ptr():  # an ONNX Runtime that copies: recall would write nowhere
                    raise BundleError("this ONNX Runtime gives copies of its CPU buffers; recall cannot run on it")
                views.setdefault(tensor.layer, {})[tensor.name] = array
        return views

    def _binding(self, state, ids, positions, index, protect, logits, observe, graph=None, presents_in_place=True):
        import onnxruntime as ort

        binding = super()._binding(state, ids, positions, index, protect, logits, observe, graph, presents_in_place)
        for layer, query in self._queries.items():
            binding.bind_ortvalue_output(recall_query_name(layer), ort.OrtValue.ortvalue_from_numpy(query))
        binding.keep_alive += list(self._queries.values())
        return binding

    def _chunk_rows(self, graph: OrtGraph) -> int:
        """0: recall writes tokens into slots between steps, which the count of tokens fed does not see, so the
        chunk kernel's presents are never bound here (a fresh present each chunk: correct, a copy)."""
        return 0

    def _extends(self, positions: np.ndarray) -> bool:
        """False, for the same reason (and a hierarchical bundle has no extend graph: ``extend_graph``)."""
        return False

    # --- the protocol ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.tier.clear()
        self._steps, self._reading = 0, False

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """A saved state: its slots become the host tier (a saved prompt carries no host tier of its own)."""
        super().restore(arrays)
        self.tier.clear()
        self._harvest(self._state, 0, None)
        self._steps, self._reading = 0, False

    def begin_prompt(self, length: int) -> None:
        super().begin_prompt(length)
        self._reading = True

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        """The op's slots keep the best ``C - R`` of the prompt per head (the whole prompt is in the host tier by
        now); the reserved ``R`` are filled by a first recall with the prompt's last query."""
        started = time.perf_counter()
        if self._active is not self._state:
            capacity = self.compression.capacity
            main = capacity - self.reserved
            temporary = self._compressed_views(self._active)
            for layer, state in temporary.items():
                kept = select_slots(state, self.compression, newest, main, last_chunk_start)
                views = self._views[layer]
                for name, array in kept.items():
                    views[name][:, :, :main] = array
                views["pos"][:, :, main:] = -1
            self._active = self._state
        self._reading = False
        self._recall(newest)
        self.recall_seconds += time.perf_counter() - started

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        logits = super().run(ids, start, last_only, protect)
        started = time.perf_counter()
        self._harvest(self._active, start, protect)
        if not self._reading:
            self._steps += 1
            if self._steps % self.every == 0:
                self._recall(start + len(ids) - 1)
        self.recall_seconds += time.perf_counter() - started
        return logits

    # --- the work between steps --------------------------------------------------------------------------------
    def _harvest(self, entries, start: int, protect: np.ndarray | None) -> None:
        """Copy the tokens that entered the slots in the last call (positions ≥ ``start``) into the host tier."""
        views = self._views if entries is self._state else self._compressed_views(entries)
        rows, positions, values = [], [], {name: [] for name in self.tier.arrays}
        for index, arrays in enumerate(views.values()):
            pos = arrays["pos"][0]
            heads, slots = np.nonzero(pos >= start)
            rows.append(heads + index * self.kv_heads)
            positions.append(pos[heads, slots])
            for name, parts in values.items():
                parts.append(arrays[name][0][heads, slots])
        positions = np.concatenate(positions)
        flags = False if protect is None else np.asarray(protect, bool)[positions - start]
        joined = {name: np.concatenate(parts) for name, parts in values.items()}
        self.tier.add(np.concatenate(rows), positions, joined, flags)

    def _recall(self, newest: int) -> None:
        """Rewrite the reserved slots (the last ``R`` of each head) with the best blocks' tokens."""
        reserved, kv_heads = self.reserved, self.kv_heads
        views = list(self._views.values())
        main = views[0]["pos"].shape[2] - reserved
        for index, layer in enumerate(self._views):
            self._query_rows[index] = self._queries[layer][0]
        resident = np.concatenate([arrays["pos"][0, :, :main] for arrays in views])
        lowest = np.where(self._windows > 0, newest + 2 - self._windows, 0)
        queries = self._query_rows.reshape(-1, self._query_rows.shape[-1])
        chosen = self.tier.recall(queries, resident, newest, reserved, lowest)
        safe = np.maximum(chosen, 0)
        rows = np.arange(chosen.shape[0])[:, None]
        recalled = {name: stored[rows, safe] for name, stored in self.tier.arrays.items()}
        score = np.where(chosen >= 0, np.float32(np.inf), np.float32(0))
        for index, arrays in enumerate(views):
            part = slice(index * kv_heads, (index + 1) * kv_heads)
            for name, values in recalled.items():
                arrays[name][0, :, main:] = values[part]
            arrays["pos"][0, :, main:] = chosen[part]
            arrays["score"][0, :, main:] = score[part]
        self.recalls += 1
