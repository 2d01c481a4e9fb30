"""TensorRT-RTX backend: runs a bundle's engine on an NVIDIA GPU (imports tensorrt_rtx and cuda-python only).

Loading: the GPU is checked first (none, or another compute capability than the engine's, is one line naming
what is missing); ``Runtime.get_engine_validity`` then tells why an engine would not load (another TensorRT-RTX
release, another GPU, a driver too old) before deserializing. TensorRT-RTX compiles kernels just in time on the
first run; the compiled kernels are kept in a runtime cache saved per engine and GPU
(``$EDGEC_CACHE_DIR``, default ``~/.cache/edgec``, ``tensorrt-rtx/``), so a second start does not compile again.
A ``--kv-plugin on`` bundle's plugin is registered before the engine is deserialized (``edgec.plugin_files``: only
this edgec's own plugin module is imported); its enqueue launches the bundle's PTX through cuda-python's driver API.

Each cache state (``runtime.step.CacheState``) has its own execution context, stream and device buffers: two per
state tensor, swapped after each step (the step reads one and writes the other; TensorRT gives no guarantee for
an output bound to its own input). Every TensorRT and CUDA return value is checked; ``close`` frees what a state
allocated (also done when it is garbage collected).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from edgec.errors import BundleError, GenerationError
from edgec.kvcache.reference import select_slots
from edgec.kvcache.spec import OBSERVE_INPUT, PROTECT_INPUT, CacheSpec, StateTensor
from edgec.runtime.observe import PromptObservation
from edgec.runtime.prompt_room import check_prompt_room
from edgec.runtime.user_cache import user_cache_dir

EXTRA = "pip install 'edgec[tensorrt-rtx]'"
IO_INPUTS = ("input_ids", "position_ids", "logits_index")


def _modules():
    """tensorrt_rtx and cuda-python's runtime bindings, or one line naming the extra."""
    try:
        import tensorrt_rtx
    except ImportError:
        raise BundleError(f"this bundle runs on TensorRT-RTX, which is not installed here: {EXTRA}") from None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise BundleError(f"this bundle runs on TensorRT-RTX, which needs cuda-python ≥ 12.6.1: {EXTRA}") from None
    return tensorrt_rtx, cudart


class Cuda:
    """cuda-python's runtime API with every return code checked."""

    def __init__(self, cudart) -> None:
        self.cudart = cudart

    def __call__(self, function: str, *args):
        error, *values = getattr(self.cudart, function)(*args)
        if int(error) != 0:
            raise BundleError(f"{function} failed: {self.error_name(error)}")
        return values[0] if len(values) == 1 else values

    def error_name(self, error) -> str:
        return getattr(error, "name", None) or f"CUDA error {int(error)}"


def find_gpu(cuda: Cuda, wanted: str | None) -> Any:
    """The properties of GPU 0, which must have the engine's compute capability; one line otherwise."""
    needs = f"an NVIDIA GPU of compute capability {wanted}" if wanted else "an NVIDIA GPU"
    error, count = cuda.cudart.cudaGetDeviceCount()
    driver, runtime = _versions(cuda)
    if driver and runtime and driver < runtime:  # the installed CUDA runtime is newer than the driver supports
        raise BundleError(
            f"the NVIDIA driver here supports CUDA {_cuda_version(driver)}, the installed TensorRT-RTX needs CUDA "
            f"{_cuda_version(runtime)}: update the driver (R580+ for CUDA 13) or pip install "
            "'edgec[tensorrt-rtx-cu12]'"
        )
    if int(error) != 0 or count < 1:
        why = cuda.error_name(error) if int(error) != 0 else "no device"
        raise BundleError(f"this bundle runs on {needs}; none is usable here ({why}: no GPU, or no NVIDIA driver)")
    properties = cuda("cudaGetDeviceProperties", 0)
    have = f"{properties.major}.{properties.minor}"
    if wanted and have != str(wanted):
        name = properties.name.decode(errors="replace").strip("\0") if isinstance(properties.name, bytes) else ""
        raise BundleError(
            f"this bundle's engine is built for compute capability {wanted}; this GPU ({name}) is {have}: "
            "rebuild it for this GPU's target (edgec targets)"
        )
    return properties


