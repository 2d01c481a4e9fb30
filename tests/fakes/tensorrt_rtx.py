"""A stand-in for the ``tensorrt_rtx`` module that runs an engine's own ONNX graph with ONNX Runtime (CPU).

TensorRT-RTX loads an engine only on a GPU; this machine has none. The stand-in keeps TensorRT-RTX's Python API
shape and its rules, so every binding, shape, dtype, buffer swap and copy of the backend runs in CI:
- an engine is the graph it was built from (``register``: the bundle's model.onnx for that engine's bytes, and
  the optimization profile's largest dynamic dimension), its I/O tensors named, typed and shaped as the graph's;
- ``set_input_shape`` refuses an unknown or output tensor, a wrong rank, a changed static dimension or a dynamic
  one outside the profile (returns False, as TensorRT does); ``set_tensor_address`` refuses a pointer that is not
  device memory (tests.fakes.cudart);
- ``execute_async_v3`` refuses a run with an input shape or any address missing, an output bound to an input's
  buffer (TensorRT gives no in-place guarantee) or a buffer too small for its tensor; it reads the inputs from
  device memory as the engine would, runs the graph, and writes every output into its buffer.
"""

from __future__ import annotations

import enum
import hashlib
from importlib import metadata
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tests.fakes import cudart

__version__ = metadata.version("tensorrt-rtx")  # the release the bundle's engine was built with, here

_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}
ENGINES: dict[str, tuple[Path, int]] = {}  # sha256 of an engine → (its ONNX graph, the profile's max dimension)
RUNS: list[str] = []  # the engine graph of every execute_async_v3 (tests check the backend ran here)


def register(engine: bytes | Path, graph: Path, max_dim: int) -> None:
    data = engine.read_bytes() if isinstance(engine, Path) else engine
    ENGINES[hashlib.sha256(data).hexdigest()] = (Path(graph), max_dim)


class Logger:
    ERROR, WARNING, INFO, VERBOSE = 1, 2, 3, 4

    def __init__(self, severity: int = 2) -> None:
        self.severity = severity


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class EngineValidity(enum.Enum):
    VALID = 0
    SUBOPTIMAL = 1
    INVALID = 2


class IRuntimeCache:
    def __init__(self) -> None:
        self.blob = b""

    def serialize(self) -> bytes:
        return self.blob or b"fake-runtime-cache"

    def deserialize(self, blob) -> bool:
        self.blob = bytes(blob)
        return self.blob.startswith(b"fake-runtime-cache")

    def reset(self) -> bool:
        self.blob = b""
        return True


class IRuntimeConfig:
    def __init__(self) -> None:
        self.cache: IRuntimeCache | None = None

    def create_runtime_cache(self) -> IRuntimeCache:
        return IRuntimeCache()

    def set_runtime_cache(self, cache: IRuntimeCache) -> bool:
        self.cache = cache
        return True

    def get_runtime_cache(self) -> IRuntimeCache | None:
        return self.cache


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def get_engine_validity(self, buffer) -> tuple[EngineValidity, int]:
        known = hashlib.sha256(bytes(buffer)).hexdigest() in ENGINES
        return (EngineValidity.VALID if known else EngineValidity.INVALID, 0)

    def deserialize_cuda_engine(self, data) -> ICudaEngine | None:
        entry = ENGINES.get(hashlib.sha256(bytes(data)).hexdigest())
        if entry is None or not cudart.DEVICES:
            return None
        return ICudaEngine(*entry)


class ICudaEngine:
    def __init__(self, graph: Path, max_dim: int) -> None:
        self.graph, self.max_dim = graph, max_dim
        self.session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        self.inputs = {value.name: value for value in self.session.get_inputs()}
        self.outputs = {value.name: value for value in self.session.get_outputs()}
        self.names = [*self.inputs, *self.outputs]

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT if name in self.outputs else None

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        value = self.inputs.get(name) or self.outputs[name]
        return tuple(d if isinstance(d, int) else -1 for d in value.shape)

    def get_tensor_dtype(self, name: str):
        return np.dtype(_NUMPY[(self.inputs.get(name) or self.outputs[name]).type])

    def create_runtime_config(self) -> IRuntimeConfig:
        return IRuntimeConfig()

    def create_execution_context(self, runtime_config: IRuntimeConfig | None = None) -> IExecutionContext:
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape) -> bool:
        if name not in self.engine.inputs:
            return False
        declared, shape = self.engine.get_tensor_shape(name), tuple(int(d) for d in shape)
        if len(shape) != len(declared):
            return False
        for want, got in zip(declared, shape, strict=True):
            if (want != -1 and got != want) or (want == -1 and not 1 <= got <= self.engine.max_dim):
                return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, pointer: int) -> bool:
        if name not in self.engine.names or cudart.allocation_of(int(pointer), 1) is None:
            return False
        self.addresses[name] = int(pointer)
        return True

    def execute_async_v3(self, stream: int) -> bool:
        engine = self.engine
        if stream not in cudart.STREAMS or set(engine.names) - set(self.addresses):
            return False
        input_addresses = {self.addresses[name] for name in engine.inputs}
        if any(self.addresses[name] in input_addresses for name in engine.outputs):
            return False  # no in-place guarantee: an output on an input's buffer is an error here
        feeds = {}
        for name, value in engine.inputs.items():
            shape = self.shapes.get(name, engine.get_tensor_shape(name))
            if -1 in shape:
                return False  # a dynamic input whose shape was never set
            dtype = np.dtype(_NUMPY[value.type])
            count = int(np.prod(shape)) * dtype.itemsize
            buffer = cudart.allocation_of(self.addresses[name], count)
            if buffer is None:
                return False
            offset = self.addresses[name] - buffer.ctypes.data
            feeds[name] = buffer[offset : offset + count].view(dtype).reshape(shape).copy()
        results = engine.session.run(list(engine.outputs), feeds)
        for name, result in zip(engine.outputs, results, strict=True):
            data = np.ascontiguousarray(result).view(np.uint8).reshape(-1)
            buffer = cudart.allocation_of(self.addresses[name], data.nbytes)
            if buffer is None:
                return False  # the output does not fit the buffer bound to it
            offset = self.addresses[name] - buffer.ctypes.data
            buffer[offset : offset + data.nbytes] = data
        RUNS.append(str(engine.graph))
        return True
