"""Targets: one TOML file per target beside this file, loaded and validated here (docs/targets.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

import tomllib

from edgec.errors import BuildSettingsError

RUNTIMES = ("ort-cpu", "ort-openvino", "ort-cuda", "ort-cann", "tensorrt-rtx", "tensorrt")
# the runtimes edgec builds for (the others are planned for only; a target may also stay plan-only: `plan_only`)
BUILDABLE_RUNTIMES = ("ort-cpu", "ort-openvino", "ort-cuda", "ort-cann", "tensorrt-rtx")
# the ONNX Runtime execution provider each ORT runtime asks for (never silently another)
ORT_PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-openvino": "OpenVINOExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-cann": "CANNExecutionProvider",
}
# the oldest ONNX Runtime each ORT runtime's graphs run on: the first onnxruntime-gpu with CUDA kernels for
# RMSNormalization-23 and RotaryEmbedding-23 is 1.23 (1.22's would leave them to the CPU); the rest: 1.20
ORT_MIN_VERSIONS = {"ort-cuda": "1.23"}
DEVICES = ("cpu", "gpu", "npu")
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
FP8_FROM = (8, 9)  # FP8 tensor cores arrive with Ada (sm89)


ATTENTION = ("gqa", "function", "static")
WEIGHT_FORMS = ("matmulnbits", "qdq")
COMPUTE = ("fp32", "fp16")
ENGINES = ("tensorrt-rtx",)


@dataclass(frozen=True)
class Abilities:
    """What a target's runtime can execute; the build chooses its passes from these (edgec.pipeline)."""

    domains: tuple[str, ...] = ()  # op domains beyond standard ONNX it executes (com.microsoft: ORT's contrib ops)
    onnx_opset: int = 23  # the newest standard ONNX opset whose ops it executes (older: opset-23 ops expanded)
    attention: str = "function"  # plain KVAttention: gqa (ORT's fused kernel), function (its body), static
    local_functions: bool = True  # False: every model-local function is inlined
    weight_forms: tuple[str, ...] = ("qdq",)  # quantized weights: matmulnbits (ORT kernel), qdq (DequantizeLinear)
    zero_points: bool = True  # False: INT4 DequantizeLinear without zero points (symmetric) only
    compressed_cache: bool = False  # builds the compressed cache (--kv-*)
    # False: every tensor's shape must follow from the input shapes (no If whose branches slice by data, no Slice
    # ending where the cache's contents say): the compressed op then attends over every slot (TensorRT-RTX)
    data_dependent_shapes: bool = True
    compute: str = "fp32"  # activations' dtype unless fp32 weights are asked for
    engine: str | None = None  # an engine built ahead of time from the graph
    static_shapes: bool = False  # two fixed-shape graphs (prefill chunk, one-token decode) instead of one dynamic


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    device: str
    runtime: str
    memory_bytes: int
    usable_fraction: float
    dtypes: tuple[str, ...]
    runtime_overhead_bytes: int = 0
    compute_capability: str | None = None
    abilities: Abilities = field(default_factory=lambda: Abilities())
    optimizations: tuple[str, ...] = ()  # optional graph passes it asks for (fusions); edgec.pipeline orders them
    defaults: dict[str, Any] = field(default_factory=dict)
    provider_options: dict[str, str] = field(default_factory=dict)  # for the execution provider, as ORT takes them
    plan_only: str | None = None  # why this target is planned for but not built, though its runtime builds elsewhere

    @property
    def static_shapes(self) -> bool:
        return self.abilities.static_shapes

    @property
    def usable_bytes(self) -> int:
        """What the model (weights + cache + activations) may use: the usable share less the runtime's own."""
        return int(self.memory_bytes * self.usable_fraction) - self.runtime_overhead_bytes

    @property
    def buildable(self) -> bool:
        return self.runtime in BUILDABLE_RUNTIMES and self.plan_only is None

    @property
    def unbuildable_reason(self) -> str:
        """Why ``edgec build`` refuses this target (only meaningful when not ``buildable``)."""
        return self.plan_only or f"no {self.runtime} build yet"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "runtime": self.runtime,
            "memory_bytes": self.memory_bytes,
            "usable_fraction": self.usable_fraction,
            "dtypes": list(self.dtypes),
            "compute_capability": self.compute_capability,
        }


def _target_files() -> dict[str, Any]:
    return {
        entry.name[: -len(".toml")]: entry
        for entry in resources.files(__name__).iterdir()
        if entry.name.endswith(".toml")
    }


