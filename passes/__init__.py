"""Graph passes: each a function ``(ir.Model, **options) -> int`` (how many places it changed), one per file.

A target's TOML names the passes it wants, in order (``passes = [...]``); ``run_passes`` applies them.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from edgec.errors import BuildSettingsError
from edgec.passes.expand_function_ops import expand_function_ops
from edgec.passes.float16 import float16
from edgec.passes.fp8 import fp8
from edgec.passes.fuse_projections import fuse_projections
from edgec.passes.inline_functions import inline_functions
from edgec.passes.int4_weights import int4_weights
from edgec.passes.int8_weights import int8_weights
from edgec.passes.kv_attention_gqa import kv_attention_gqa
from edgec.passes.kv_cache import kv_cache
from edgec.passes.skip_rms_norm import skip_rms_norm
from edgec.passes.static_kv_attention import static_kv_attention
from edgec.passes.static_shapes import static_shapes
from edgec.passes.transposed_weight_gemm import transposed_weight_gemm

PASSES: dict[str, Callable[[ir.Model], int]] = {
    "expand_function_ops": expand_function_ops,
    "float16": float16,
    "fp8": fp8,
    "fuse_projections": fuse_projections,
    "inline_functions": inline_functions,
    "int4_weights": int4_weights,
    "int8_weights": int8_weights,
    "kv_attention_gqa": kv_attention_gqa,
    "kv_cache": kv_cache,
    "skip_rms_norm": skip_rms_norm,
    "static_kv_attention": static_kv_attention,
    "static_shapes": static_shapes,
    "transposed_weight_gemm": transposed_weight_gemm,
}


def run_passes(model: ir.Model, names: list[str], options: dict[str, dict] | None = None) -> dict[str, int]:
    """Apply the named passes in order, each with its ``options[name]`` keywords; returns the change count of
    each (recorded in the manifest)."""
    unknown = [name for name in names if name not in PASSES]
    if unknown:
        raise BuildSettingsError(f"unknown pass(es) {', '.join(unknown)}; known: {', '.join(sorted(PASSES))}")
    options = options or {}
    return {name: PASSES[name](model, **options.get(name, {})) for name in names}
