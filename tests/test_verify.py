"""edgec verify and load-time checks: every kind of damage is named."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from edgec.bundle import FORMAT_VERSION
from edgec.cli import main
from edgec.errors import BundleError
from edgec.runtime import Model
from edgec.verify import verify


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    copy = tmp_path / "copy.edgec"
    shutil.copytree(tiny_bundle, copy)
    return copy


def failures(bundle, compare=False) -> dict[str, str]:
    return {check.name: check.detail for check in verify(bundle, compare=compare) if check.status == "fail"}


def test_a_good_bundle_verifies(tiny_bundle):
    result = CliRunner().invoke(main, ["verify", str(tiny_bundle), "--compare"])
    assert result.exit_code == 0, result.output
    assert "bundle verified" in result.output
    assert "PASS  reference logits, prompt 0" in result.output
    assert "SKIP  cross-runtime" in result.output


FILES = [
    "model.onnx",
    "model.onnx.data",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "validation.npz",
]


@pytest.mark.parametrize("name", FILES)
def test_one_flipped_byte_is_named(bundle_copy, name):
    data = bytearray((bundle_copy / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle_copy / name).write_bytes(bytes(data))
    assert failures(bundle_copy) == {
        f"file {name}": "sha256 differs from the manifest (damaged, or changed since the build)"
    }
    with pytest.raises(BundleError, match=name.replace(".", r"\.")):
        Model.load(bundle_copy, check_hashes=True)
    result = CliRunner().invoke(main, ["verify", str(bundle_copy)])
    assert result.exit_code == 1 and f"FAIL  file {name}" in result.output


def test_tampered_manifest(bundle_copy):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"]["sha256"] = "0" * 64
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    assert "file tokenizer.json" in failures(bundle_copy)
    (bundle_copy / "manifest.json").write_text("{not json")
    assert "not valid JSON" in failures(bundle_copy)["manifest"]
    with pytest.raises(BundleError, match="not valid JSON"):
        Model.load(bundle_copy)


def test_missing_and_extra_files(bundle_copy):
    (bundle_copy / "tokenizer_config.json").unlink()
    (bundle_copy / "notes.txt").write_text("not part of the bundle")
    assert failures(bundle_copy)["file set"] == "missing tokenizer_config.json; extra notes.txt"


def test_truncated_weights(bundle_copy):
    data = (bundle_copy / "model.onnx.data").read_bytes()
    (bundle_copy / "model.onnx.data").write_bytes(data[:-100])
    assert "truncated" in failures(bundle_copy)["file model.onnx.data"]
    with pytest.raises(BundleError, match="model.onnx.data .* truncated"):
        Model.load(bundle_copy)


def test_newer_format_and_broken_schema(bundle_copy):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    newer = {**manifest, "format_version": FORMAT_VERSION + 1}
    (bundle_copy / "manifest.json").write_text(json.dumps(newer))
    with pytest.raises(BundleError, match=f"version {FORMAT_VERSION + 1} is newer .* reads \\({FORMAT_VERSION}\\)"):
        Model.load(bundle_copy)
    assert "format version" in failures(bundle_copy)
    broken = {**manifest, "cache": {**manifest["cache"], "layers": "all of them"}}
    del broken["model"]
    (bundle_copy / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(BundleError, match="manifest.model is missing"):
        Model.load(bundle_copy)
    assert "manifest.cache.layers must be a list" in failures(bundle_copy)["manifest schema"]


def test_compare_catches_wrong_weights(bundle_copy, tiny_llama, tmp_path):
    """A bundle whose hashes are all consistent but whose weights are not the model's: only --compare sees it."""
    import numpy as np

    from edgec.bundle import write_manifest

    data = np.fromfile(bundle_copy / "model.onnx.data", dtype=np.float32).copy()
    data[: len(data) // 2] *= 1.5
    data.tofile(bundle_copy / "model.onnx.data")
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest.pop("files")
    write_manifest(bundle_copy, manifest)  # re-hash: the bundle is self-consistent, just wrong
    assert not failures(bundle_copy)
    assert any(name.startswith("reference logits") for name in failures(bundle_copy, compare=True))


def test_cross_runtime_comparison_through_polygraphy(tiny_bundle):
    """Only one provider exists here, so the plumbing is exercised with the CPU provider against itself."""
    from edgec.verify import compare_runtimes

    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    check = compare_runtimes(tiny_bundle, manifest, providers=["CPUExecutionProvider", "CPUExecutionProvider"])
    assert check.status == "pass", check.detail
    assert compare_runtimes(tiny_bundle, manifest, providers=["CPUExecutionProvider"]).status == "skip"
