"""The pass table: every shipped target gets the passes its abilities call for, in the declared order, and an
order or a target that would produce a graph the runtime cannot run is refused before any work."""

from __future__ import annotations

import dataclasses

import pytest

from edgec.build import BuildSettings, weight_options
from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.pipeline import PIPELINE, Choices, check_sequence, passes_for
from edgec.targets import available_targets, load_target, parse_target

CPU = ["fuse_projections", "transposed_weight_gemm", "skip_rms_norm", "kv_attention_gqa"]
RTX = ["fuse_projections", "transposed_weight_gemm"]
ASCEND = ["fuse_projections", "transposed_weight_gemm"]
# what each target ran before abilities replaced per-target pass lists (the bundles stay byte-identical)
EXPECTED = {
    ("cpu", "fp32"): CPU,
    ("cpu", "int8"): [*CPU, "int8_weights"],
    ("cpu", "int4"): [*CPU, "int4_weights"],
    ("cpu-portable", "fp32"): ["transposed_weight_gemm"],
    ("cpu-portable", "int4"): ["transposed_weight_gemm", "int4_weights"],
    ("openvino-ipc", "fp32"): ["fuse_projections", "transposed_weight_gemm", "expand_function_ops"],
    ("openvino-ipc", "fp16"): ["fuse_projections", "transposed_weight_gemm", "expand_function_ops", "float16"],
    ("openvino-ipc", "int4"): ["fuse_projections", "transposed_weight_gemm", "expand_function_ops", "int4_weights"],
    ("ascend-910b", "fp16"): [*ASCEND, "float16", "static_kv_attention", "inline_functions"],
    ("ascend-910b", "fp32"): [*ASCEND, "static_kv_attention", "inline_functions"],
    # TensorRT-RTX targets inline KVAttention here since the compressed cache came to them (issue 14)
    ("rtx3060", "fp16"): [*RTX, "float16", "inline_functions"],
    ("rtx3060", "fp32"): [*RTX, "inline_functions"],
    ("rtx3060", "int4"): [*RTX, "int4_weights", "float16", "inline_functions"],
    ("rtx4090", "fp8"): ["fuse_projections", "fp8", "transposed_weight_gemm", "float16", "inline_functions"],
}


def _passes(target: str, weights: str, kv: Compression | None = None) -> list[str]:
    spec = load_target(target)
    options = weight_options(spec, BuildSettings(weights=weights), weights)
    return passes_for(Choices(spec, weights, 512, kv, options))[0]


@pytest.mark.parametrize("target,weights", sorted(EXPECTED))
def test_targets_get_the_passes_they_always_had(target, weights):
    assert _passes(target, weights) == EXPECTED[(target, weights)]


def test_the_compressed_cache_comes_first_and_only_where_the_target_builds_it():
    kv = Compression(capacity=256, dtype="int8")
    assert _passes("cpu", "fp32", kv) == ["kv_cache", *CPU]
    with pytest.raises(BuildSettingsError, match="static shapes"):
        _passes("ascend-910b", "fp16", kv)
    assert _passes("rtx3060", "fp16", kv) == ["kv_cache", *RTX, "float16", "inline_functions"]
    _, options = passes_for(Choices(load_target("rtx3060"), "fp16", 512, kv, {}))
    assert options["kv_cache"]["data_dependent_shapes"] is False  # the every-slot body TensorRT-RTX builds


@pytest.mark.parametrize("target", available_targets())
def test_every_target_file_assembles_for_each_buildable_weight(target):
    spec = load_target(target)
    if not spec.buildable:
        pytest.skip(f"{target} is planned for, not built")
    for weights in spec.dtypes:
        try:
            options = weight_options(spec, BuildSettings(weights=weights), weights)
        except BuildSettingsError:
            continue  # a weight format the target lists but edgec does not build for it (said in one line)
        names, _ = passes_for(Choices(spec, weights, 512, None, options))
        order = [row.name for row in PIPELINE]
        assert names == sorted(names, key=order.index)


@pytest.mark.parametrize(
    "names,needle",
    [
        (["float16", "int4_weights"], "int4_weights cannot run here"),  # it rounds fp32 weights
        (["transposed_weight_gemm", "fp8"], "fp8 cannot run here"),  # it reads MatMul weights
        (["kv_attention_gqa", "kv_cache"], "kv_cache cannot run here"),  # every global layer must be KVAttention
        (["inline_functions", "static_kv_attention"], "static_kv_attention cannot run here"),
    ],
)
def test_a_misordered_sequence_is_refused_with_the_reason(names, needle):
    with pytest.raises(BuildSettingsError, match=needle):
        check_sequence(names, load_target("cpu"))


def test_the_finished_graph_must_be_one_the_target_runs():
    portable = load_target("cpu-portable")
    bare = dataclasses.replace(portable, abilities=dataclasses.replace(portable.abilities, domains=()))
    with pytest.raises(BuildSettingsError, match="com.microsoft"):
        check_sequence(["skip_rms_norm"], bare)  # ONNX Runtime's contrib op on a standard-ONNX runtime
    with pytest.raises(BuildSettingsError, match="com.microsoft"):
        check_sequence(["int4_weights"], bare, weight_form="matmulnbits")
    ascend = load_target("ascend-910b")
    with pytest.raises(BuildSettingsError, match="no model-local functions"):
        check_sequence(["static_kv_attention"], ascend)
    openvino = load_target("openvino-ipc")
    with pytest.raises(BuildSettingsError, match="opset 22"):
        check_sequence(["fuse_projections"], openvino)


def _target_data(**changes) -> dict:
    data = {
        "name": "box",
        "description": "a new box",
        "device": "cpu",
        "runtime": "ort-cpu",
        "memory_bytes": 4 << 30,
        "usable_fraction": 0.5,
        "dtypes": ["fp32", "int4"],
        "optimizations": ["fuse_projections"],
        "abilities": {"domains": ["com.microsoft"], "attention": "gqa", "weight_forms": ["matmulnbits"]},
    }
    return data | changes


def test_a_new_target_is_data():
    box = parse_target("box", _target_data())
    options = weight_options(box, BuildSettings(weights="int4"), "int4")
    assert passes_for(Choices(box, "int4", 512, None, options))[0] == [
        "fuse_projections",
        "kv_attention_gqa",
        "int4_weights",
    ]
    with pytest.raises(BuildSettingsError, match="unknown abilities"):
        parse_target("box", _target_data(abilities={"flash": True}))
    with pytest.raises(BuildSettingsError, match="abilities.attention 'paged'"):
        parse_target("box", _target_data(abilities={"attention": "paged"}))
    with pytest.raises(BuildSettingsError, match="unknown optimizations"):
        target = parse_target("box", _target_data(optimizations=["magic"]))
        passes_for(Choices(target, "fp32", 512))
