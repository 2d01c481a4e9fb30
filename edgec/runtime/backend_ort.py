"""ONNX Runtime backend: one session, cache state kept in place between steps with IO binding.

Every cache output is bound to the very buffer of its input. That is correct because inside KVAttention the
cache inputs feed only ScatterElements, which ONNX Runtime updates in place when input and output share a
buffer (and so does GroupQueryAttention's shared past/present buffer, where the cpu target lowers to it); in
CompressedKVAttention every reader of a state input is an ancestor of the scatter that writes it.
tests/kvcache/test_function.py and test_compressed.py check each against separate buffers.

A decode step (one token) touches no Python allocation: the token, its position, its protect flag and the
logits live in numpy buffers bound once; a step writes a few numbers and reads the logits buffer.

A compressed cache whose settings say ``prefill_compress = end`` reads a prompt longer than its capacity into
a larger, temporary state (the graph's slot count is symbolic) and then keeps the best ``capacity`` slots
per head (``reference.select_slots``) — once per prompt, not per token.

Static-shape bundles (the CANN targets) hold two graphs over one weights file: ``model.onnx`` takes a chunk of
exactly ``static_tokens`` tokens, ``decode.onnx`` one token. ``StaticOrtStep`` pads every chunk with tokens at
position -1 (the graph makes them write nothing) and binds one set of cache buffers to both sessions.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgec.kvcache.reference import select_slots
from edgec.kvcache.spec import CacheSpec

StateEntry = tuple[str, str, np.ndarray, ort.OrtValue]  # input name, output name, buffer, its OrtValue


class OrtStep:
    """Runs the step graph: tokens at explicit positions in, logits out, cache updated in place."""

    def __init__(
        self,
        model_path: Path,
        spec: CacheSpec,
        vocab_size: int,
        providers: list[str] | None = None,
        threads: int | None = None,
        provider_options: dict[str, dict[str, str]] | None = None,
        shared_state: list[StateEntry] | None = None,
    ) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        # ONNX Runtime's pool threads spin between nodes (its default, kept): on a dedicated machine that is what
        # makes 2 threads pay (int4 decode 0.97x genai spinning vs 0.66x not). On a machine that runs anything
        # else a spinning pool waits on a descheduled thread at every one of a step's ~1,000 small nodes:
        # EDGEC_ORT_SPIN=0 made decode 2x faster there (docs/BENCHMARKS.md, "threads")
        options.add_session_config_entry("session.intra_op.allow_spinning", os.environ.get("EDGEC_ORT_SPIN", "1"))
        if threads:
            options.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        per_provider = [(provider_options or {}).get(name, {}) for name in providers]
        self.session = ort.InferenceSession(
            str(model_path), options, providers=providers, provider_options=per_provider
        )
        if note := cpu_fallback_note(self.session, providers[0], model_path.name):
            logging.getLogger("edgec.runtime").warning(note)  # shown by default; an embedding program may route it
        self.spec = spec
        self.compression = spec.compression
        self._graph_inputs = {value.name for value in self.session.get_inputs()}
        self._protected = "protect" in self._graph_inputs
        # a second graph over the same cache (static-shape bundles) binds the same buffers
        self._state = shared_state if shared_state is not None else self._allocate(spec.layers)
        self._active = self._state  # the state multi-token steps run on (a larger one while reading a prompt)
        # one-token step buffers, bound once
        self._token = np.zeros((1, 1), np.int64)
        self._position = np.zeros((1, 1), np.int64)
        self._last = np.zeros(1, np.int64)
        self._protect_one = np.zeros((1, 1), bool)
        logits_type = next(o.type for o in self.session.get_outputs() if o.name == "logits")
        self._logits_dtype = np.float16 if logits_type == "tensor(float16)" else np.float32
        self._logits = np.zeros((1, 1, vocab_size), self._logits_dtype)
        self._decode = self._binding(
            self._state, self._token, self._position, self._last, self._protect_one, self._logits
        )

    def _allocate(self, layers, compressed_slots: int | None = None) -> list[StateEntry]:
        """State buffers for ``layers`` (compressed layers with ``compressed_slots`` slots when given)."""
        entries = []
        for layer in layers:
            arrays = self.spec.empty_state(layer, compressed_slots if layer.compressed else None)
            names = zip(layer.input_names(self.compression), layer.output_names(self.compression), strict=True)
            for (input_name, output_name), array in zip(names, arrays.values(), strict=True):
                if input_name not in self._graph_inputs:  # e.g. pos, where the target's lowering made it implicit
                    continue
                entries.append((input_name, output_name, array, ort.OrtValue.ortvalue_from_numpy(array)))
        return entries

    @property
    def providers(self) -> list[str]:
        """The execution providers this session runs on, in ONNX Runtime's order."""
        return self.session.get_providers()

    def _binding(self, state, ids, positions, index, protect, logits) -> ort.IOBinding:
        binding = self.session.io_binding()
        for input_name, output_name, _, value in state:
            binding.bind_ortvalue_input(input_name, value)
            binding.bind_ortvalue_output(output_name, value)
        feeds = {"input_ids": ids, "position_ids": positions, "logits_index": index}
        if self._protected:
            feeds["protect"] = protect
        # the binding holds only the native values: the numpy buffers they wrap must outlive it, so it keeps them
        binding.keep_alive = [*feeds.values(), logits]
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        return binding

    def reset(self) -> None:
        """Empty every slot. Only positions need clearing: an empty slot (pos -1) is masked, never scored or
        kept, and whatever finite values it holds are overwritten when it is filled."""
        self._active = self._state
        for input_name, _, array, _ in self._state:
            if input_name.endswith(".pos"):
                array.fill(-1)

    # --- reading a long prompt into a compressed cache ------------------------------------------------------
    def begin_prompt(self, length: int) -> None:
        """Before a prompt of ``length`` tokens: with ``prefill_compress = end`` and a prompt longer than the
        compressed capacity, read it into a temporary state large enough to hold it whole."""
        compression = self.compression
        if compression and compression.prefill_compress == "end" and length > compression.capacity:
            # only the compressed layers get larger buffers; the others (sliding-window rings) keep their own
            compressed = [layer for layer in self.spec.layers if layer.compressed]
            larger = {entry[0]: entry for entry in self._allocate(compressed, length)}
            self._active = [larger.get(entry[0], entry) for entry in self._state]

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        """After the prompt: keep the best ``capacity`` slots of the temporary state in the real one
        (``last_chunk_start``: the first position of the last step, whose scores the op already pooled)."""
        if self._active is self._state:
            return
        by_layer: dict[str, dict[str, np.ndarray]] = {}
        for input_name, _, array, _ in self._active:
            layer, name = input_name.rsplit(".", 1)
            by_layer.setdefault(layer, {})[name] = array
        kept = {
            layer: select_slots(state, self.compression, newest, self.compression.capacity, last_chunk_start)
            for layer, state in by_layer.items()
            if "score" in state
        }
        for input_name, _, array, _ in self._state:
            layer, name = input_name.rsplit(".", 1)
            if layer in kept:
                np.copyto(array, kept[layer][name])
        self._active = self._state

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        """Feed ``ids`` at positions ``start, start+1, ...``; logits [N, V] for the last (or every) position.
        ``protect`` flags tokens a compressed cache must never evict. The one-token result is a view of a buffer
        the next step overwrites: copy it to keep it."""
        count = len(ids)
        if count == 1 and self._active is self._state:
            self._token[0, 0] = ids[0]
            self._position[0, 0] = start
            self._protect_one[0, 0] = bool(protect[0]) if protect is not None else False
            self.session.run_with_iobinding(self._decode)
            return self._logits[0]
        index = np.array([count - 1], np.int64) if last_only else np.arange(count, dtype=np.int64)
        positions = np.arange(start, start + count, dtype=np.int64)
        return self.run_positions(ids, positions, index, protect)

    def run_positions(
        self, ids: np.ndarray, positions: np.ndarray, index: np.ndarray, protect: np.ndarray | None = None
    ) -> np.ndarray:
        """Feed ``ids`` at explicit ``positions`` (-1 = padding, static graphs only); logits [len(index), V]."""
        count = len(ids)
        logits = np.empty((1, len(index), self._logits.shape[-1]), self._logits_dtype)
        flags = np.zeros((1, count), bool) if protect is None else np.asarray(protect, bool).reshape(1, count)
        ids = np.ascontiguousarray(ids, np.int64).reshape(1, count)
        positions = np.ascontiguousarray(positions, np.int64).reshape(1, count)
        index = np.ascontiguousarray(index, np.int64)
        self.session.run_with_iobinding(self._binding(self._active, ids, positions, index, flags, logits))
        return logits[0]


