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

Plugins (IPluginV3 with an IPluginCreatorV3One, TensorRT-RTX's only kind): ``get_plugin_registry`` keeps the
creators a plugin module registers. An engine whose graph has nodes of a registered plugin's op (the parser gives
such a node to the plugin, even over a local function of the same name) is deserialized only while that creator is
registered, and runs with those nodes computed by the plugin, the way TensorRT drives it: a build-phase plugin from
the node's attributes answers output types, shapes (through an expression builder) and each tensor's format and
type, is configured, and gives its fields to serialize; a runtime-phase plugin created from those fields is
attached and told the shapes; its ``enqueue`` gets device pointers (tests.fakes.cudart) for copies of the inputs
and for outputs of the shapes it declared, and TensorRT's stream. The rest of such a graph runs in ONNX's
reference evaluator (ONNX Runtime cannot call back into Python).
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


# --- the plugin API ------------------------------------------------------------------------------------------
class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    INT64 = 10


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW2 = 1


class PluginFieldType(enum.Enum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    INT64 = 10


class TensorRTPhase(enum.Enum):
    BUILD = 0
    RUNTIME = 1


class PluginCapabilityType(enum.Enum):
    CORE = 0
    BUILD = 1
    RUNTIME = 2


class DimensionOperation(enum.Enum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4


class IDimensionExpr:
    def __init__(self, value: int) -> None:
        self.value = int(value)

    def is_constant(self) -> bool:
        return True

    def get_constant_value(self) -> int:
        return self.value


class IExprBuilder:
    OPERATIONS = {"SUM": int.__add__, "PROD": int.__mul__, "MAX": max, "MIN": min, "SUB": int.__sub__}

    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(value)

    def operation(self, op: DimensionOperation, first: IDimensionExpr, second: IDimensionExpr) -> IDimensionExpr:
        if not isinstance(first, IDimensionExpr) or not isinstance(second, IDimensionExpr):
            raise TypeError("IExprBuilder.operation takes IDimensionExpr operands")
        return IDimensionExpr(self.OPERATIONS[op.name](first.value, second.value))


class DimsExprs(list):
    def __init__(self, dims=()) -> None:
        super().__init__(dim if isinstance(dim, IDimensionExpr) else IDimensionExpr(dim) for dim in dims)


class PluginTensorDesc:
    def __init__(self, dims=(), type=DataType.FLOAT, format=TensorFormat.LINEAR) -> None:  # noqa: A002
        self.dims, self.type, self.format, self.scale = tuple(dims), type, format, 1.0


class DynamicPluginTensorDesc:
    def __init__(self, desc: PluginTensorDesc) -> None:
        self.desc, self.min, self.opt, self.max = desc, desc.dims, desc.dims, desc.dims


class PluginField:
    def __init__(self, name: str = "", data=None, type=PluginFieldType.UNKNOWN) -> None:  # noqa: A002
        self.name, self.data, self.type = name, np.asarray(data if data is not None else []), type


class PluginFieldCollection(list):
    pass


class IPluginV3:
    def __init__(self, *args) -> None:
        pass


class IPluginV3OneCore:
    def __init__(self, *args) -> None:
        pass


class IPluginV3OneBuild:
    def __init__(self, *args) -> None:
        pass


class IPluginV3OneRuntime:
    def __init__(self, *args) -> None:
        pass


class IPluginCreatorV3One:
    def __init__(self, *args) -> None:
        pass


class IPluginRegistry:
    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], IPluginCreatorV3One] = {}

    def register_creator(self, creator, namespace: str) -> bool:
        if not isinstance(creator, IPluginCreatorV3One):
            return False  # TensorRT-RTX imports IPluginV3 plugins with an IPluginCreatorV3One creator only
        key = (creator.name, creator.plugin_version, namespace)
        if key in self.creators:
            return False  # one creator per name, version and namespace
        creator.plugin_namespace = namespace
        self.creators[key] = creator
        return True

    def deregister_creator(self, creator) -> bool:
        for key, known in list(self.creators.items()):
            if known is creator:
                del self.creators[key]
                return True
        return False

    def get_creator(self, name: str, version: str, namespace: str = ""):
        return self.creators.get((name, version, namespace))

    @property
    def all_creators(self) -> list:
        return list(self.creators.values())


REGISTRY = IPluginRegistry()


def get_plugin_registry() -> IPluginRegistry:
    return REGISTRY


