"""Which graph passes a build runs, in which order: one table.

Every pass that can run appears once below, in the order passes run; its condition reads the target's abilities
(targets/*.toml) and the build's choices. Each pass declares what it needs from the graph and what it leaves
(``PASS`` in its file; passes/_contract.py); ``passes_for`` checks the chosen sequence against those
declarations and the finished graph against the target before anything runs, so a table edit that puts a pass
where it cannot work is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.targets import Target

OPTIONAL = ("fuse_projections", "transposed_weight_gemm", "skip_rms_norm")  # a target's `optimizations`


@dataclass(frozen=True)
class Choices:
    """What decides a build's passes: the target and the settings the build resolved."""

    target: Target
    weights: str  # fp32, fp16, fp8, int8, int4
    context: int
    kv: Compression | None = None  # resolved (capacity set) when the compressed cache is asked for
    weight_options: dict[str, Any] = field(default_factory=dict)  # the int4/int8 pass's keywords
    kv_plugin: bool = False  # the compressed op's one-token step goes to the TensorRT-RTX plugin

    @property
    def fp16_compute(self) -> bool:
        return self.weights == "fp16" or (self.target.abilities.compute == "fp16" and self.weights != "fp32")


@dataclass(frozen=True)
class Row:
    name: str  # the pass (passes/NAME.py)
    when: Callable[[Choices], bool]
    why_here: str
    options: Callable[[Choices], dict[str, Any]] = lambda choices: {}


def _optional(name: str) -> Callable[[Choices], bool]:
    return lambda choices: name in choices.target.optimizations


PIPELINE: tuple[Row, ...] = (
    Row(
        "kv_cache",
        lambda c: c.kv is not None,
        "first: it needs every global layer still a KVAttention node",
        lambda c: {
            "compression": c.kv,
            "data_dependent_shapes": c.target.abilities.data_dependent_shapes,
            "fused_attention": c.target.abilities.attention == "gqa",  # ONNX Runtime's fused kernel for prompts
        },
    ),
    Row(
        "kv_plugin",
        lambda c: c.kv is not None and c.kv_plugin,
        "right after kv_cache: it replaces the function kv_cache attached, before any pass reads it",
    ),
    Row("fuse_projections", _optional("fuse_projections"), "reads the exported MatMul projections"),
    Row("fp8", lambda c: c.weights == "fp8", "reads fp32 MatMul weights: before the lm_head becomes a Gemm"),
    Row("transposed_weight_gemm", _optional("transposed_weight_gemm"), "after every pass that reads MatMul weights"),
    Row("skip_rms_norm", _optional("skip_rms_norm"), "any time before a dtype change; kept beside the others"),
    Row(
        "kv_attention_gqa",
        lambda c: c.target.abilities.attention == "gqa",
        "after kv_cache: it lowers only the layers left uncompressed",
        lambda c: {"context": c.context},  # ring caches (capacity < context) keep the function body
    ),
    Row(
        "expand_function_ops",
        lambda c: c.target.abilities.onnx_opset < 23,
        "any time before inlining; its expansions are folded by the optimizer",
    ),
    Row(
        "int8_weights",
        lambda c: c.weights == "int8",
        "reads fp32 weights (Gemm too): before the fp16 conversion",
        lambda c: c.weight_options,
    ),
    Row(
        "int4_weights",
        lambda c: c.weights == "int4",
        "reads fp32 weights (Gemm too): before the fp16 conversion",
        lambda c: c.weight_options,
    ),
    Row("float16", lambda c: c.fp16_compute, "after every pass that reads fp32 weights"),
    Row(
        "static_kv_attention",
        lambda c: c.target.abilities.attention == "static",
        "replaces KVAttention's function body: before inlining",
    ),
    Row(
        "inline_functions",
        lambda c: not c.target.abilities.local_functions,
        "last: after every function change",
        lambda c: {"keep": ("CompressedDecodeAttention",)} if c.kv_plugin else {},  # the plugin's node stays
    ),
)


def passes_for(choices: Choices) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The passes of a build, in order, with their options; refused when the sequence breaks a pass's needs or
    leaves the target a graph it cannot run."""
    target = choices.target
    if unknown := sorted(set(target.optimizations) - set(OPTIONAL)):
        raise BuildSettingsError(f"target {target.name}: unknown optimizations {unknown}; known: {', '.join(OPTIONAL)}")
    if choices.kv is not None and not target.abilities.compressed_cache:
        reason = "it needs static shapes" if target.static_shapes else f"{target.runtime} takes the plain cache"
        raise BuildSettingsError(
            f"the compressed cache (--kv-*) does not build for {target.name} yet: {reason}; "
            "use the plain cache (--context) there"
        )
    rows = [row for row in PIPELINE if row.when(choices)]
    names = [row.name for row in rows]
    check_sequence(names, target, choices.weight_options.get("form"))
    return names, {row.name: row.options(choices) for row in rows}


def check_sequence(names: list[str], target: Target, weight_form: str | None = None) -> None:
    """Every pass finds what it requires; every domain the graph ends up using is one the target executes."""
    from edgec.passes import PASSES
    from edgec.passes._contract import EXPORTED

    properties = EXPORTED
    domains: set[str] = set()
    for name in names:
        declared = PASSES[name]
        if missing := sorted(declared.requires - properties):
            raise BuildSettingsError(
                f"pass {name} cannot run here for {target.name}: it needs {', '.join(missing)}, which the passes "
                f"before it ({', '.join(names[: names.index(name)]) or 'none'}) do not leave"
            )
        properties = declared.after(properties)
        domains |= set(declared.domains)
    if weight_form == "matmulnbits":
        domains.add("com.microsoft")
    if unsupported := sorted(domains - set(target.abilities.domains)):
        raise BuildSettingsError(f"{target.name} cannot run ops of {', '.join(unsupported)} ({', '.join(names)})")
    if "opset23_ops" in properties and target.abilities.onnx_opset < 23:
        raise BuildSettingsError(f"{target.name} runs ONNX ops up to opset {target.abilities.onnx_opset} only")
    if "local_functions" in properties and not target.abilities.local_functions:
        raise BuildSettingsError(f"{target.name} takes no model-local functions, and no pass inlines them")
    if target.static_shapes and "kv_attention" in properties:
        raise BuildSettingsError(f"{target.name} needs static shapes; KVAttention keeps its dynamic body")
