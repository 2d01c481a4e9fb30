"""The TensorRT-RTX plugin for ``ai.edgec::CompressedDecodeAttention``: a bundle carries this file, its kernel's
PTX and the kernel's launch record; the runtime imports it and calls ``register`` before deserializing the engine
(the build does the same before parsing the graph).

Standalone on purpose (numpy, tensorrt_rtx and cuda-python's driver bindings only): ``enqueue`` launches the PTX
— the Triton kernel of plugins/compressed_attention/kernel.py, compiled at build time for the target's compute
capability — through the CUDA driver API on TensorRT's stream. The node's attributes are the plugin's fields:
``scale`` and ``window`` per layer, and the compression settings the PTX was compiled for (checked).

Inputs (TensorRT's order, the node's): q [B,H,1,D] float, k/v [B,Hkv,1,D] float, position_ids [B,1] int64,
protect [B,1] bool, k_cache/v_cache [B,Hkv,C,Ds] in storage, k_scale/v_scale [B,Hkv,C,D/G] float (quantized
storage only), score [B,Hkv,C] float, pos [B,Hkv,C] int64. Outputs: out [B,1,H,D] float, score_all [B,Hkv,C+1].
"""

from __future__ import annotations

import ctypes

import numpy as np
import tensorrt_rtx as trt

NAME = "CompressedDecodeAttention"
VERSION = "1"
NAMESPACE = ""
STORAGE_TYPES = {0: "FLOAT", 1: "HALF", 2: "INT8", 3: "UINT8", 4: "UINT8"}  # the kernel's storage codes
FIELD_TYPES = {
    "scale": "FLOAT32",
    "window": "INT32",
    "storage": "INT32",
    "group": "INT32",
    "rule": "INT32",
    "decay": "FLOAT32",
}
PARAM_TYPES = {"u64": ctypes.c_void_p, "u32": ctypes.c_uint32, "s32": ctypes.c_int32, "f32": ctypes.c_float}
POINTERS = 13  # q k v position_ids protect k_cache v_cache k_scale v_scale score pos out score_out


class Kernel:
    """The PTX and how to launch it; loaded into the current CUDA context on the first launch."""

    def __init__(self, ptx: bytes, record: dict) -> None:
        self.ptx, self.record = ptx, record
        self.constexprs = record["constexprs"]
        self.params = [PARAM_TYPES[kind] for kind in record["params"]]
        self.function = None
        if record["global_scratch_size"] or record["profile_scratch_size"] or len(self.params) != POINTERS + 6:
            raise ValueError(f"the kernel record does not describe the decode kernel this plugin launches: {record}")

    def driver(self):
        from cuda.bindings import driver

        return driver

    def call(self, function: str, *args):
        error, *values = getattr(self.driver(), function)(*args)
        if int(error) != 0:
            raise RuntimeError(f"{function} failed: {getattr(error, 'name', error)}")
        return values[0] if len(values) == 1 else values

    def launch(self, pointers: list[int], scalars: tuple, grid: int, stream: int) -> None:
        if self.function is None:
            self.call("cuInit", 0)
            module = self.call("cuModuleLoadData", self.ptx + b"\0")
            self.function = self.call("cuModuleGetFunction", module, self.record["name"].encode())
        values = (*pointers, *scalars, 0, 0)  # Triton's global and profile scratch: none
        block = 32 * self.record["num_warps"]
        parameters = (values, tuple(self.params))
        self.call(
            "cuLaunchKernel", self.function, grid, 1, 1, block, 1, 1, self.record["shared"], stream, parameters, 0
        )


def _field(collection, name: str, default):
    for field in collection:
        if field.name == name:
            return np.asarray(field.data).reshape(-1)[0].item()
    return default