_NUMPY_TYPES = {
    np.dtype(np.float32): DataType.FLOAT,
    np.dtype(np.float16): DataType.HALF,
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.bool_): DataType.BOOL,
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int64): DataType.INT64,
}
_TYPES_NUMPY = {kind: dtype for dtype, kind in _NUMPY_TYPES.items()}


def _fields_of(node) -> PluginFieldCollection:
    """The node's attributes as the ONNX parser hands them to a creator: ints as INT32, floats as FLOAT32."""
    import onnx

    fields = PluginFieldCollection()
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        if attribute.type == onnx.AttributeProto.INT:
            fields.append(PluginField(attribute.name, np.array([value], np.int32), PluginFieldType.INT32))
        elif attribute.type == onnx.AttributeProto.FLOAT:
            fields.append(PluginField(attribute.name, np.array([value], np.float32), PluginFieldType.FLOAT32))
        else:
            raise ValueError(f"the fake parser passes int and float attributes only, not {attribute.name}")
    return fields


def run_plugin(creator, node, inputs: list[np.ndarray], stream: int) -> list[np.ndarray]:
    """One plugin node, as TensorRT builds and then runs it (see the module docstring)."""
    built = creator.create_plugin(node.name, _fields_of(node), TensorRTPhase.BUILD)
    core = built.get_capability_interface(PluginCapabilityType.CORE)
    build = built.get_capability_interface(PluginCapabilityType.BUILD)
    if (core.plugin_name, core.plugin_version) != (creator.name, creator.plugin_version):
        raise RuntimeError("the plugin's name/version differ from its creator's")
    input_types = [_NUMPY_TYPES[np.asarray(x).dtype] for x in inputs]
    output_types = build.get_output_data_types(input_types)
    shapes = build.get_output_shapes([DimsExprs(np.shape(x)) for x in inputs], [], IExprBuilder())
    if len(output_types) != build.num_outputs or len(shapes) != build.num_outputs:
        raise RuntimeError("the plugin declares another number of outputs than it describes")
    in_desc = [PluginTensorDesc(np.shape(x), kind) for x, kind in zip(inputs, input_types, strict=True)]
    out_desc = [PluginTensorDesc([d.value for d in s], kind) for s, kind in zip(shapes, output_types, strict=True)]
    every = [DynamicPluginTensorDesc(desc) for desc in in_desc + out_desc]
    for pos in range(len(every)):
        if not build.supports_format_combination(pos, every, len(inputs)):
            raise RuntimeError(f"no format/type combination: the plugin refuses tensor {pos} ({every[pos].desc.type})")
    build.configure_plugin(every[: len(inputs)], every[len(inputs) :])
    fields = built.get_fields_to_serialize()  # what the engine keeps of the plugin
    loaded = creator.create_plugin(node.name, PluginFieldCollection(fields), TensorRTPhase.RUNTIME)
    runtime = loaded.get_capability_interface(PluginCapabilityType.RUNTIME).attach_to_context(None)
    runtime.on_shape_change(in_desc, out_desc)
    pointers = []
    for x in inputs:
        data = np.ascontiguousarray(x)
        pointer = cudart.cudaMalloc(data.nbytes)[1]
        cudart.cudaMemcpy(pointer, data.ctypes.data, data.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice)
        pointers.append(pointer)
    outputs = [np.zeros(desc.dims, _TYPES_NUMPY[desc.type]) for desc in out_desc]
    out_pointers = [cudart.cudaMalloc(out.nbytes)[1] for out in outputs]
    try:
        runtime.enqueue(in_desc, out_desc, pointers, out_pointers, 0, stream)
        for out, pointer in zip(outputs, out_pointers, strict=True):
            cudart.cudaMemcpy(out.ctypes.data, pointer, out.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost)
    finally:
        for pointer in pointers + out_pointers:
            cudart.cudaFree(pointer)
    PLUGIN_RUNS.append(node.op_type)
    return outputs


PLUGIN_RUNS: list[str] = []  # the op of every plugin node run (tests check the plugin path ran)
# False: plugin nodes run their ONNX function instead (the same evaluator otherwise), the plugin path's reference
USE_PLUGINS = [True]


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
        engine = ICudaEngine(*entry)
        if engine.missing_plugins:  # TensorRT cannot deserialize a plugin layer whose creator is not registered
            return None
        return engine


