"""Graph passes: each a function ``(ir.Model) -> int`` (how many places it changed), one per file.

A target's TOML names the passes it wants, in order (``passes = [...]``); ``run_passes`` applies them.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from edgec.errors import BuildSettingsError
from edgec.passes.float16 import float16
from edgec.passes.fuse_projections import fuse_projections
from edgec.passes.kv_attention_gqa import kv_attention_gqa
from edgec.passes.skip_rms_norm import skip_rms_norm
from edgec.passes.transposed_weight_gemm import transposed_weight_gemm

PASSES: dict[str, Callable[[ir.Model], int]] = {
    "float16": float16,
    "fuse_projections": fuse_projections,
    "kv_attention_gqa": kv_attention_gqa,
    "skip_rms_norm": skip_rms_norm,
    "transposed_weight_gemm": transposed_weight_gemm,
}


def run_passes(model: ir.Model, names: list[str]) -> dict[str, int]:
    """Apply the named passes in order; returns the change count of each (recorded in the manifest)."""
    unknown = [name for name in names if name not in PASSES]
    if unknown:
        raise BuildSettingsError(f"unknown pass(es) {', '.join(unknown)}; known: {', '.join(sorted(PASSES))}")
    return {name: PASSES[name](model) for name in names}