class DecodeAttention(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
    def __init__(self, kernel: Kernel, fields: dict) -> None:
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuild.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.plugin_name, self.plugin_version, self.plugin_namespace = NAME, VERSION, NAMESPACE
        self.num_outputs = 2
        self.timing_cache_id = ""
        self.metadata_string = ""
        self.kernel, self.fields = kernel, fields
        constexprs = kernel.constexprs
        compiled_for = {"storage": constexprs["STORAGE"], "group": constexprs["GROUP"], "rule": constexprs["POLICY"]}
        asked = {name: fields[name] for name in compiled_for}
        if asked != compiled_for:
            raise ValueError(f"{NAME}: the node asks for {asked}, the bundle's kernel was compiled for {compiled_for}")
        self.quantized = constexprs["STORAGE"] >= 2
        self.heads = constexprs["KV_HEADS"] * constexprs["PER_KV"]

    # --- core and build ------------------------------------------------------------------------------------------
    def get_capability_interface(self, kind):
        return self

    def clone(self):
        return _alive(DecodeAttention(self.kernel, dict(self.fields)))

    def get_fields_to_serialize(self):
        return trt.PluginFieldCollection(
            [
                trt.PluginField(
                    name,
                    np.array([self.fields[name]], np.float32 if kind == "FLOAT32" else np.int32),
                    getattr(trt.PluginFieldType, kind),
                )
                for name, kind in FIELD_TYPES.items()
            ]
        )

    def input_types(self) -> list:
        storage = getattr(trt.DataType, STORAGE_TYPES[self.kernel.constexprs["STORAGE"]])
        float_, int64 = trt.DataType.FLOAT, trt.DataType.INT64
        scales = [float_, float_] if self.quantized else []
        return [float_, float_, float_, int64, trt.DataType.BOOL, storage, storage, *scales, float_, int64]

    def get_output_data_types(self, input_types):
        return [trt.DataType.FLOAT, trt.DataType.FLOAT]

    def get_output_shapes(self, inputs, shape_inputs, builder):
        q, pos = inputs[0], inputs[-1]
        out = trt.DimsExprs([q[0], q[2], q[1], q[3]])  # [B,T,H,D]; T = 1
        candidates = builder.operation(trt.DimensionOperation.SUM, pos[2], builder.constant(1))
        return [out, trt.DimsExprs([pos[0], pos[1], candidates])]

    def supports_format_combination(self, pos, in_out, num_inputs):
        expected = self.input_types() + [trt.DataType.FLOAT, trt.DataType.FLOAT]
        if num_inputs != len(expected) - 2 or pos >= len(expected):
            return False
        desc = in_out[pos].desc
        return desc.format == trt.TensorFormat.LINEAR and desc.type == expected[pos]

    def configure_plugin(self, inputs, outputs):
        self._check_shapes([desc.desc.dims for desc in inputs])

    def on_shape_change(self, inputs, outputs):
        self._check_shapes([desc.dims for desc in inputs])

    def _check_shapes(self, dims) -> None:
        constexprs = self.kernel.constexprs
        q, k = list(dims[0]), list(dims[1])
        wanted = {"query heads": (q[1], self.heads), "head dim": (q[3], constexprs["HEAD_DIM"])}
        wanted |= {"kv heads": (k[1], constexprs["KV_HEADS"])}
        wrong = {name: got for name, (got, want) in wanted.items() if got not in (-1, want)}
        if wrong:
            raise ValueError(f"{NAME}: the kernel was compiled for another head layout ({wrong})")

    def get_workspace_size(self, inputs, outputs):
        return 0

    def get_valid_tactics(self):
        return []

    def set_tactic(self, tactic):
        pass

    # --- runtime -------------------------------------------------------------------------------------------------
    def attach_to_context(self, context):
        return self.clone()

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
        batch, _, tokens, _ = input_desc[0].dims
        capacity = input_desc[-1].dims[2]
        if tokens != 1:
            raise ValueError(f"{NAME} runs the one-token step; it was given {tokens} tokens")
        pointers = [int(pointer) for pointer in inputs]
        if not self.quantized:  # no scale inputs: the kernel reads none, any pointer will do
            pointers[7:7] = [pointers[-2], pointers[-2]]
        pointers += [int(pointer) for pointer in outputs]
        fields = self.fields
        scalars = (int(capacity), float(fields["scale"]), int(fields["window"]), float(fields["decay"]))
        self.kernel.launch(pointers, scalars, int(batch) * self.kernel.constexprs["KV_HEADS"], int(stream))


class Creator(trt.IPluginCreatorV3One):
    def __init__(self, kernel: Kernel) -> None:
        trt.IPluginCreatorV3One.__init__(self)
        self.name, self.plugin_version, self.plugin_namespace = NAME, VERSION, NAMESPACE
        self.kernel = kernel
        self.field_names = trt.PluginFieldCollection(
            [
                trt.PluginField(name, np.array([]), getattr(trt.PluginFieldType, kind))
                for name, kind in FIELD_TYPES.items()
            ]
        )

    def create_plugin(self, name, fields, phase):
        defaults = {"scale": 1.0, "window": 0, "storage": -1, "group": -1, "rule": -1, "decay": 0.0}
        values = {key: _field(fields, key, default) for key, default in defaults.items()}
        return _alive(DecodeAttention(self.kernel, values))


# TensorRT holds raw pointers to the Python objects it is given: keep every creator and plugin alive
_ALIVE: list = []


def _alive(thing):
    _ALIVE.append(thing)
    return thing


def register(ptx: bytes, record: dict) -> Creator:
    """Register the plugin with TensorRT-RTX's registry, in place of a creator of the same name registered before
    (another bundle's kernel: engines deserialized already keep the plugins they made)."""
    registry = trt.get_plugin_registry()
    old = registry.get_creator(NAME, VERSION, NAMESPACE)
    if old is not None:
        registry.deregister_creator(old)
    creator = _alive(Creator(Kernel(ptx, record)))
    if not registry.register_creator(creator, NAMESPACE):
        raise RuntimeError(f"TensorRT-RTX refused to register the {NAME} plugin")
    return creator