class ICudaEngine:
    def __init__(self, graph: Path, max_dim: int) -> None:
        self.graph, self.max_dim = graph, max_dim
        self.session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        self.inputs = {value.name: value for value in self.session.get_inputs()}
        self.outputs = {value.name: value for value in self.session.get_outputs()}
        self.names = [*self.inputs, *self.outputs]
        self.plugin_ops, self.missing_plugins = _plugin_ops(graph)
        self.evaluator = _plugin_evaluator(graph, self.plugin_ops) if self.plugin_ops else None

    def run(self, feeds: dict[str, np.ndarray], stream: int) -> list[np.ndarray]:
        if self.evaluator is None:
            return self.session.run(list(self.outputs), feeds)
        _CURRENT["stream"] = stream
        return self.evaluator.run(list(self.outputs), feeds)

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


_CURRENT: dict[str, int] = {}  # the stream of the run in progress (a plugin enqueues on it)


def _plugin_ops(graph: Path) -> tuple[dict[str, object], set[str]]:
    """The graph's ops that registered plugins claim (op type → creator), and those of domain ai.edgec that no
    registered creator claims (the engine would not deserialize)."""
    import onnx

    def op_types(g) -> set[str]:
        found = set()
        for node in g.node:
            if node.domain == "ai.edgec":
                found.add(node.op_type)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    found |= op_types(attribute.g)
        return found

    wanted = op_types(onnx.load(str(graph), load_external_data=False).graph)
    claimed = {}
    for op in wanted:
        creator = next((c for c in REGISTRY.all_creators if c.name == op), None)
        if creator is not None:
            claimed[op] = creator
    return claimed, wanted - set(claimed)


def _plugin_evaluator(graph: Path, plugin_ops: dict[str, object]):
    """ONNX's reference evaluator over the engine's graph, each plugin node computed by its plugin."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    model = ir.load(graph)
    common.TopologicalSortPass()(model)  # ONNX Runtime takes any node order, the evaluator a sorted one
    proto = ir.serde.serialize_model(ir.external_data.load_to_model(model))

    def plugin_op(op: str, creator):
        def _run(self, *inputs, **attributes):
            return tuple(run_plugin(creator, self.onnx_node, list(inputs), _CURRENT["stream"]))

        return type(op, (OpRun,), {"op_domain": "ai.edgec", "_run": _run})

    operators = [plugin_op(op, creator) for op, creator in plugin_ops.items()] if USE_PLUGINS[0] else []
    return ReferenceEvaluator(proto, new_ops=[*operators, _max_pool_1d(), _gather_elements()])


def _gather_elements():
    """GatherElements by take_along_axis: onnx 1.23's reference one uses numpy.choose, which takes at most 64
    entries along the axis (a prompt read whole into a compressed cache has more)."""
    import onnx
    from onnx.reference.op_run import OpRun

    def _run(self, data, indices, **attributes):
        found = {a.name: onnx.helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        axis = found.get("axis", 0)
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices, axis=axis),)

    return type("GatherElements", (OpRun,), {"op_domain": "", "_run": _run})


def _max_pool_1d():
    """MaxPool over one axis with padding: onnx 1.23's reference MaxPool indexes past the end when padded
    (snapkv's pooling in the compressed op's general body)."""
    import onnx
    from onnx.reference.op_run import OpRun

    def _run(self, x, **attributes):
        found = {a.name: onnx.helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        (kernel,), (stride,) = found["kernel_shape"], found.get("strides", [1])
        if x.ndim != 3 or found.get("dilations", [1]) != [1] or found.get("ceil_mode", 0):
            raise NotImplementedError("the fake's MaxPool pools one axis, without dilation or ceil mode")
        begin, end = found.get("pads", [0, 0])
        padded = np.pad(x, [(0, 0), (0, 0), (begin, end)], constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)[:, :, ::stride]
        return (windows.max(-1).astype(x.dtype),)

    return type("MaxPool", (OpRun,), {"op_domain": "", "_run": _run})


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
            data = cudart.device_bytes(self.addresses[name], count)
            if data is None:
                return False
            feeds[name] = data.view(dtype).reshape(shape).copy()
        results = engine.run(feeds, stream)
        for name, result in zip(engine.outputs, results, strict=True):
            data = np.ascontiguousarray(result).view(np.uint8).reshape(-1)
            target = cudart.device_bytes(self.addresses[name], data.nbytes)
            if target is None:
                return False  # the output does not fit the buffer bound to it
            target[:] = data
        RUNS.append(str(engine.graph))
        return True
