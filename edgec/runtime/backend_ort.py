"""ONNX Runtime backend: one session, cache state kept in place between steps with IO binding.

Every cache output is bound to the very buffer of its input. That is correct because inside KVAttention the
cache inputs feed only ScatterElements, which ONNX Runtime updates in place when input and output share a
buffer (and so does GroupQueryAttention's shared past/present buffer, where the cpu target lowers to it);
tests/kvcache/test_function.py checks both against separate buffers.

A decode step (one token) touches no Python allocation: the token, its position and the logits live in numpy
buffers bound once; a step writes two integers and reads the logits buffer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgec.kvcache.spec import CacheSpec


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
        dtype = np.float16 if spec.dtype == "float16" else np.float32
        self._positions: list[np.ndarray] = []
        self._cache_values: list[tuple[str, str, ort.OrtValue]] = []
        self._keep_alive: list[np.ndarray] = []
        graph_inputs = {value.name for value in self.session.get_inputs()}
        for layer in spec.layers:
            shape = (1, layer.num_kv_heads, layer.capacity, layer.head_dim)
            arrays = (np.zeros(shape, dtype), np.zeros(shape, dtype), np.full(shape[:3], -1, np.int64))
            for array, input_name, output_name in zip(arrays, layer.input_names(), layer.output_names(), strict=True):
                if input_name not in graph_inputs:  # e.g. pos, where the target's lowering made it implicit
                    continue
                value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the numpy buffer, no copy
                self._cache_values.append((input_name, output_name, value))
                self._keep_alive.append(array)
                if array.dtype == np.int64:
                    self._positions.append(array)
        # one-token step buffers, bound once
        self._token = np.zeros((1, 1), np.int64)
        self._position = np.zeros((1, 1), np.int64)
        self._last = np.zeros(1, np.int64)
        logits_type = next(o.type for o in self.session.get_outputs() if o.name == "logits")
        self._logits_dtype = np.float16 if logits_type == "tensor(float16)" else np.float32
        self._logits = np.zeros((1, 1, vocab_size), self._logits_dtype)
        self._decode = self._binding(self._token, self._position, self._last, self._logits)

    def _binding(self, ids, positions, index, logits) -> ort.IOBinding:
        binding = self.session.io_binding()
        for input_name, output_name, value in self._cache_values:
            binding.bind_ortvalue_input(input_name, value)
            binding.bind_ortvalue_output(output_name, value)
        for name, array in (("input_ids", ids), ("position_ids", positions), ("logits_index", index)):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        return binding

    def reset(self) -> None:
        """Empty every slot (k and v need no clearing: empty slots are masked by position)."""
        for positions in self._positions:
            positions.fill(-1)

    def run(self, ids: np.ndarray, start: int, last_only: bool) -> np.ndarray:
        """Feed ``ids`` at positions ``start, start+1, ...``; logits [N, V] for the last (or every) position.
        The one-token result is a view of a buffer the next step overwrites: copy it to keep it."""
        count = len(ids)
        if count == 1:
            self._token[0, 0] = ids[0]
            self._position[0, 0] = start
            self.session.run_with_iobinding(self._decode)
            return self._logits[0]
        index = np.array([count - 1], np.int64) if last_only else np.arange(count, dtype=np.int64)
        logits = np.empty((1, len(index), self._logits.shape[-1]), self._logits_dtype)
        positions = np.arange(start, start + count, dtype=np.int64).reshape(1, count)
        binding = self._binding(np.ascontiguousarray(ids, np.int64).reshape(1, count), positions, index, logits)
        self.session.run_with_iobinding(binding)
        return logits[0]
