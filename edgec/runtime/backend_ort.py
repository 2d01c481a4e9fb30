"""ONNX Runtime backend: one session, cache state kept in place between steps with IO binding.

Every cache output is bound to the very buffer of its input. That is correct because inside KVAttention the
cache inputs feed only ScatterElements, which ONNX Runtime updates in place when input and output share a
buffer (tests/runtime/test_inplace.py checks this against separate buffers).
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
        providers: list[str] | None = None,
        threads: int | None = None,
    ) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(model_path), options, providers=providers or ["CPUExecutionProvider"])
        self.spec = spec
        dtype = np.float16 if spec.dtype == "float16" else np.float32
        self.cache: list[np.ndarray] = []
        self.binding = self.session.io_binding()
        self.binding.bind_output("logits", "cpu")  # first bound, so first in get_outputs()
        for layer in spec.layers:
            shape = (1, layer.num_kv_heads, layer.capacity, layer.head_dim)
            arrays = (np.zeros(shape, dtype), np.zeros(shape, dtype), np.full(shape[:3], -1, np.int64))
            for array, input_name, output_name in zip(arrays, layer.input_names(), layer.output_names(), strict=True):
                value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the numpy buffer, no copy
                self.binding.bind_ortvalue_input(input_name, value)
                self.binding.bind_ortvalue_output(output_name, value)
                self.cache.append(array)
        self._positions = [array for array in self.cache if array.dtype == np.int64]

    def reset(self) -> None:
        """Empty every slot (k and v need no clearing: empty slots are masked by position)."""
        for positions in self._positions:
            positions.fill(-1)

    def run(self, ids: np.ndarray, start: int, last_only: bool) -> np.ndarray:
        """Feed ``ids`` at positions ``start, start+1, ...``; logits [N, V] for the last (or every) position."""
        count = len(ids)
        self.binding.bind_cpu_input("input_ids", ids.reshape(1, count))
        self.binding.bind_cpu_input("position_ids", np.arange(start, start + count, dtype=np.int64).reshape(1, count))
        index = np.array([count - 1], np.int64) if last_only else np.arange(count, dtype=np.int64)
        self.binding.bind_cpu_input("logits_index", index)
        self.binding.bind_output("logits", "cpu")  # re-bound each step: ORT would reuse last step's buffer shape
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0].numpy()[0]
