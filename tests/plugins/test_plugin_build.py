"""``edgec build --kv-plugin on`` for a TensorRT-RTX target: the bundle carries the plugin module, the kernel's
PTX for the target's compute capability and its launch record (listed, hashed), the manifest says so, and the
engine is built here, with the plugin layer in it (TensorRT-RTX builds it without a GPU)."""

from __future__ import annotations

import json

import onnx
import pytest

from edgec.build import BuildSettings, build
from edgec.bundle import sha256_file
from tests.conftest import build_settings, manifest

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
pytest.importorskip("triton", reason="the plugin's kernel is compiled by Triton (edgec[dev])")

KV = dict(kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16)


def _sub_op_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    found = []
    for node in graph.node:
        if node.op_type == "CompressedDecodeAttention":
            found.append(node)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found += _sub_op_nodes(attribute.g)
    return found


@pytest.mark.slow
def test_the_bundle_carries_the_plugin(plugin_bundle):
    record = manifest(plugin_bundle)
    plugin = record["runtime"]["plugin"]
    assert plugin == {
        "op": "CompressedDecodeAttention",
        "module": "plugin/compressed_attention.py",
        "ptx": "plugin/compressed_attention.ptx",
        "kernel": "plugin/compressed_attention.json",
        "engine_built": "here",
    }
    assert record["build_settings"]["kv_plugin"] is True
    for name in (plugin["module"], plugin["ptx"], plugin["kernel"]):
        assert record["files"][name]["sha256"] == sha256_file(plugin_bundle / name)
    assert ".target sm_86" in (plugin_bundle / plugin["ptx"]).read_text()
    kernel = json.loads((plugin_bundle / plugin["kernel"]).read_text())
    assert kernel["config"] == {"kv_heads": 2, "per_kv": 2, "head_dim": 16, "storage": "int8", "group": 16,
                                "policy": "snapkv"}  # fmt: skip
    import edgec.plugins.compressed_attention.plugin as source

    assert (plugin_bundle / plugin["module"]).read_bytes() == open(source.__file__, "rb").read()


@pytest.mark.slow
def test_the_graph_keeps_one_sub_op_per_layer_and_its_function(plugin_bundle):
    """Inlined for TensorRT-RTX except the sub-op: each compressed layer's decode branch calls it; its function
    stays (ONNX Runtime validated the bundle with it); the engine holds the plugin layer."""
    model = onnx.load(str(plugin_bundle / "model.onnx"), load_external_data=False)
    nodes = _sub_op_nodes(model.graph)
    assert len(nodes) == 2 and {n.domain for n in nodes} == {"ai.edgec"}
    assert {a.name for a in nodes[0].attribute} == {"scale", "window", "storage", "group", "rule", "decay"}
    assert [(f.domain, f.name) for f in model.functions] == [("ai.edgec", "CompressedDecodeAttention")]
    assert b"CompressedDecodeAttention" in (plugin_bundle / "engine.trt").read_bytes()
    assert manifest(plugin_bundle)["validation"]["top1_agreement"] == 1.0


def test_kv_plugin_off_is_the_standard_pipeline():
    """Off (the default) runs exactly the passes and options of a build that knows no plugin; on adds the kv_plugin
    pass after kv_cache and keeps the sub-op's function through inlining, nothing else."""
    from edgec.kvcache.compression import Compression
    from edgec.pipeline import Choices, passes_for
    from edgec.targets import load_target

    target, kv = load_target("rtx3060"), Compression(capacity=40, dtype="int8", group=16)
    assert BuildSettings().kv_plugin is False
    off_names, off_options = passes_for(Choices(target, "fp16", 128, kv))
    assert "kv_plugin" not in off_names and off_options["inline_functions"] == {}
    on_names, on_options = passes_for(Choices(target, "fp16", 128, kv, kv_plugin=True))
    assert on_names == ["kv_cache", "kv_plugin", *off_names[1:]]
    assert on_options == off_options | {"kv_plugin": {}, "inline_functions": {"keep": ("CompressedDecodeAttention",)}}


def test_kv_plugin_on_elsewhere_is_one_line(tiny_llama, tmp_path):
    from click.testing import CliRunner

    from edgec.cli import main
    from tests.test_cli import assert_clean_failure

    command = ["build", str(tiny_llama), "--target", "cpu", "--kv-capacity", "100", "--kv-plugin", "on"]
    result = CliRunner().invoke(main, [*command, "-o", str(tmp_path / "x")])
    assert_clean_failure(result, "--kv-plugin on", "TensorRT-RTX target")
    assert not (tmp_path / "x").exists()


def test_kv_plugin_needs_a_compressed_cache_on_tensorrt_rtx(tiny_llama, tmp_path):
    from edgec.errors import BuildSettingsError

    with pytest.raises(BuildSettingsError, match="--kv-plugin on"):
        build(tiny_llama, tmp_path / "a", build_settings(target="rtx3060", context=64, kv_plugin=True))
    with pytest.raises(BuildSettingsError, match="--kv-plugin on"):
        build(tiny_llama, tmp_path / "b", build_settings(target="cpu", context=64, kv_plugin=True, **KV))


def test_kv_plugin_refuses_a_rotated_cache(tiny_llama, tmp_path):
    """The kernel reads an unrotated cache: a rotated one would attend over the wrong keys."""
    from edgec.errors import BuildSettingsError

    rotated = {**KV, "kv_rotation": "hadamard"}
    with pytest.raises(BuildSettingsError, match="--kv-rotation"):
        build(tiny_llama, tmp_path / "a", build_settings(target="rtx3060", context=64, kv_plugin=True, **rotated))
    assert not (tmp_path / "a").exists()
