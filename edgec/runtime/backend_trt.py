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


class TrtBackend:
    """A deserialized engine; each cache state gets its own execution context, stream and device buffers."""

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
        self.spec, self.vocab_size, self.max_tokens = spec, vocab_size, max_tokens
        self.float_dtype = np.float16 if spec.dtype == "float16" else np.float32
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if problem := spec.mismatch(names, names):
            raise BundleError(f"{engine_path.name} does not carry the cache state its manifest names ({problem})")

    @property
    def providers(self) -> list[str]:
        return ["TensorRT-RTX"]

    def open_state(self) -> TrtCacheState:
        return TrtCacheState(self)


class TrtCacheState:
    """One cache state on the GPU, in two buffers per tensor swapped after each step (the step reads one and
    writes the other)."""

    def __init__(self, backend: TrtBackend) -> None:
        self.backend, self.cudart = backend, backend.cudart
        self.context = backend.engine.create_execution_context()
        self.stream = _check(self.cudart.cudaStreamCreate())
        # (state tensor, [device buffer A, device buffer B], its empty value on the host)
        self.buffers = [
            (tensor, [self._alloc(array.nbytes), self._alloc(array.nbytes)], array)
            for tensor, array in backend.spec.empty_state()
        ]
        tokens, vocab = backend.max_tokens, backend.vocab_size
        self.io = {
            name: self._alloc(size)
            for name, size in (
                ("input_ids", 8 * tokens),
                ("position_ids", 8 * tokens),
                ("logits_index", 8 * tokens),
                ("logits", np.dtype(backend.float_dtype).itemsize * tokens * vocab),
            )
        }
        self.reset()

    def _alloc(self, size: int) -> int:
        return _check(self.cudart.cudaMalloc(size))

    def _upload(self, pointer: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check(self.cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, kind, self.stream))
        _check(self.cudart.cudaStreamSynchronize(self.stream))

    def _download(self, array: np.ndarray, pointer: int) -> np.ndarray:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(self.cudart.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, kind, self.stream))
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        return array

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            tensor.input: self._download(np.empty_like(empty), pointers[0]) for tensor, pointers, empty in self.buffers
        }

    def reset(self) -> None:
        for _, pointers, empty in self.buffers:
            self._upload(pointers[0], empty)

    def begin_prompt(self, length: int) -> None:
        """Engines are built for the plain cache only (no compressed-cache state to reshape)."""

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        pass

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        count = len(ids)
        if count > self.backend.max_tokens:
            raise BundleError(f"the engine takes at most {self.backend.max_tokens} tokens per step, got {count}")
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
        for tensor, pointers, _ in self.buffers:
            self.context.set_tensor_address(tensor.input, pointers[0])
            self.context.set_tensor_address(tensor.output, pointers[1])
        if not self.context.execute_async_v3(self.stream):
            raise BundleError("TensorRT-RTX failed to run the step")
        logits = self._download(
            np.empty((len(index), self.backend.vocab_size), self.backend.float_dtype), self.io["logits"]
        )
        for _, pointers, _ in self.buffers:
            pointers.reverse()  # this step's outputs are the next step's inputs
        return logits
