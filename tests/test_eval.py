"""`edgec eval` end to end on tiny random-weight bundles: the report's numbers checked against what they mean
(a bundle against itself agrees 100 % with KL 0, a different model does not, perplexity is exp(mean NLL) of the
runtime's own logits, repeated runs are bitwise identical, a compressed cache's error grows along the sequence), the
JSON schema and the PNGs; every bad input is one ``error:`` line and exit 2."""

from __future__ import annotations

import json
import struct
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.runtime import Model
from tests.conftest import TINY_LLAMA, build_settings, make_llama_folder, pydoc_text
from tests.test_cli import assert_clean_failure

# small settings: the whole file runs in well under a minute on 2 cores
QUICK = ["--windows", "64,128", "--lengths", "200,256", "--depths", "0.2,0.8", "--trials", "1"]
QUICK += ["--new-tokens", "12", "--curve-tokens", "160", "--prompts", "2"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _build(folder, out, **settings):
    from edgec.build import build

    build(folder, out, build_settings(target="cpu", context=256, prefill_chunk=32, **settings))
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_llama, tiny_tokenizer):
    """plain: the tiny Llama (context 256, room for a passkey prompt); compressed: the same model with 64 int8
    slots; other: a different random model with the same tokenizer."""
    root = tmp_path_factory.mktemp("eval")
    other = make_llama_folder(root / "other-llama", tiny_tokenizer, seed=1)
    return {
        "plain": _build(tiny_llama, root / "plain.edgec"),
        "compressed": _build(
            tiny_llama, root / "kv64.edgec", kv_capacity=64, kv_dtype="int8", kv_group=16, kv_window=16
        ),
        "other": _build(other, root / "other.edgec"),
    }


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "pydoc.txt"
    path.write_text(pydoc_text())
    return path


