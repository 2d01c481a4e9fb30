"""The ``--kv-plugin on`` bundle the plugin tests share (a build with the engine and the kernel's PTX: ~30 s)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from tests.conftest import manifest
from tests.fakes import cuda_driver, cudart
from tests.fakes import tensorrt_rtx as fake_trt


@pytest.fixture(scope="session")
def plugin_bundle(tmp_path_factory, tiny_llama):
    from edgec.build import build
    from tests.conftest import build_settings

    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
    pytest.importorskip("triton", reason="the plugin's kernel is compiled by Triton (edgec[dev])")
    out = tmp_path_factory.mktemp("rtx-plugin") / "tiny.rtx3060.plugin.edgec"
    kv = dict(kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16)
    build(tiny_llama, out, build_settings(target="rtx3060", context=128, prefill_chunk=16, kv_plugin=True, **kv))
    return out


@pytest.fixture(scope="session")
def standard_bundle(tmp_path_factory, tiny_llama):
    """The plugin bundle's twin built with --kv-plugin off (the standard-op lowering)."""
    from edgec.build import build
    from tests.conftest import build_settings

    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
    out = tmp_path_factory.mktemp("rtx-standard") / "tiny.rtx3060.standard.edgec"
    kv = dict(kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16)
    build(tiny_llama, out, build_settings(target="rtx3060", context=128, prefill_chunk=16, **kv))
    return out


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """The fake tensorrt_rtx, cuda.bindings.runtime and cuda.bindings.driver; one RTX 3060; no plugin registered."""
    cudart.reset()
    cuda_driver.reset()
    fake_trt.REGISTRY.creators.clear()
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime, bindings.driver = cudart, cuda_driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (
        ("cuda", cuda),
        ("cuda.bindings", bindings),
        ("cuda.bindings.runtime", cudart),
        ("cuda.bindings.driver", cuda_driver),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", fake_trt)
    monkeypatch.setenv("EDGEC_CACHE_DIR", str(tmp_path / "cache"))
    fake_trt.RUNS.clear()
    fake_trt.PLUGIN_RUNS.clear()
    yield
    leaked = cudart.leaked_after_collection()
    fake_trt.REGISTRY.creators.clear()
    cudart.reset()
    assert leaked is None, leaked


def register_plugin_bundle(bundle) -> None:
    """What the real engine and driver know by themselves: the engine's graph, and the kernel the PTX came from."""
    record = manifest(bundle)
    fake_trt.register(bundle / "engine.trt", bundle / "model.onnx", record["model"]["context"])
    plugin = record["runtime"]["plugin"]
    cuda_driver.register((bundle / plugin["ptx"]).read_text(), json.loads((bundle / plugin["kernel"]).read_text()))
