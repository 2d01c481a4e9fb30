"""TensorRT-RTX: build an engine ahead of time, on a machine without a GPU, for a target's compute capability.

TensorRT-RTX's parser inlines the KVAttention ONNX function, so the engine comes from the same portable graph
that ONNX Runtime runs. The bundle keeps that ONNX beside the engine, so the engine can be rebuilt for another
TensorRT-RTX release (an engine is tied to the release that built it).
"""

from __future__ import annotations

import time
from pathlib import Path

from edgec.errors import BuildSettingsError
from edgec.targets import Target, capability

EXTRA = "pip install 'edgec[tensorrt-rtx]'"


def import_tensorrt_rtx():
    try:
        import tensorrt_rtx
    except ImportError:
        raise BuildSettingsError(f"building for a TensorRT-RTX target needs tensorrt-rtx: {EXTRA}") from None
    return tensorrt_rtx


def build_engine(onnx_path: Path, target: Target, max_tokens: int) -> tuple[bytes, dict]:
    """Serialized engine for ``target``'s compute capability; token dims range over 1..max_tokens (decode is 1)."""
    trt = import_tensorrt_rtx()
    major, minor = capability(target)
    sm = getattr(trt.ComputeCapability, f"SM{major}{minor}", None)
    if sm is None:
        raise BuildSettingsError(f"TensorRT-RTX {trt.__version__} cannot build for sm{major}{minor} ({target.name})")
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildSettingsError(f"TensorRT-RTX could not parse the graph: {errors}")
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(sm, 0)
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        shape = list(tensor.shape)
        if -1 in shape:
            low, best, high = (
                [1 if d == -1 else d for d in shape],
                [1 if d == -1 else d for d in shape],
                [max_tokens if d == -1 else d for d in shape],
            )
            profile.set_shape(tensor.name, low, best, high)
    config.add_optimization_profile(profile)
    start = time.perf_counter()
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise BuildSettingsError(f"TensorRT-RTX failed to build an engine for {target.name}")
    return bytes(engine), {
        "library": "tensorrt_rtx",
        "version": trt.__version__,
        "compute_capability": f"{major}.{minor}",
        "engine_build_s": round(time.perf_counter() - start, 2),
        "max_tokens_per_step": max_tokens,
    }
