"""Targets: one TOML file per target beside this file, loaded and validated here (docs/targets.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import tomllib

from edgec.errors import BuildSettingsError

RUNTIMES = ("ort-cpu", "ort-openvino", "ort-cuda", "ort-cann", "tensorrt-rtx", "tensorrt")
DEVICES = ("cpu", "gpu", "npu")


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    device: str
    runtime: str
    memory_bytes: int
    usable_fraction: float
    dtypes: tuple[str, ...]
    passes: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "runtime": self.runtime,
            "memory_bytes": self.memory_bytes,
            "usable_fraction": self.usable_fraction,
            "dtypes": list(self.dtypes),
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
    data = tomllib.loads(files[name].read_text())
    try:
        target = Target(
            name=data["name"],
            description=data["description"],
            device=data["device"],
            runtime=data["runtime"],
            memory_bytes=int(data["memory_bytes"]),
            usable_fraction=float(data["usable_fraction"]),
            dtypes=tuple(data["dtypes"]),
            passes=tuple(data.get("passes", ())),
            defaults=dict(data.get("defaults", {})),
        )
    except KeyError as missing:
        raise BuildSettingsError(f"target file {name}.toml lacks the key {missing}") from None
    if target.runtime not in RUNTIMES or target.device not in DEVICES or not 0 < target.usable_fraction <= 1:
        raise BuildSettingsError(f"target file {name}.toml has an invalid device, runtime or usable_fraction")
    return target
