"""The command line: happy paths, and every bad input gives one clear line, exit 2, nothing at -o."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from edgec.cli import main


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_clean_failure(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", [[], ["build"], ["run"], ["inspect"], ["eval"], ["bench"]])
def test_help_has_an_example(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    if command:
        assert "Example:" in result.output and "edgec " in result.output


def test_run_and_inspect(tiny_bundle):
    result = invoke("run", tiny_bundle, "def f(x):", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert result.output.strip()
    chat = invoke("run", tiny_bundle, "hello", "--chat", "-n", "4", "--temperature", "0.8", "--seed", "1")
    assert chat.exit_code == 0, chat.output
    inspected = invoke("inspect", tiny_bundle)
    assert inspected.exit_code == 0, inspected.output
    for needle in ("GroupQueryAttention", "bytes/token", "model.onnx.data", "top-1 agreement", "cpu (ort-cpu)"):
        assert needle in inspected.output


def test_build_writes_a_bundle(tiny_llama, tmp_path):
    out = tmp_path / "b.edgec"
    result = invoke("build", tiny_llama, "-o", out, "--context", "64")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["build_settings"]["context"] == 64
    assert manifest["validation"]["top1_agreement"] == 1.0
    assert not list(tmp_path.glob(".b.edgec.tmp-*"))
    again = invoke("build", tiny_llama, "-o", out, "--context", "64")
    assert_clean_failure(again, "already exists", "--overwrite")


def _bert_folder(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    return path


def _pickle_folder(path, tiny_llama):
    path.mkdir()
    shutil.copy(tiny_llama / "config.json", path / "config.json")
    (path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    return path


def _truncated_safetensors(path, tiny_llama):
    shutil.copytree(tiny_llama, path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return path


def _garbage_safetensors(path, tiny_llama):
    shutil.copytree(tiny_llama, path)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    return path


def _bert_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda tmp, tiny: tmp / "nope", ["does not exist"]),
        (lambda tmp, tiny: (tmp / "empty").mkdir() or tmp / "empty", ["no config.json"]),
        (lambda tmp, tiny: _bert_folder(tmp / "bert"), ["'bert'", "encoder-only", "llama, mistral, phi3, qwen2"]),
        (lambda tmp, tiny: _pickle_folder(tmp / "pickled", tiny), ["pickle", "--allow-pickle"]),
        (lambda tmp, tiny: _truncated_safetensors(tmp / "truncated", tiny), ["model.safetensors", "not a valid"]),
        (lambda tmp, tiny: _garbage_safetensors(tmp / "garbage", tiny), ["model.safetensors", "not a valid"]),
        (lambda tmp, tiny: _bert_gguf(tmp / "bert.gguf"), ["GGUF architecture 'bert'", "not supported"]),
        (lambda tmp, tiny: (tmp / "weights.pt").write_bytes(b"x") and tmp / "weights.pt", ["not a .gguf"]),
    ],
    ids=["missing", "no-config", "bert", "pickle-only", "truncated", "garbage", "gguf-bert", "not-gguf-file"],
)
def test_bad_models_are_refused(make, needles, tmp_path, tiny_llama):
    model = make(tmp_path, tiny_llama)
    out = tmp_path / "out.edgec"
    assert_clean_failure(invoke("build", model, "-o", out), *needles)
    assert not out.exists() and not list(tmp_path.glob(".out.edgec.tmp-*"))


@pytest.mark.parametrize(
    "options,needles",
    [
        (["--target", "toaster"], ["unknown target 'toaster'", "cpu"]),
        (["--context", "0"], ["--context must be a positive"]),
        (["--context", "100000"], ["longer than the model was trained for"]),
        (["--prefill-chunk", "-3"], ["--prefill-chunk must be positive"]),
        (["--split-activations"], ["--split-activations", "needs --weights int4 or int8"]),
        (["--weights", "int4", "--accuracy-level", "1", "--split-activations"], ["at --accuracy-level 2-4"]),
    ],
)
def test_bad_settings_are_refused(options, needles, tiny_llama, tmp_path):
    out = tmp_path / "out.edgec"
    assert_clean_failure(invoke("build", tiny_llama, "-o", out, *options), *needles)
    assert not out.exists() and not list(tmp_path.glob(".out.edgec.tmp-*"))


def test_run_refuses_a_prompt_longer_than_the_context(tiny_bundle):
    assert_clean_failure(invoke("run", tiny_bundle, "word " * 400), "context is 128")


def test_bundle_with_a_missing_file(tiny_bundle, tmp_path):
    copy = tmp_path / "copy.edgec"
    shutil.copytree(tiny_bundle, copy)
    (copy / "model.onnx").unlink()
    assert_clean_failure(invoke("run", copy, "hi"), "missing model.onnx")
    assert_clean_failure(invoke("inspect", copy), "missing model.onnx")
    assert_clean_failure(invoke("run", tmp_path / "nothing.edgec", "hi"), "is not a folder")
