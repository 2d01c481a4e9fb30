"""Issue 15.8: inputs that once gave a traceback give one ``error:`` line and exit 2 (the manifest, graph, tokenizer,
PACK.json and output-folder cases live beside their features: test_closed_bundle, test_pack_hostile,
test_outputs)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgec.cli import main
from tests.hostile import copy_bundle, edit_manifest, fifo_in_place_of, raised_within


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def _gguf(path, head_count: int):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(head_count)
    writer.add_head_count_kv(head_count)
    writer.add_vocab_size(384)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_with_zero_heads(tmp_path):
    model = _gguf(tmp_path / "zero.gguf", 0)
    assert "num_attention_heads is 0" in one_error_line(invoke("build", model, "-o", tmp_path / "out.edgec"))
    assert "num_attention_heads is 0" in one_error_line(invoke("plan", model))
    assert not (tmp_path / "out.edgec").exists()


def _safetensors_with_header(path, tiny_llama, header: bytes):
    shutil.copytree(tiny_llama, path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return path


@pytest.mark.parametrize(
    "header",
    [b"[1, 2, 3]", b'"text"', b'{"w": {"data_offsets": "x"}}', b'{"w": 5}'],
    ids=["list", "str", "offsets", "int"],
)
def test_a_safetensors_header_that_is_not_a_table(tmp_path, tiny_llama, header):
    model = _safetensors_with_header(tmp_path / "model", tiny_llama, header)
    line = one_error_line(invoke("build", model, "-o", tmp_path / "out.edgec"))
    assert "model.safetensors is not a valid safetensors file" in line


def test_a_model_path_that_is_neither_a_file_nor_a_folder_is_one_line(tmp_path):
    """``edgec build /dev/null`` or a named pipe as the model: one line, never a read or a traceback."""
    pipe = fifo_in_place_of(tmp_path / "model.gguf")
    for model in ("/dev/null", pipe):
        line = one_error_line(invoke("build", model, "-o", tmp_path / "out.edgec"))
        assert "is neither a file nor a folder" in line
        assert str(model) in one_error_line(invoke("plan", model))  # plan names what it takes instead
    assert not (tmp_path / "out.edgec").exists()


def test_a_model_folder_that_cannot_be_listed_is_one_line(tmp_path, tiny_llama, monkeypatch):
    """A folder without read permission (as a user other than root meets it; CI runs as root, so the listing is
    made to fail as the system would)."""
    import pathlib

    listing = pathlib.Path.iterdir

    def refused(self):
        if self == tiny_llama:
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", refused)
    line = one_error_line(invoke("build", tiny_llama, "-o", tmp_path / "out.edgec"))
    assert f"cannot read the model folder {tiny_llama}: Permission denied" in line
    assert not (tmp_path / "out.edgec").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_named_pipe_in_a_model_folder_is_one_line(tmp_path, tiny_llama, name):
    """A model folder holding a named pipe (as its weights, its tokenizer, its config): refused at once, where
    opening it (edgec's reads, or transformers') waits for a writer forever."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    pipe = fifo_in_place_of(model / name)
    results = []
    assert raised_within(30, lambda: results.append(invoke("build", model, "-o", tmp_path / "out.edgec")), pipe) is None
    assert f"{name} in {model} is not a regular file" in one_error_line(results[0])
    assert not (tmp_path / "out.edgec").exists()


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("hidden_size", "64", "hidden_size is '64'"),
        ("num_attention_heads", -4, "num_attention_heads is -4"),
        ("num_hidden_layers", 0, "num_hidden_layers is 0"),
        ("vocab_size", 10**40, "vocab_size is"),
        ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
        ("max_position_embeddings", "4096", "max_position_embeddings is '4096'"),
        ("layer_types", "all", "layer_types"),
        ("head_dim", True, "head_dim is True"),
    ],
)
def test_config_values_a_decoder_cannot_have(tmp_path, tiny_llama, key, value, needle):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    assert needle in one_error_line(invoke("build", model, "-o", tmp_path / "out.edgec"))
    assert needle in one_error_line(invoke("plan", model))


def test_a_config_that_is_not_an_object(tmp_path, tiny_llama):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "config.json").write_text("[1, 2]")
    assert "must be a JSON object" in one_error_line(invoke("build", model, "-o", tmp_path / "out.edgec"))
    assert "must be a JSON object" in one_error_line(invoke("plan", model))


def test_markup_and_escape_codes_in_manifest_strings_are_shown_as_text(tiny_bundle, tmp_path):
    """rich markup ([/]) once crashed inspect; escape codes reached the terminal raw."""
    bundle = copy_bundle(tiny_bundle, tmp_path)

    def change(manifest):
        manifest["source"]["name"] = "[/]evil[bold]\x1b]0;pwned\x07\x1b[31mred"
        manifest["tokenizer"]["chat_note"] = "[link=file:///etc/passwd]click[/link]"

    edit_manifest(bundle, change)
    result = invoke("inspect", bundle)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "[/]evil[bold]" in result.output and "\\x1b]0;pwned\\x07" in result.output
    assert "[link=file:///etc/passwd]click[/link]" in result.output


def test_escape_codes_in_file_names_never_reach_the_terminal(tiny_bundle, tmp_path):
    bundle = copy_bundle(tiny_bundle, tmp_path)
    (bundle / "tokenizer.json").rename(bundle / "tok\x1b[2Jen.json")

    def change(manifest):
        manifest["files"]["tok\x1b[2Jen.json"] = manifest["files"].pop("tokenizer.json")
        manifest["tokenizer"]["file"] = "tok\x1b[2Jen.json"

    edit_manifest(bundle, change)
    for command in (["inspect", bundle], ["run", bundle, "hi"]):
        line = one_error_line(invoke(*command))
        assert "\x1b" not in line and "\\x1b[2J" in line
    result = invoke("verify", bundle)
    assert result.exit_code == 1 and "\x1b" not in result.output
    (bundle / "notes\x1b[2J.txt").write_text("extra")
    assert "\x1b" not in invoke("verify", bundle).output


def test_generated_control_characters_are_escaped_by_edgec_run(tiny_bundle, monkeypatch):
    """A bundle's tokenizer decides the text: edgec run shows terminal control characters escaped."""
    from edgec.cli import terminal_text

    assert terminal_text("ok\n\tline\x1b[2J\x9b\x07") == "ok\n\tline\\x1b[2J\\x9b\\x07"


RUNTIME_ONLY = """
import sys
for name in {missing!r}:
    sys.modules[name] = None  # as on a machine with pip install 'edgec[runtime]' only
sys.argv = ["edgec", *{argv!r}]
from edgec.cli import main
main()
"""


@pytest.mark.parametrize(
    "missing,argv,needle",
    [
        (["click", "rich"], ["inspect", "x.edgec"], "needs click"),
        (["rich"], ["inspect", "{bundle}"], "edgec inspect needs rich"),
        (["rich", "torch"], ["build", "model", "-o", "x"], "edgec build needs rich"),
        (["rich"], ["targets"], "edgec targets needs rich"),
    ],
)
def test_a_runtime_only_install_names_the_extra(tiny_bundle, missing, argv, needle):
    argv = [arg.format(bundle=tiny_bundle) for arg in argv]
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME_ONLY.format(missing=missing, argv=argv)], capture_output=True, text=True
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "pip install 'edgec[build]'" in lines[0]