@pytest.fixture(scope="module")
def report(bundles, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    result = invoke(
        "eval",
        bundles["plain"],
        bundles["compressed"],
        bundles["other"],
        "--reference",
        bundles["plain"],
        "--text",
        text_file,
        *QUICK,
        "--json",
        out / "eval.json",
        "--plots",
        out / "png",
    )
    assert result.exit_code == 0, result.output
    return {"output": result.output, "json": json.loads((out / "eval.json").read_text()), "png": out / "png"}


def _is_png(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100 and data.endswith(b"IEND\xaeB`\x82")
    return width, height


def test_the_report_schema_the_table_and_the_pngs(report, bundles):
    data = report["json"]
    assert {"date", "machine", "text", "reference", "settings", "bundles"} <= set(data)
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"] and data["reference"]["kind"] == "bundle"
    assert [b["name"] for b in data["bundles"]] == ["plain.edgec", "kv64.edgec", "other.edgec"]
    for bundle in data["bundles"]:
        assert set(bundle) >= {"name", "path", "context", "weights", "cache", "perplexity", "passkey"}
        assert set(bundle) >= {"agreement", "consistency", "error_curve"}
        assert set(bundle["perplexity"]["windows"]) == {"64", "128"}
        assert len(bundle["perplexity"]["windows"]["128"]["per_window"]) == 2
        assert np.asarray(bundle["passkey"]["accuracy"]).shape == (2, 2)
        assert len(bundle["passkey"]["records"]) == 4 and bundle["passkey"]["lengths"] == [200, 256]
        assert len(bundle["error_curve"]["kl"]) == 160 == len(bundle["error_curve"]["max_abs_logit"])
    # KV bytes: the compressed cache stops growing at its 64 slots
    plain, compressed = data["bundles"][0]["cache"]["bytes_at"], data["bundles"][1]["cache"]["bytes_at"]
    assert plain["128"] == 2 * plain["64"] and compressed["128"] == compressed["64"] < plain["64"]
    for title in ("perplexity", "passkey accuracy", "greedy agreement", "consistency", "error vs the reference"):
        assert title in report["output"]
    assert "[" in report["output"] and " s] perplexity plain.edgec" in report["output"]  # plain progress lines
    for name in ("passkey.png", "error-curve.png", "perplexity-kv.png"):
        _is_png(report["png"] / name)


def test_a_bundle_against_itself_agrees_fully_and_another_model_does_not(report):
    plain, compressed, other = report["json"]["bundles"]
    assert plain["agreement"]["identical_fraction"] == 1.0
    assert plain["agreement"]["first_divergence"] == [None, None]
    assert plain["error_curve"]["kl_max"] == 0.0 and plain["error_curve"]["max_abs_logit_max"] == 0.0
    assert plain["error_curve"]["top1_agreement"] == 1.0
    assert other["agreement"]["identical_fraction"] < 1.0 and other["error_curve"]["kl_mean"] > 0.1
    # the compressed cache: quantization error from the start, eviction error once its 64 slots are full
    quarters = compressed["error_curve"]["kl_by_quarter"]
    assert 0 < quarters[0] < 1e-2 < quarters[-1]
    kl = np.asarray(compressed["error_curve"]["kl"])
    assert kl[:64].max() < kl[100:].mean()


def test_consistency_is_exact(report):
    for bundle in report["json"]["bundles"]:
        result = bundle["consistency"]
        assert result["runs"] == 3 and result["tokens_identical"] and result["logits_bitwise_identical"]
        assert result["max_abs_logit_diff"] == 0.0


def test_perplexity_is_exp_mean_nll_of_the_runtime_logits(report, bundles):
    """Recomputed here from ``Model.iter_logits`` with a float64 log-softmax, window by window."""
    model = Model.load(bundles["other"])
    ids = model.encode(pydoc_text())
    result = report["json"]["bundles"][2]["perplexity"]["windows"]["128"]
    nll = []
    for i in range(2):
        window = ids[i * 128 : (i + 1) * 128]
        logits = np.concatenate([piece for _, piece in model.iter_logits(window)]).astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll.append(-logp[np.arange(127), window[1:]])
    assert result["per_window"] == pytest.approx([float(np.exp(n.mean())) for n in nll], rel=1e-6)
    assert result["perplexity"] == pytest.approx(float(np.exp(np.concatenate(nll).mean())), rel=1e-6)
    assert result["tokens_scored"] == 254


def test_iter_logits_decode_steps_match_the_prompt_path(bundles):
    model = Model.load(bundles["plain"])
    ids = model.encode(pydoc_text())[:80]
    prompt = np.concatenate([piece for _, piece in model.iter_logits(ids)])
    stepped = list(model.iter_logits(ids, prompt_tokens=10))
    assert [start for start, _ in stepped][-3:] == [77, 78, 79]
    np.testing.assert_allclose(np.concatenate([piece for _, piece in stepped]), prompt, atol=1e-4)


def test_the_source_model_as_reference(bundles, text_file, tiny_llama):
    """transformers + torch run the Hugging Face folder the plain bundle was built from."""
    result = invoke(
        "eval",
        bundles["plain"],
        "--reference",
        tiny_llama,
        "--text",
        text_file,
        *QUICK,
        "--only",
        "agreement,perplexity,error_curve",
        "--json",
        text_file.parent / "source.json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads((text_file.parent / "source.json").read_text())
    curve = data["bundles"][0]["error_curve"]
    assert data["reference"]["kind"] == "source" and curve["kl_max"] < 1e-5 and curve["top1_agreement"] > 0.95
    ours, theirs = data["bundles"][0]["perplexity"]["windows"], data["reference"]["perplexity"]["windows"]
    assert ours["128"]["perplexity"] == pytest.approx(theirs["128"]["perplexity"], rel=1e-4)


def test_without_matplotlib_the_json_is_written_and_one_line_says_why(bundles, text_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke(
        "eval", bundles["plain"], "--text", text_file, *QUICK, "--only", "consistency", "--json", tmp_path / "r.json",
        "--plots", tmp_path / "png",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["bundles"][0]["consistency"]["tokens_identical"]
    notes = [line for line in result.stderr.splitlines() if line.strip()]
    assert notes == ["note: PNGs need matplotlib, which is not installed: pip install matplotlib"]
    assert not (tmp_path / "png").exists()


def test_metrics_that_need_a_reference_are_left_out_without_one(bundles, text_file):
    result = invoke("eval", bundles["plain"], "--text", text_file, *QUICK, "--only", "consistency")
    assert result.exit_code == 0 and "consistency" in result.stdout and "agreement" not in result.stdout
    result = invoke("eval", bundles["plain"], "--text", text_file, *QUICK)
    assert result.exit_code == 0 and "agreement, error_curve need --reference" in result.stderr


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory, tiny_tokenizer):
    """A Hugging Face folder whose model has 400 logits where the bundles have 384."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("vocab") / "llama-400"
    LlamaForCausalLM(LlamaConfig(vocab_size=400, **TINY_LLAMA)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "args,needles",
    [
        (["{tmp}/missing.edgec", "--text", "{text}"], ["missing.edgec", "not a folder"]),
        (["{plain}", "--text", "{tmp}/missing.txt"], ["cannot read the text", "missing.txt"]),
        (["{plain}", "--text", "{text}", "--windows", "abc"], ["--windows", "whole numbers"]),
        (["{plain}", "--text", "{text}", "--windows", "64,0"], ["--windows", "at least 1"]),
        (["{plain}", "--text", "{text}", "--windows", "512"], ["--windows 512 is beyond the context", "256"]),
        (["{plain}", "--text", "{text}", "--lengths", "300"], ["--lengths 300 is beyond the context"]),
        (["{plain}", "--text", "{text}", "--lengths", "100"], ["passkey length 100 leaves no room"]),
        (
            ["{plain}", "--text", "{text}", "--reference", "{plain}", "--curve-tokens", "4096"],
            ["--curve-tokens 4096 is beyond"],
        ),
        (["{plain}", "--text", "{short}", "--windows", "128"], ["text is too short", "--windows 128 × 2"]),
        (["{plain}", "--text", "{text}", "--only", "perplexity,speed"], ["unknown metric 'speed'", "perplexity"]),
        (["{plain}", "--text", "{text}", "--only", "agreement"], ["agreement compares with a reference"]),
        (["{plain}", "--text", "{text}", "--depths", "0.5,1.5"], ["--depths", "[0, 1]"]),
        (["{plain}", "--text", "{text}", "--reference", "{vocab}"], ["vocabulary of 400 tokens", "384"]),
        (["{plain}", "--text", "{text}", "--reference", "{tmp}/nothing"], ["nothing does not exist"]),
        (["{plain}", "--text", "{text}", "--json", "{tmp}/no/such/dir/r.json", "--only", "consistency"], ["--json"]),
        ([], ["Missing argument 'BUNDLES...'"]),
    ],
    ids=[
        "missing-bundle",
        "missing-text",
        "windows-not-numbers",
        "windows-zero",
        "window-beyond-context",
        "passkey-beyond-context",
        "passkey-no-room",
        "curve-beyond-context",
        "text-too-short",
        "unknown-metric",
        "needs-reference",
        "bad-depth",
        "reference-vocab-mismatch",
        "missing-reference",
        "unwritable-json",
        "no-bundle",
    ],
)
def test_bad_input_is_one_error_line(args, needles, bundles, text_file, other_vocab, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(pydoc_text()[:300])
    values = {"plain": bundles["plain"], "text": text_file, "tmp": tmp_path, "short": short, "vocab": other_vocab}
    assert_clean_failure(invoke("eval", *[arg.format(**values) for arg in args]), *needles)
