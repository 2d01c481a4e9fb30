"""Bundles of format v1 (built before the runtime section and per-layer state existed) keep loading and give the
same answers; a v1 TensorRT-RTX bundle (which never loaded) is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from edgec.errors import BundleError
from edgec.runtime import Model
from edgec.verify import verify
from tests.conftest import build_settings


def as_v1(bundle, copy):
    """The same bundle with the manifest v1 wrote: prefill chunk and protect default among the build settings
    (flat kv_* keys), no runtime section keys for them, and cache positions as one flag instead of per-layer state."""
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    runtime = manifest["runtime"]
    settings = {key: value for key, value in manifest["build_settings"].items() if key != "kv"}
    settings["protect"] = runtime.pop("protect")
    settings["prefill_chunk"] = runtime.pop("prefill_chunk")
    for key, value in (manifest["build_settings"].get("kv") or {}).items():
        settings[f"kv_{key}"] = value
    cache = manifest["cache"]
    plain = [layer for layer in cache["layers"] if not layer["compressed"]]
    cache["positions"] = not plain or any("pos" in layer["state"] for layer in plain)
    for layer in cache["layers"]:
        del layer["state"]
    manifest |= {"format_version": 1, "build_settings": settings, "runtime": runtime, "cache": cache}
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return copy


@pytest.fixture(scope="module")
def compressed_bundle(tmp_path_factory, tiny_llama):
    from edgec.build import build

    out = tmp_path_factory.mktemp("v1") / "kv.edgec"
    build(
        tiny_llama,
        out,
        build_settings(context=128, prefill_chunk=16, kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16),
    )
    return out


@pytest.mark.parametrize("which", ["plain", "compressed"])
def test_a_v1_bundle_loads_and_answers_as_before(which, tiny_bundle, compressed_bundle, tmp_path):
    bundle = tiny_bundle if which == "plain" else compressed_bundle
    old = as_v1(bundle, tmp_path / "v1.edgec")
    prompt = "def fibonacci(n):\n    " * 6  # longer than the compressed capacity: eviction runs
    new_model, old_model = Model.load(bundle), Model.load(old)
    assert old_model.cache_spec == new_model.cache_spec
    assert old_model.prefill_chunk == new_model.prefill_chunk == 16
    assert old_model.generate(prompt, max_new_tokens=12) == new_model.generate(prompt, max_new_tokens=12)
    checks = verify(old, compare=True)
    assert all(check.status != "fail" for check in checks), [check.line() for check in checks]


def test_a_v1_tensorrt_bundle_is_refused_in_one_line(tiny_bundle, tmp_path):
    old = as_v1(tiny_bundle, tmp_path / "v1-trt.edgec")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["runtime"] |= {"library": "tensorrt_rtx", "engine": "model.onnx", "version": "1.7.1"}
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format-v1 TensorRT-RTX bundle.*rebuild"):
        Model.load(old)
