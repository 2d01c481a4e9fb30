"""TensorRT-RTX: build an engine ahead of time, on a machine without a GPU, for a target's compute capability.

TensorRT-RTX's parser inlines the KVAttention ONNX function, so the engine comes from the same portable graph
that ONNX Runtime runs. The bundle keeps that ONNX beside the engine, so the engine can be rebuilt for another
TensorRT-RTX release (an engine is tied to the release that built it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from edgec.errors import BuildSettingsError
from edgec.kvcache.spec import SLOT_DIM
from edgec.targets import Target, capability

EXTRA = "pip install 'edgec[tensorrt-rtx]'"


def import_tensorrt_rtx():
    try:
        import tensorrt_rtx
    except ImportError:
        raise BuildSettingsError(f"building for a TensorRT-RTX target needs tensorrt-rtx: {EXTRA}") from None
    return tensorrt_rtx


def dynamic_dims(onnx_path: Path) -> dict[str, list[str | None]]:
    """Each graph input's dimension names (None for a fixed dimension), read without the weights."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return {value.name: [dim.dim_param or None for dim in value.type.tensor_type.shape.dim] for value in graph.input}


def profile_range(dim: str | None, max_tokens: int, slots: tuple[int, int] | None) -> tuple[int, int, int]:
    """(min, opt, max) of one dynamic dimension: a compressed cache's slot count runs from 1 to the context (a long
    prompt is read whole before the selection, ``prefill_compress = end``), best at its capacity; every other
    dynamic dimension counts tokens of one step (1 when decoding, up to the prefill chunk)."""
    if dim == SLOT_DIM and slots is not None:
        capacity, context = slots
        return 1, capacity, context
    return 1, 1, max_tokens


def progress_monitor(trt, report: Callable[[str, int, int], None]):
    """A TensorRT-RTX ``IProgressMonitor`` that reports the builder's top-level phases' steps as ``("tensorrt-rtx
    <phase>", done, total)``; nested phases (many, short) are left out. The builder reports a phase's last step by
    finishing it."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.totals: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                self.totals[phase_name] = num_steps
                report(f"tensorrt-rtx {phase_name.lower()}", 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            if phase_name in self.totals:
                report(f"tensorrt-rtx {phase_name.lower()}", step + 1, self.totals[phase_name])
            return True  # never cancels the build

        def phase_finish(self, phase_name: str) -> None:
            if phase_name in self.totals:
                total = self.totals.pop(phase_name)
                report(f"tensorrt-rtx {phase_name.lower()}", total, total)

    return Monitor()


def build_engine(
    onnx_path: Path,
    target: Target,
    max_tokens: int,
    slots: tuple[int, int] | None = None,
    report: Callable[[str, int, int], None] | None = None,
) -> tuple[bytes, dict]:
    """Serialized engine for ``target``'s compute capability; token dims range over 1..max_tokens (decode is 1);
    ``slots``: (capacity, context) of a compressed cache's slot dimension; ``report``: the builder's progress."""
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
    names = dynamic_dims(onnx_path)
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        shape = list(tensor.shape)
        if -1 in shape:
            ranges = [
                profile_range(name, max_tokens, slots) if size == -1 else (size, size, size)
                for size, name in zip(shape, names.get(tensor.name, [None] * len(shape)), strict=True)
            ]
            low, best, high = ([r[i] for r in ranges] for i in range(3))
            profile.set_shape(tensor.name, low, best, high)
    config.add_optimization_profile(profile)
    if report is not None and hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = progress_monitor(trt, report)
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
