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
"""

from __future__ import annotations

from pathlib import Path

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
    ) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(model_path), options, providers=providers or ["CPUExecutionProvider"])
        self.spec = spec
        self.compression = spec.compression
        self._graph_inputs = {value.name for value in self.session.get_inputs()}
        self._protected = "protect" in self._graph_inputs
        self._state = self._allocate(None)
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

    def _allocate(self, compressed_slots: int | None) -> list[StateEntry]:
        """State buffers for every layer (compressed layers with ``compressed_slots`` slots when given)."""
        entries = []
        for layer in self.spec.layers:
            slots = compressed_slots if layer.compressed else None
            arrays = self.spec.empty_state(layer, slots)
            names = zip(layer.input_names(self.compression), layer.output_names(self.compression), strict=True)
            for (input_name, output_name), array in zip(names, arrays.values(), strict=True):
                if input_name not in self._graph_inputs:  # e.g. pos, where the target's lowering made it implicit
                    continue
                entries.append((input_name, output_name, array, ort.OrtValue.ortvalue_from_numpy(array)))
        return entries

    def _binding(self, state, ids, positions, index, protect, logits) -> ort.IOBinding:
        binding = self.session.io_binding()
        for input_name, output_name, _, value in state:
            binding.bind_ortvalue_input(input_name, value)
            binding.bind_ortvalue_output(output_name, value)
        feeds = {"input_ids": ids, "position_ids": positions, "logits_index": index}
        if self._protected:
            feeds["protect"] = protect
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
            self._active = self._allocate(length)

    def end_prompt(self, newest: int) -> None:
        """After the prompt: keep the best ``capacity`` slots of the temporary state in the real one."""
        if self._active is self._state:
            return
        by_layer: dict[str, dict[str, np.ndarray]] = {}
        for input_name, _, array, _ in self._active:
            layer, name = input_name.rsplit(".", 1)
            by_layer.setdefault(layer, {})[name] = array
        kept = {
            layer: select_slots(state, self.compression, newest, self.compression.capacity)
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
        logits = np.empty((1, len(index), self._logits.shape[-1]), self._logits_dtype)
        positions = np.arange(start, start + count, dtype=np.int64).reshape(1, count)
        flags = np.zeros((1, count), bool) if protect is None else np.asarray(protect, bool).reshape(1, count)
        ids = np.ascontiguousarray(ids, np.int64).reshape(1, count)
        self.session.run_with_iobinding(self._binding(self._active, ids, positions, index, flags, logits))
        return logits[0]
