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
    plugin: Path | None = None,
) -> tuple[bytes, dict]:
    """Serialized engine for ``target``'s compute capability; token dims range over 1..max_tokens (decode is 1);
    ``slots``: (capacity, context) of a compressed cache's slot dimension; ``report``: the builder's progress;
    ``plugin``: the bundle folder whose plugin (``runtime.plugin``, edgec.plugin_files) claims its op's nodes —
    built in a child process (``plugin_build_environment``)."""
    if plugin is not None:
        return _build_in_child(onnx_path, target, max_tokens, slots, plugin)
    trt = import_tensorrt_rtx()
    return _build(trt, onnx_path, target, max_tokens, slots, report)


def _build(trt, onnx_path: Path, target: Target, max_tokens: int, slots, report=None, plugin_override=False):
    major, minor = capability(target)
    sm = getattr(trt.ComputeCapability, f"SM{major}{minor}", None)
    if sm is None:
        raise BuildSettingsError(f"TensorRT-RTX {trt.__version__} cannot build for sm{major}{minor} ({target.name})")
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if plugin_override:  # a registered plugin claims the nodes of its op, whose local function stays for ONNX Runtime
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
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


# --- engines with a plugin layer ----------------------------------------------------------------------------
# TensorRT-RTX 1.7.1 builds an engine with a Python IPluginV3 layer on a machine without a GPU (measured: the
# builder calls the plugin's shape, type and format methods only, never enqueue). One quirk: on a plugin node its
# ONNX parser dlopen()s "libtensorrt_rtx.so", a name the wheel does not ship (it has libtensorrt_rtx.so.1), and
# aborts the process when that fails. The engine is therefore built in a child process whose library path holds
# that name as a link to the wheel's library (the dynamic loader reads the path only when a process starts).


def plugin_build_environment(folder: Path) -> dict[str, str]:
    """The environment of the child that builds an engine with a plugin layer: ``folder`` gets the link."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        raise BuildSettingsError(f"building an engine with the cache plugin needs tensorrt-rtx's libraries: {EXTRA}")
    library = Path(spec.submodule_search_locations[0]) / "libtensorrt_rtx.so.1"
    (folder / "libtensorrt_rtx.so").symlink_to(library)
    environment = dict(os.environ)
    environment["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(folder), environment.get("LD_LIBRARY_PATH")]))
    return environment


def _build_in_child(onnx_path: Path, target: Target, max_tokens: int, slots, bundle: Path) -> tuple[bytes, dict]:
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        job = {
            "onnx": str(onnx_path),
            "target": target.name,
            "max_tokens": max_tokens,
            "slots": slots,
            "bundle": str(bundle),
            "out": str(scratch / "engine.trt"),
        }
        command = [sys.executable, "-m", "edgec.trt", json.dumps(job)]
        done = subprocess.run(command, env=plugin_build_environment(scratch), capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildSettingsError(
                f"TensorRT-RTX failed to build the engine with the cache plugin: {done.stderr[-1500:]}"
            )
        return (scratch / "engine.trt").read_bytes(), json.loads((scratch / "engine.json").read_text())


def _child(job: dict) -> None:
    from edgec.plugin_files import register_from_bundle
    from edgec.targets import load_target

    trt = import_tensorrt_rtx()
    register_from_bundle(Path(job["bundle"]))
    slots = tuple(job["slots"]) if job["slots"] else None
    engine, record = _build(trt, Path(job["onnx"]), load_target(job["target"]), job["max_tokens"], slots, None, True)
    Path(job["out"]).write_bytes(engine)
    Path(job["out"]).with_suffix(".json").write_text(__import__("json").dumps(record))


if __name__ == "__main__":  # the child of _build_in_child
    import json
    import sys

    _child(json.loads(sys.argv[1]))
