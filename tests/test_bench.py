"""`edgec bench` end to end on the tiny bundles: each engine in its own worker process, alternating rounds, the
ratios computed from the rounds, KV bytes from the cache spec, JSON and PNG; bad input is one ``error:`` line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.kvcache.spec import CacheSpec
from tests.conftest import manifest, pydoc_text
from tests.test_cli import assert_clean_failure
from tests.test_eval import _is_png


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def report(tiny_bundle, tiny_portable_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = invoke(
        "bench", tiny_bundle, "--vs", tiny_portable_bundle, "--contexts", "16,64", "--new-tokens", "8",
        "--rounds", "3", "--threads", "1", "--json", out / "bench.json", "--plot", out / "bench.png",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return {"output": result.output, "json": json.loads((out / "bench.json").read_text()), "png": out / "bench.png"}


def test_the_report(report, tiny_bundle, tiny_portable_bundle):
    data = report["json"]
    assert {"date", "machine", "threads", "rounds", "new_tokens", "contexts", "engines", "ratios"} <= set(data)
    assert data["contexts"] == [16, 64] and data["rounds"] == 3 and data["threads"] == 1
    assert [e["name"] for e in data["engines"]] == [tiny_bundle.name, tiny_portable_bundle.name]
    for engine, bundle in zip(data["engines"], (tiny_bundle, tiny_portable_bundle), strict=True):
        spec = CacheSpec.from_json(manifest(bundle)["cache"])
        assert engine["kind"] == "bundle" and engine["context"] == 128
        assert engine["kv_allocated_bytes"] == spec.total_bytes()
        assert 20 * 2**20 < engine["peak_rss_bytes"] < 2 * 2**30  # the worker's own VmHWM
        for n in ("16", "64"):
            result = engine["results"][n]
            assert result["kv_bytes"] == spec.bytes_for(int(n) + 8 + 1)
            for metric in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
                stats = result[metric]
                assert len(stats["all"]) == 3 and stats["min"] <= stats["median"] <= stats["max"]
                assert stats["iqr"][0] <= stats["median"] <= stats["iqr"][1] and stats["min"] > 0
            assert result["prefill_tok_s"]["all"] == pytest.approx([int(n) / t for t in result["ttft_s"]["all"]])
            assert all(0 < steps <= 8 for steps in result["decode_steps"])
    # the ratios are those of each round's pair, as measured
    ratios = data["ratios"][tiny_portable_bundle.name]["64"]["decode_tok_s"]["all"]
    ours, theirs = (e["results"]["64"]["decode_tok_s"]["all"] for e in data["engines"])
    assert ratios == pytest.approx([a / b for a, b in zip(ours, theirs, strict=True)])
    assert "alternating rounds" in report["output"] and "÷ each other engine" in report["output"]
    assert "[" in report["output"] and "s] rounds" in report["output"]  # plain progress lines when piped
    _is_png(report["png"])


def test_a_bundle_alone_with_default_contexts(tiny_bundle):
    """256 and 1024 do not fit a 128-token context: the largest prompt that leaves room for the decode steps."""
    result = invoke("bench", tiny_bundle, "--rounds", "1", "--new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "123" in result.stdout and "÷" not in result.stdout


@pytest.fixture(scope="module")
def genai_folder(tiny_llama, tmp_path_factory):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path_factory.mktemp("genai") / "tiny-genai"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tiny_llama), "-o", str(out)]
    command += ["-p", "fp32", "-e", "cpu", "-c", str(out.parent / "cache")]
    subprocess.run(command, check=True, capture_output=True)
    return out


def test_against_onnxruntime_genai(tiny_bundle, genai_folder, tmp_path):
    result = invoke(
        "bench", tiny_bundle, "--vs", genai_folder, "--contexts", "32", "--new-tokens", "8", "--rounds", "2",
        "--json", tmp_path / "g.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "g.json").read_text())
    ours, genai = data["engines"]
    assert genai["kind"] == "genai" and genai["peak_rss_bytes"] > 20 * 2**20
    # genai's fp32 cache of 2 layers × 2 KV heads × 16 channels × (k, v): the same bytes as the bundle's plain cache
    assert genai["results"]["32"]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (32 + 8 + 1)
    assert data["ratios"][genai_folder.name]["32"]["decode_tok_s"]["median"] > 0


def test_an_engine_with_another_vocabulary(tiny_bundle, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    folder = _fake_genai(tmp_path / "genai", vocab_size=999)
    assert_clean_failure(invoke("bench", tiny_bundle, "--vs", folder), "vocabulary of 999 tokens", "384")


def _fake_genai(folder, vocab_size=384):
    folder.mkdir()
    config = {"model": {"context_length": 128, "vocab_size": vocab_size, "decoder": {"filename": "model.onnx"}}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_a_genai_folder_without_onnxruntime_genai(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    folder = _fake_genai(tmp_path / "genai")
    assert_clean_failure(invoke("bench", tiny_bundle, "--vs", folder), "needs onnxruntime_genai", "pip install")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["{tmp}/missing.edgec"], ["missing.edgec does not exist"]),
        (["{bundle}", "--vs", "{tmp}/missing.edgec"], ["missing.edgec does not exist"]),
        (["{bundle}", "--contexts", "64,x"], ["--contexts", "whole numbers"]),
        (["{bundle}", "--contexts", "0"], ["--contexts", "at least 1"]),
        (["{bundle}", "--contexts", "1024"], ["--contexts 1024 is beyond the capacity", "128"]),
        (["{bundle}", "--contexts", "120", "--new-tokens", "8"], ["--contexts 120 is beyond the capacity"]),
        (["{bundle}", "--text", "{short}", "--contexts", "80"], ["the text has", "--contexts 80"]),
        (["{bundle}", "--text", "{tmp}/missing.txt"], ["cannot read the text"]),
        (["{bundle}", "--rounds", "0"], ["--rounds"]),
        (["{genai}"], ["BUNDLE must be an edgec bundle"]),
        (["{bundle}", "--vs", "{source}"], ["--vs takes an edgec bundle or an onnxruntime-genai folder"]),
    ],
    ids=[
        "missing-bundle",
        "missing-vs",
        "contexts-not-numbers",
        "contexts-zero",
        "beyond-capacity",
        "no-room-to-decode",
        "text-too-short",
        "missing-text",
        "zero-rounds",
        "genai-as-bundle",
        "source-as-vs",
    ],
)
def test_bad_input_is_one_error_line(args, needles, tiny_bundle, tiny_llama, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(pydoc_text()[:100])
    values = {"bundle": tiny_bundle, "tmp": tmp_path, "short": short, "source": tiny_llama}
    values["genai"] = tmp_path / "genai"
    if "{genai}" in args:
        _fake_genai(values["genai"])
    assert_clean_failure(invoke("bench", *[arg.format(**values) for arg in args]), *needles)