def available_targets() -> list[str]:
    return sorted(_target_files())


def load_target(name: str) -> Target:
    files = _target_files()
    if name not in files:
        raise BuildSettingsError(f"unknown target {name!r}; available: {', '.join(sorted(files))}")
    try:
        data = tomllib.loads(files[name].read_text())
    except tomllib.TOMLDecodeError as error:
        raise BuildSettingsError(f"target file {name}.toml is not valid TOML: {error}") from None
    return parse_target(name, data)


def parse_target(name: str, data: dict[str, Any]) -> Target:
    """Validate one target's data; every problem is a BuildSettingsError naming the file and the key."""
    where = f"target file {name}.toml"
    try:
        target = Target(
            name=data["name"],
            description=data["description"],
            device=data["device"],
            runtime=data["runtime"],
            memory_bytes=int(data["memory_bytes"]),
            usable_fraction=float(data["usable_fraction"]),
            dtypes=tuple(data["dtypes"]),
            runtime_overhead_bytes=int(data.get("runtime_overhead_bytes", 0)),
            compute_capability=data.get("compute_capability"),
            abilities=_abilities(data.get("abilities", {})),
            optimizations=tuple(data.get("optimizations", ())),
            defaults=dict(data.get("defaults", {})),
            provider_options={str(k): str(v) for k, v in data.get("provider_options", {}).items()},
            plan_only=data.get("plan_only"),
        )
    except KeyError as missing:
        raise BuildSettingsError(f"{where} lacks the key {missing}") from None
    except (TypeError, ValueError) as error:
        raise BuildSettingsError(f"{where} has a value of the wrong type ({error})") from None
    problems = []
    if target.name != name:
        problems.append(f"name {target.name!r} differs from the file name")
    if target.device not in DEVICES:
        problems.append(f"device {target.device!r} is not one of {', '.join(DEVICES)}")
    if target.runtime not in RUNTIMES:
        problems.append(f"runtime {target.runtime!r} is not one of {', '.join(RUNTIMES)}")
    if not 0 < target.usable_fraction <= 1:
        problems.append("usable_fraction must lie in (0, 1]")
    if target.usable_bytes <= 0:
        problems.append("runtime_overhead_bytes leaves no usable memory")
    if unknown := sorted(set(target.dtypes) - set(DTYPES)):
        problems.append(f"unknown dtypes {unknown}")
    if target.device == "gpu" and not target.compute_capability:
        problems.append("a gpu target needs compute_capability")
    if target.plan_only is not None and (not isinstance(target.plan_only, str) or not target.plan_only.strip()):
        problems.append("plan_only must be a sentence saying why the target is not built")
    if target.provider_options and target.runtime not in ORT_PROVIDERS:
        problems.append(f"provider_options apply to ONNX Runtime targets, not {target.runtime}")
    if "fp8" in target.dtypes and capability(target) < FP8_FROM:
        problems.append(f"fp8 needs compute capability ≥ {FP8_FROM[0]}.{FP8_FROM[1]}")
    abilities = target.abilities
    for name, value, allowed in (
        ("attention", abilities.attention, ATTENTION),
        ("compute", abilities.compute, COMPUTE),
        ("engine", abilities.engine, (None, *ENGINES)),
    ):
        if value not in allowed:
            problems.append(f"abilities.{name} {value!r} is not one of {', '.join(map(str, allowed))}")
    if unknown := sorted(set(abilities.weight_forms) - set(WEIGHT_FORMS)):
        problems.append(f"unknown abilities.weight_forms {unknown}")
    if abilities.engine and target.runtime != abilities.engine:
        problems.append(f"an engine of {abilities.engine} needs runtime {abilities.engine!r}")
    for key in ("weights", "kv"):
        if key in target.defaults and target.defaults[key] not in target.dtypes:
            problems.append(f"defaults.{key} {target.defaults[key]!r} is not among its dtypes")
    if problems:
        raise BuildSettingsError(f"{where}: {'; '.join(problems)}")
    return target


def _abilities(data: dict[str, Any]) -> Abilities:
    known = {f.name for f in fields(Abilities)}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"unknown abilities {unknown}; known: {', '.join(sorted(known))}")
    values = {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}
    return Abilities(**values)


def capability(target: Target) -> tuple[int, int]:
    """(major, minor) compute capability; (0, 0) for a target without one."""
    if not target.compute_capability:
        return (0, 0)
    major, _, minor = str(target.compute_capability).partition(".")
    return int(major), int(minor or 0)
