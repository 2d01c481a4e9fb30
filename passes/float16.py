"""All float32 weights, activations and cache state → float16 (GPU and NPU targets compute in fp16).

Uses ONNX Runtime's float16 converter (onnxruntime.transformers.float16), which keeps ops that have no fp16 form
in fp32 behind Casts. Inputs and outputs become fp16 too: the cache state halves, and the runtime reads the
logits' dtype from the graph. The KVAttention function body needs no change: its constants are CastLike'd to
whatever type flows in.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from edgec.kvcache.spec import CacheSpec
from edgec.passes._contract import Pass
from edgec.passes._graph import replace_contents


def float16(model: ir.Model, spec: CacheSpec) -> tuple[int, CacheSpec]:
    """Rewrite in place; returns how many float32 initializers became float16, and the spec with fp16 plain
    layers."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    before = sum(v.dtype == ir.DataType.FLOAT for v in model.graph.initializers.values())
    proto = convert_float_to_float16(ir.serde.serialize_model(model), keep_io_types=False, disable_shape_infer=True)
    replace_contents(model, proto)
    return before, dataclasses.replace(spec, dtype="float16")


# quantizing passes read fp32 weights: they come first
PASS = Pass(
    "float16",
    float16,
    requires=frozenset({"fp32"}),
    ensures=frozenset({"fp16"}),
    removes=frozenset({"fp32"}),
    cache=True,
)