class StaticOrtStep:
    """Same interface as OrtStep, over a static-shape bundle's two graphs: ``decode`` for one token, ``prefill`` for
    chunks padded to ``tokens``. (Static targets keep an uncompressed cache: no prompt-end selection here.)"""

    def __init__(self, prefill: OrtStep, decode: OrtStep, tokens: int) -> None:
        self.prefill, self.decode, self.tokens = prefill, decode, tokens

    @property
    def providers(self) -> list[str]:
        return self.prefill.providers

    def reset(self) -> None:
        self.decode.reset()  # the cache buffers are shared: one reset empties both

    def begin_prompt(self, length: int) -> None:
        pass

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        pass

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        if len(ids) == 1:
            return self.decode.run(ids, start, last_only)
        pieces = []
        for offset in range(0, len(ids), self.tokens):
            real = ids[offset : offset + self.tokens]
            count = len(real)
            padded = np.zeros(self.tokens, np.int64)
            padded[:count] = real
            positions = np.full(self.tokens, -1, np.int64)
            positions[:count] = np.arange(start + offset, start + offset + count)
            # every row's logits are computed (the graph's shape is fixed); pads repeat the last real row
            index = np.minimum(np.arange(self.tokens, dtype=np.int64), count - 1)
            pieces.append(self.prefill.run_positions(padded, positions, index)[:count])
        logits = np.concatenate(pieces)
        return logits[-1:] if last_only else logits


