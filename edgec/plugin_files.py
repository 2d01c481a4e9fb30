"""The compressed cache's TensorRT-RTX plugin in a bundle (``edgec build --kv-plugin on``): its files, written by
the build and registered by whoever deserializes or builds the engine.

    plugin/compressed_attention.py     the plugin module (plugins/compressed_attention/plugin.py, byte for byte)
    plugin/compressed_attention.ptx    its kernel, compiled by Triton for the target's compute capability
    plugin/compressed_attention.json   the kernel's launch record (entry, parameters, warps, shared memory, config)

The manifest's ``runtime.plugin`` names them. A bundle must not run code (docs/security.md): the module is
imported only when its bytes are the plugin module of the edgec doing the import (same sha256) — a bundle from
another edgec release is refused with one line, like an engine from another TensorRT-RTX release. The PTX is GPU
code, as the engine itself is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from edgec.errors import BundleError

OP = "CompressedDecodeAttention"
MODULE = "plugin/compressed_attention.py"
PTX = "plugin/compressed_attention.ptx"
KERNEL = "plugin/compressed_attention.json"
ENGINE_BUILT = "here"  # TensorRT-RTX builds the engine with the plugin layer without a GPU (edgec/trt.py)


def _installed_module() -> Path:
    spec = importlib.util.find_spec("edgec.plugins.compressed_attention")
    if spec is None or not spec.submodule_search_locations:
        raise BundleError("this edgec has no plugins package; reinstall edgec")
    return Path(spec.submodule_search_locations[0]) / "plugin.py"


def write_plugin(folder: Path, compression, shape, target) -> dict[str, Any]:
    """Compile the kernel for ``target`` and write the plugin's files into ``folder``; returns ``runtime.plugin``."""
    from edgec.plugins.compressed_attention.kernel import Config, compile_ptx
    from edgec.targets import capability

    major, minor = capability(target)
    config = Config(shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim, compression.dtype,
                    compression.group, compression.policy)  # fmt: skip
    compiled = compile_ptx(config, [f"{major}.{minor}"])[f"{major}.{minor}"]
    (folder / "plugin").mkdir(exist_ok=True)
    (folder / MODULE).write_bytes(_installed_module().read_bytes())
    (folder / PTX).write_text(compiled.ptx)
    (folder / KERNEL).write_text(json.dumps(compiled.record, indent=2, sort_keys=True) + "\n")
    return {"op": OP, "module": MODULE, "ptx": PTX, "kernel": KERNEL, "engine_built": ENGINE_BUILT}


def register_from_bundle(folder: Path, record: dict[str, Any] | None = None):
    """Import the bundle's plugin module (only if it is this edgec's own) and register it with TensorRT-RTX."""
    from edgec.bundle import listed_file, read_json

    record = record or {"module": MODULE, "ptx": PTX, "kernel": KERNEL}
    module_path = listed_file(folder, record["module"])  # a regular file inside the bundle, through no link
    data = module_path.read_bytes()
    if hashlib.sha256(data).digest() != hashlib.sha256(_installed_module().read_bytes()).digest():
        raise BundleError(
            f"{record['module']} is not this edgec's cache plugin (another release, or changed): a bundle runs no "
            "code of its own; rebuild the bundle with this edgec"
        )
    spec = importlib.util.spec_from_file_location("edgec_bundle_plugin_compressed_attention", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = read_json(folder / record["kernel"])
    return module.register((folder / record["ptx"]).read_bytes(), kernel)