def _versions(cuda: Cuda) -> tuple[int, int]:
    """(driver, runtime) CUDA versions as CUDA numbers them (13000 = 13.0); 0 where unknown."""
    found = []
    for function in ("cudaDriverGetVersion", "cudaRuntimeGetVersion"):
        error, *values = getattr(cuda.cudart, function)()
        found.append(int(values[0]) if int(error) == 0 and values else 0)
    return found[0], found[1]


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def runtime_cache_path(engine_sha256: str, properties: Any, library_version: str) -> Path:
    """Where the kernels TensorRT-RTX compiles for this engine on this GPU are kept between runs."""
    root = user_cache_dir() / "tensorrt-rtx"
    uuid = getattr(properties, "uuid", b"")
    uuid = bytes(getattr(uuid, "bytes", uuid) or b"")
    gpu = hashlib.sha256(uuid + f"{properties.major}.{properties.minor}".encode()).hexdigest()[:16]
    return root / f"{engine_sha256[:24]}-{gpu}-{library_version}.cache"


class TrtBackend:
    """A deserialized engine, shared by every cache state opened on it."""

    def __init__(self, folder: Path, runtime: dict[str, Any], spec: CacheSpec, vocab_size: int, engine_sha256: str):
        trt, cudart = _modules()
        self.trt, self.cuda = trt, Cuda(cudart)
        self.properties = find_gpu(self.cuda, runtime.get("compute_capability"))
        if runtime.get("plugin"):  # the cache plugin's layer: its creator must be registered before deserializing
            from edgec.plugin_files import register_from_bundle

            register_from_bundle(folder, runtime["plugin"])
        data = (folder / runtime["engine"]).read_bytes()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        validity, diagnostics = self.runtime.get_engine_validity(data)
        if validity == trt.EngineValidity.INVALID:
            raise BundleError(
                f"{runtime['engine']} cannot run here ({_diagnosis(diagnostics)}); it was built by TensorRT-RTX "
                f"{runtime.get('version')} for compute capability {runtime.get('compute_capability')}, this is "
                f"TensorRT-RTX {trt.__version__}: rebuild the bundle with this release"
            )
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise BundleError(f"TensorRT-RTX {trt.__version__} could not load {runtime['engine']}; rebuild the bundle")
        self.spec, self.vocab_size = spec, vocab_size
        self.max_tokens = int(runtime["prefill_chunk"])
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if problem := spec.mismatch(names, names):
            raise BundleError(f"{runtime['engine']} does not carry the cache state its manifest names ({problem})")
        self.observes = OBSERVE_INPUT in names  # engines built before the input existed always observe
        self.float_dtype = np.dtype(self.engine.get_tensor_dtype("logits"))
        self.dtypes = {name: np.dtype(self.engine.get_tensor_dtype(name)) for name in names}
        # kernels compiled on the first run are kept between processes
        self.runtime_config = self.engine.create_runtime_config()
        self.runtime_cache = self.runtime_config.create_runtime_cache()
        self.cache_path = runtime_cache_path(engine_sha256, self.properties, trt.__version__)
        if self.cache_path.is_file():
            self.runtime_cache.deserialize(self.cache_path.read_bytes())  # False: stale for this setup, rebuilt
        if not self.runtime_config.set_runtime_cache(self.runtime_cache):
            raise BundleError("TensorRT-RTX refused its runtime cache")
        self.states: weakref.WeakSet = weakref.WeakSet()

    @property
    def providers(self) -> list[str]:
        return ["TensorRT-RTX"]

    def state_bytes(self, spec: CacheSpec, prompt_tokens: int = 0) -> int:
        """Device bytes a ``TrtCacheState`` allocates: two buffers per state tensor (also for an `end` prompt's
        temporary state), each step's inputs for up to the prefill chunk, and its logits."""
        state = 2 * (spec.total_bytes() + spec.end_prompt_bytes(prompt_tokens))
        return state + sum(max(size, 1) for size in self.io_bytes().values())  # cudaMalloc takes ≥ 1 byte

    def device_memory(self) -> tuple[int, int] | None:
        free, total = self.cuda("cudaMemGetInfo")
        return int(free), int(total)

    def io_bytes(self) -> dict[str, int]:
        """Each state's device buffer for a step's inputs (int64, up to the prefill chunk) and its logits."""
        tokens = self.max_tokens
        inputs = {name: 8 * tokens for name in (*IO_INPUTS, PROTECT_INPUT, OBSERVE_INPUT)}
        return inputs | {"logits": self.float_dtype.itemsize * tokens * self.vocab_size}

    def open_state(self) -> TrtCacheState:
        state = TrtCacheState(self)
        self.states.add(state)
        return state

    def save_runtime_cache(self) -> None:
        """Write the compiled kernels for the next start (atomically; a failure only costs that start time)."""
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            blob = bytes(self.runtime_cache.serialize())
            with tempfile.NamedTemporaryFile(dir=self.cache_path.parent, delete=False) as handle:
                handle.write(blob)
            os.replace(handle.name, self.cache_path)
        except OSError:
            pass

    def close(self) -> None:
        self.save_runtime_cache()
        for state in list(self.states):
            state.close()


