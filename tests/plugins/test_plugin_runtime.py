"""A ``--kv-plugin on`` bundle through the TensorRT-RTX backend without a GPU: tests/fakes stand in for
tensorrt_rtx, the CUDA runtime and the CUDA driver. The backend imports the bundle's plugin module and registers
it; the fake engine hands every plugin node to that plugin the way TensorRT does (types, shapes, formats, fields
serialized and read back, enqueue on device pointers); the plugin launches the bundle's PTX through the driver;
the fake driver runs the kernel that PTX was compiled from in Triton's interpreter. So a plugin that declares a
wrong shape or type, serializes a field wrongly, or passes a pointer, a scalar or the grid wrongly fails here."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edgec.errors import BundleError
from edgec.runtime import Model
from tests.conftest import pydoc_text
from tests.fakes import cuda_driver
from tests.fakes import tensorrt_rtx as fake_trt
from tests.plugins.conftest import register_plugin_bundle as _register

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
pytest.importorskip("triton", reason="the plugin's kernel is compiled by Triton (edgec[dev])")

pytestmark = pytest.mark.slow  # the bundle's build (~30 s) and the reference evaluator's steps


def _decode_logits(model: Model, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    from tests.test_tensorrt_rtx_runtime import _generation_logits

    return _generation_logits(model, ids, tokens)


def _without_plugin(bundle, monkeypatch) -> Model:
    """The same engine in the same fake, its plugin nodes computed by their ONNX function (standard ops)."""
    monkeypatch.setattr(fake_trt, "USE_PLUGINS", [False])
    model = Model.load(bundle)
    monkeypatch.setattr(fake_trt, "USE_PLUGINS", [True])
    return model


def test_decode_steps_run_the_plugin_and_give_the_graphs_tokens(plugin_bundle, fake_gpu, monkeypatch):
    """Prefill runs the general body; every one-token step runs the plugin, which launches the kernel once per
    compressed layer; tokens equal those of the same engine with the sub-op run as its function of standard ops,
    and the logits agree within fp16 (the graph computes in fp16 around the op)."""
    _register(plugin_bundle)
    graph = _without_plugin(plugin_bundle, monkeypatch)
    model = Model.load(plugin_bundle)
    text = pydoc_text()
    for prompt in (text[:60], text[1000:1250]):  # decoding past the capacity (40), and a prompt longer than it
        ids = model.encode(prompt)
        fake_trt.PLUGIN_RUNS.clear()
        cuda_driver.LAUNCHES.clear()
        got = list(model.generate_ids(ids, max_new_tokens=12))
        assert got == list(graph.generate_ids(ids, max_new_tokens=12))
        steps = len(got) - 1  # the first token comes from the prompt
        assert fake_trt.PLUGIN_RUNS == ["CompressedDecodeAttention"] * 2 * steps
        assert len(cuda_driver.LAUNCHES) == 2 * steps and {launch["grid"] for launch in cuda_driver.LAUNCHES} == {2}
        for ours, theirs in zip(_decode_logits(model, ids, got), _decode_logits(graph, ids, got), strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-2, rtol=0)


def test_a_wrong_plugin_is_caught(plugin_bundle, fake_gpu, monkeypatch):
    """The same bundle with a plugin that swaps two pointers (k and v slots) in its launch: the logits leave the
    graph's. The fake runs what the plugin launches, so the test above could fail."""
    _register(plugin_bundle)
    model = Model.load(plugin_bundle)
    creator = fake_trt.REGISTRY.get_creator("CompressedDecodeAttention", "1", "")
    launch = creator.kernel.launch

    def swapped(pointers, scalars, grid, stream):
        pointers = list(pointers)
        pointers[5], pointers[6] = pointers[6], pointers[5]
        return launch(pointers, scalars, grid, stream)

    creator.kernel.launch = swapped
    graph = _without_plugin(plugin_bundle, monkeypatch)
    ids = model.encode(pydoc_text()[:60])
    tokens = list(graph.generate_ids(ids, max_new_tokens=4))
    ours, theirs = _decode_logits(model, ids, tokens), _decode_logits(graph, ids, tokens)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours[1:], theirs[1:], strict=True)) > 0.1


def test_another_plugin_module_is_refused(plugin_bundle, fake_gpu, tmp_path):
    """A bundle runs no code of its own: a plugin module other than this edgec's is refused in one line, before
    anything is imported — even with the manifest's hash updated to match it."""
    from edgec.bundle import sha256_file

    copy = tmp_path / "changed.edgec"
    shutil.copytree(plugin_bundle, copy)
    module = copy / "plugin" / "compressed_attention.py"
    module.write_text(module.read_text() + "\nraise SystemExit('ran bundle code')\n")
    record = json.loads((copy / "manifest.json").read_text())
    record["files"]["plugin/compressed_attention.py"] = {"size": module.stat().st_size, "sha256": sha256_file(module)}
    (copy / "manifest.json").write_text(json.dumps(record))
    _register(copy)
    with pytest.raises(BundleError, match="not this edgec's cache plugin"):
        Model.load(copy)


def test_the_engine_needs_the_plugin_registered(plugin_bundle, fake_gpu):
    """Without the plugin's creator the engine does not deserialize (as TensorRT): the backend registers it first."""
    _register(plugin_bundle)
    assert (
        fake_trt.Runtime(fake_trt.Logger()).deserialize_cuda_engine((plugin_bundle / "engine.trt").read_bytes()) is None
    )
    Model.load(plugin_bundle)
    assert fake_trt.REGISTRY.get_creator("CompressedDecodeAttention", "1", "") is not None
