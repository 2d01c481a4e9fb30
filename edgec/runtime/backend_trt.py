"""TensorRT-RTX backend: runs a bundle's engine on an NVIDIA GPU (imports tensorrt_rtx and cuda-python only).

Cache state lives on the GPU in two buffers per tensor, swapped after each step (the step reads one and writes
the other). TensorRT does not promise that an output bound to its own input is computed correctly, and that
cannot be tested without a GPU here, so no in-place aliasing is relied on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgec.errors import BundleError
from edgec.kvcache.spec import CacheSpec

EXTRA = "pip install 'edgec[tensorrt-rtx]'"


def _cuda():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise BundleError(f"this bundle runs on TensorRT-RTX, which needs cuda-python: {EXTRA}") from None
    return cudart


def _check(result):
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise BundleError(f"CUDA error {int(error)}: is there an NVIDIA GPU and driver on this machine?")
    return values[0] if len(values) == 1 else values


class TrtStep:
    """Same interface as OrtStep: run(ids, start, last_only) → logits [N, V]; reset()."""

    def __init__(self, engine_path: Path, spec: CacheSpec, vocab_size: int, max_tokens: int) -> None:
        try:
            import tensorrt_rtx as trt
        except ImportError:
            raise BundleError(f"this bundle runs on TensorRT-RTX: {EXTRA}") from None
        self.cudart = _cuda()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        self.engine = self.runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise BundleError(f"{engine_path} does not load: built by another TensorRT-RTX release or for another GPU")
        self.context = self.engine.create_execution_context()
        self.stream = _check(self.cudart.cudaStreamCreate())
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.float_dtype = np.float16 if spec.dtype == "float16" else np.float32
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.state: list[tuple[str, str, list[int], np.ndarray]] = []  # (input, output, [ptr A, ptr B], host init)
        for layer in spec.layers:
            initial = spec.empty_state(layer).values()
            names = zip(layer.input_names(spec.compression), layer.output_names(spec.compression), strict=True)
            for value, (inp, out) in zip(initial, names, strict=True):
                if inp in names:
                    self.state.append((inp, out, [self._alloc(value.nbytes), self._alloc(value.nbytes)], value))
        self.io = {
            name: self._alloc(size)
            for name, size in (
                ("input_ids", 8 * max_tokens),
                ("position_ids", 8 * max_tokens),
                ("logits_index", 8 * max_tokens),
                ("logits", np.dtype(self.float_dtype).itemsize * max_tokens * vocab_size),
            )
        }
        self.reset()

    def _alloc(self, size: int) -> int:
        return _check(self.cudart.cudaMalloc(size))

    def _upload(self, pointer: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        _check(
            self.cudart.cudaMemcpyAsync(
                pointer, array.ctypes.data, array.nbytes, self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream
            )
        )
        _check(self.cudart.cudaStreamSynchronize(self.stream))

    def reset(self) -> None:
        for _, _, pointers, initial in self.state:
            self._upload(pointers[0], initial)

    def begin_prompt(self, length: int) -> None:
        """Engines are built for the plain cache only (no compressed-cache state to reshape)."""

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        pass

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        count = len(ids)
        if count > self.max_tokens:
            raise BundleError(f"the engine takes at most {self.max_tokens} tokens per step, got {count}")
        index = np.array([count - 1], np.int64) if last_only else np.arange(count, dtype=np.int64)
        feeds = {
            "input_ids": np.asarray(ids, np.int64).reshape(1, count),
            "position_ids": np.arange(start, start + count, dtype=np.int64).reshape(1, count),
            "logits_index": index,
        }
        for name, array in feeds.items():
            self._upload(self.io[name], array)
            self.context.set_input_shape(name, array.shape)
            self.context.set_tensor_address(name, self.io[name])
        self.context.set_tensor_address("logits", self.io["logits"])
        for inp, out, pointers, _ in self.state:
            self.context.set_tensor_address(inp, pointers[0])
            self.context.set_tensor_address(out, pointers[1])
        if not self.context.execute_async_v3(self.stream):
            raise BundleError("TensorRT-RTX failed to run the step")
        logits = np.empty((len(index), self.vocab_size), self.float_dtype)
        _check(
            self.cudart.cudaMemcpyAsync(
                logits.ctypes.data,
                self.io["logits"],
                logits.nbytes,
                self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                self.stream,
            )
        )
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        for entry in self.state:
            entry[2].reverse()  # this step's outputs are the next step's inputs
        return logits