def _diagnosis(diagnostics: Any) -> str:
    known = {1: "another TensorRT-RTX release", 2: "another GPU", 4: "an older driver", 8: "another OS"}
    flags = int(diagnostics) if isinstance(diagnostics, (int, np.integer)) else 0
    found = [text for bit, text in known.items() if flags & bit]
    return "built for " + ", ".join(found) if found else f"engine diagnostics {diagnostics}"


class TrtCacheState:
    """One cache state on the GPU (see the module docstring)."""

    def __init__(self, backend: TrtBackend) -> None:
        self.backend, self.cuda = backend, backend.cuda
        self.spec = backend.spec
        self.compression = self.spec.compression
        self.pointers: list[int] = []
        streams: list[int] = []
        # frees what this state allocated when it is closed or collected, whichever comes first
        self._finalizer = weakref.finalize(self, _free, self.cuda.cudart, self.pointers, streams)
        self.context = backend.engine.create_execution_context(backend.runtime_config)
        if self.context is None:
            raise BundleError("TensorRT-RTX could not create an execution context (out of GPU memory?)")
        self.stream = self.cuda("cudaStreamCreate")
        streams.append(self.stream)
        # (state tensor, [device buffer read, device buffer written], its empty value on the host)
        self.buffers = self._allocate(self.spec.empty_state())
        self.active = self.buffers  # a larger state while an `end` prompt is read into a compressed cache
        self.io = {name: self._malloc(size) for name, size in backend.io_bytes().items()}
        self._observation = PromptObservation()
        self.reset()

    def _malloc(self, size: int) -> int:
        pointer = self.cuda("cudaMalloc", max(size, 1))
        self.pointers.append(pointer)
        return pointer

    def _allocate(self, arrays: list[tuple[StateTensor, np.ndarray]]):
        """Two device buffers per state tensor (read, written); on a failure those already made are freed."""
        made: list[int] = []
        try:
            for _, array in arrays:
                for _ in range(2):
                    made.append(self._malloc(array.nbytes))
        except BundleError:
            self._free(made)
            raise
        return [(tensor, made[2 * i : 2 * i + 2], array) for i, (tensor, array) in enumerate(arrays)]

    def _free(self, pointers: list[int]) -> None:
        for pointer in pointers:
            self.cuda("cudaFree", pointer)
            self.pointers.remove(pointer)

    def _upload(self, pointer: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        kind = self.cuda.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.cuda("cudaMemcpyAsync", pointer, array.ctypes.data, array.nbytes, kind, self.stream)
        self.cuda("cudaStreamSynchronize", self.stream)

    def _download(self, array: np.ndarray, pointer: int) -> np.ndarray:
        kind = self.cuda.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.cuda("cudaMemcpyAsync", array.ctypes.data, pointer, array.nbytes, kind, self.stream)
        self.cuda("cudaStreamSynchronize", self.stream)
        return array

    def arrays(self) -> dict[str, np.ndarray]:
        return {t.input: self._download(np.empty_like(empty), pointers[0]) for t, pointers, empty in self.buffers}

    def reset(self) -> None:
        self._drop_larger()
        self._observation.end()
        for _, pointers, empty in self.buffers:
            self._upload(pointers[0], empty)

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Set every state tensor to a saved value (``arrays()``'s names and shapes)."""
        self._drop_larger()
        for tensor, pointers, _ in self.buffers:
            self._upload(pointers[0], arrays[tensor.input])

    # --- reading a long prompt into a compressed cache (as the ONNX Runtime backend, on device buffers) -----
    def begin_prompt(self, length: int) -> None:
        compression = self.compression
        whole = compression and compression.prefill_compress == "end" and length > compression.capacity
        if whole:  # two device buffers for each tensor of the compressed layers only (the others keep theirs)
            free, _ = self.cuda("cudaMemGetInfo")
            check_prompt_room(length, 2 * self.spec.end_prompt_bytes(length), int(free), "free on the GPU")
        self._observation.begin(compression, length)
        if whole:
            try:
                larger = self._allocate(self.spec.empty_state(length, compressed_only=True))
            except BundleError as error:  # taken by another process since the check
                raise GenerationError(f"no GPU memory for a {length}-token prompt's state ({error})") from None
            for _, pointers, empty in larger:
                self._upload(pointers[0], empty)
            by_tensor = {entry[0]: entry for entry in larger}
            self.active = [by_tensor.get(entry[0], entry) for entry in self.buffers]

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        self._observation.end()
        if self.active is self.buffers:
            return
        by_layer: dict[int, dict[str, np.ndarray]] = {}
        for (tensor, pointers, empty), own in zip(self.active, self.buffers, strict=True):
            if pointers is not own[1]:
                by_layer.setdefault(tensor.layer, {})[tensor.name] = self._download(np.empty_like(empty), pointers[0])
        capacity = self.compression.capacity
        kept = {
            layer: select_slots(state, self.compression, newest, capacity, last_chunk_start)
            for layer, state in by_layer.items()
        }
        for tensor, pointers, _ in self.buffers:
            if tensor.layer in kept:
                self._upload(pointers[0], kept[tensor.layer][tensor.name])
        self._drop_larger()

    def _drop_larger(self) -> None:
        if self.active is self.buffers:
            return
        for entry, own in zip(self.active, self.buffers, strict=True):
            if entry[1] is not own[1]:
                self._free(entry[1])
        self.active = self.buffers

    # --- a step --------------------------------------------------------------------------------------------------
    def _bind(self, name: str, pointer: int, shape: tuple[int, ...] | None = None) -> None:
        if shape is not None and not self.context.set_input_shape(name, shape):
            raise BundleError(
                f"TensorRT-RTX refused the shape {list(shape)} for {name} (the engine takes 1 to "
                f"{self.backend.max_tokens} tokens per step)"
            )
        if not self.context.set_tensor_address(name, pointer):
            raise BundleError(f"TensorRT-RTX refused the buffer of {name}")

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
        if self.spec.protected:
            flags = np.zeros(count, bool) if protect is None else np.asarray(protect, bool)
            feeds[PROTECT_INPUT] = flags.reshape(1, count)
            if self.backend.observes:
                feeds[OBSERVE_INPUT] = np.array([self._observation.observes(start + count - 1)])
        for name, array in feeds.items():
            self._upload(self.io[name], array.astype(self.backend.dtypes[name], copy=False))
            self._bind(name, self.io[name], array.shape)
        self._bind("logits", self.io["logits"])
        for tensor, pointers, empty in self.active:
            self._bind(tensor.input, pointers[0], empty.shape)
            self._bind(tensor.output, pointers[1])
        if not self.context.execute_async_v3(self.stream):
            raise BundleError("TensorRT-RTX failed to run the step")
        logits = np.empty((len(index), self.backend.vocab_size), self.backend.float_dtype)
        self._download(logits, self.io["logits"])
        for _, pointers, _ in self.active:
            pointers.reverse()  # this step's outputs are the next step's inputs
        return logits

    def close(self) -> None:
        """Free the device memory and stream (idempotent)."""
        self._finalizer()


def _free(cudart, pointers: list[int], streams: list[int]) -> None:
    for pointer in pointers:
        cudart.cudaFree(pointer)
    pointers.clear()
    for stream in streams:
        cudart.cudaStreamDestroy(stream)
    streams.clear()
