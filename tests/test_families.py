"""Other decoder-only families through the same export path: random-weight parity with transformers (fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgec.build import BuildSettings, build
from edgec.errors import UnsupportedModelError
from edgec.load import check_model_type
from edgec.runtime import Model

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
    assert "llama, mistral, phi3, qwen2" in str(error.value)
