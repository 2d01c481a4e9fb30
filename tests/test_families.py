"""Other decoder-only families through the same export path: random-weight parity with transformers (fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgec.build import BuildSettings, build
from edgec.errors import UnsupportedModelError
from edgec.load import check_model_features, check_model_type
from edgec.runtime import Model
from tests.conftest import build_settings

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _families():
    import transformers as t

    return {
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),  # biases on q/k/v
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": 16}),  # window < test sequence
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"pad_token_id": 0}),  # fused qkv and gate/up projections
    }


@pytest.fixture(scope="module", params=["qwen2", "mistral", "phi3"])
def family(request, tmp_path_factory, tiny_tokenizer):
    config_class, model_class, extra = _families()[request.param]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=len(tiny_tokenizer), **SMALL, **extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return request.param, folder, model


@pytest.mark.parametrize("target", ["cpu", "cpu-portable"])
def test_logits_match_transformers(family, target, tmp_path):
    name, folder, model = family
    out = tmp_path / f"{name}.{target}.edgec"
    build(folder, out, BuildSettings(target=target, context=96, prefill_chunk=16))
    runtime = Model.load(out)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 60).tolist()  # 4 prefill chunks
    got = runtime.logprobs(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids[:20]]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    runtime.eos_token_ids = set()
    assert list(runtime.generate_ids(ids[:20], max_new_tokens=30)) == greedy[0, 20:].tolist()
    manifest = json.loads((out / "manifest.json").read_text())
    windows = {layer["window"] for layer in manifest["cache"]["layers"]}
    assert windows == ({16} if name == "mistral" else {0})


@pytest.mark.parametrize(
    "model_type,kind",
    [("mixtral", "mixture-of-experts"), ("t5", "encoder-decoder"), ("llava", "multimodal"), ("mamba", "not a family")],
)
def test_unsupported_families_are_named(model_type, kind):
    with pytest.raises(UnsupportedModelError, match=kind) as error:
        check_model_type(model_type, ["SomethingForCausalLM"])
    assert "gemma3_text, llama, mistral, phi3, qwen2" in str(error.value)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3):
    return tiny_gemma3


# the cpu-portable body in the slow tier: the default tier's budget (the cpu target is the one users get)
@pytest.mark.parametrize("target", ["cpu", pytest.param("cpu-portable", marks=pytest.mark.slow)])
def test_gemma3_logits_match_transformers(gemma3, target, tmp_path):
    """60 tokens in chunks of 16: past the window (16) and past the sliding layers' ring of slots (16 + 16)."""
    folder, model = gemma3
    out = tmp_path / f"gemma3.{target}.edgec"
    result = build(folder, out, BuildSettings(target=target, context=96, prefill_chunk=16))
    layers = result.manifest["cache"]["layers"]
    assert [(layer["window"], layer["capacity"]) for layer in layers] == [(16, 32), (16, 32), (0, 96), (16, 32)]
    # only the global layer has a plain cache GQA can use; the rings keep the function body
    assert result.manifest["passes"].get("kv_attention_gqa", 0) == (1 if target == "cpu" else 0)
    runtime = Model.load(out)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 60).tolist()
    got = runtime.logprobs(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids[:40]]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    runtime.eos_token_ids = set()
    assert list(runtime.generate_ids(ids[:40], max_new_tokens=30)) == greedy[0, 40:].tolist()


def test_attention_soft_capping_is_refused():
    with pytest.raises(UnsupportedModelError, match="attention logit soft-capping"):
        check_model_features({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0})
    check_model_features({"model_type": "gemma3_text", "attn_logit_softcapping": None, "final_logit_softcapping": 30})


def test_gemma3_compressed_global_layer_keeps_the_rings_across_an_end_mode_prompt(gemma3, tmp_path):
    """--kv-* compresses the global layer only; reading a prompt longer than its capacity (end mode) must leave
    the sliding layers' rings holding the prompt's last tokens for the steps that follow."""
    folder, _ = gemma3
    out = tmp_path / "gemma3.kv.edgec"
    result = build(folder, out, build_settings(target="cpu", context=96, prefill_chunk=16, kv_capacity=40, kv_window=8))
    assert [layer.get("compressed", False) for layer in result.manifest["cache"]["layers"]] == [
        False,
        False,
        True,
        False,
    ]
    runtime = Model.load(out)
    ids = np.random.default_rng(2).integers(0, runtime.vocab_size, 60).tolist()
    runtime.next_token_logits(ids)
    state = runtime._idle[-1].arrays()  # the cache state that call ran on, back in the pool
    for layer in (0, 1, 3):
        assert state[f"cache.{layer}.pos"].max() == 59 and (state[f"cache.{layer}.pos"] >= 0).sum() == 32
    assert (state["cache.2.pos"] >= 0).sum() == 40