def open_step(
    folder: Path,
    model: dict[str, Any],
    spec: CacheSpec,
    providers: list[str],
    provider_options: dict[str, dict[str, str]] | None = None,
    threads: int | None = None,
) -> OrtStep | StaticOrtStep:
    """The step for a bundle's ``model`` section (its manifest entry): one dynamic graph, or two static ones."""
    vocab = int(model["vocab_size"])
    first = OrtStep(folder / model["file"], spec, vocab, providers, threads, provider_options)
    if "decode_file" not in model:
        return first
    decode = OrtStep(folder / model["decode_file"], spec, vocab, providers, threads, provider_options, first._state)
    return StaticOrtStep(first, decode, int(model["static_tokens"]))


def cpu_fallback_note(session: ort.InferenceSession, provider: str, graph: str) -> str | None:
    """One line when ``provider`` (not the CPU) left nodes of ``graph`` to ONNX Runtime's CPU provider, naming the
    op types; None when it took every node or the installed ONNX Runtime cannot say (< 1.23)."""
    if provider == "CPUExecutionProvider" or not hasattr(session, "get_provider_graph_assignment_info"):
        return None
    on_cpu: dict[str, int] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        if subgraph.ep_name == "CPUExecutionProvider":
            for node in subgraph.get_nodes():
                on_cpu[node.op_type] = on_cpu.get(node.op_type, 0) + 1
    if not on_cpu:
        return None
    kinds = ", ".join(f"{op} ×{count}" for op, count in sorted(on_cpu.items(), key=lambda item: -item[1]))
    return f"note: {provider} left {sum(on_cpu.values())} node(s) of {graph} to the CPU ({kinds})"
