"""The real Gemma-3-270m (Q4_K_M GGUF, dequantized to fp32) through edgec vs transformers.

Two bundles, built once: ``cpu`` straight from the GGUF, and ``cpu-portable`` from a Hugging Face folder written
from the same weights (so both sources are covered). Both use a prefill chunk of 128, which makes the sliding
layers' ring 512 + 128 = 640 slots: the long prompt (900 tokens) wraps it, so the ring is what is tested, not a
cache big enough to never reuse a slot.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch

from edgec.build import BuildSettings, build
from edgec.runtime import Model
from tests.conftest import pydoc_text

# the real model: minutes on 2 cores, so in the slow tier (`pytest -m slow`, which CI runs after the default tier)
pytestmark = [pytest.mark.gemma3, pytest.mark.slow]
NEW_TOKENS = 64
CHUNK = 128
SLIDING, GLOBAL = 15, 3


@pytest.fixture(scope="module")
def hf_model(gemma3_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory):
    """The GGUF's weights as a Hugging Face folder (save_pretrained refuses a GGUF-loaded model; a copy is fine)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    source, tokenizer = hf_model
    config = source.config.to_dict()
    config.pop("quantization_config", None)
    copy = Gemma3ForCausalLM(Gemma3TextConfig(**config))
    copy.load_state_dict(source.state_dict())
    folder = tmp_path_factory.mktemp("gemma3-hf") / "gemma-3-270m"
    copy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bundles(gemma3_path, hf_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    built = {"cpu": folder / "gemma.cpu.edgec", "cpu-portable": folder / "gemma.portable.edgec"}
    build(gemma3_path, built["cpu"], BuildSettings(target="cpu", context=2048, prefill_chunk=CHUNK))
    build(hf_folder, built["cpu-portable"], BuildSettings(target="cpu-portable", context=2048, prefill_chunk=CHUNK))
    return built


@pytest.fixture(scope="module")
def prompts(hf_model):
    tokenizer = hf_model[1]
    long_ids = tokenizer(pydoc_text()[:40_000])["input_ids"]
    start = [tokenizer.bos_token_id]  # slices of a longer text need their BOS, as every Gemma prompt does
    return [
        tokenizer("The capital of France is")["input_ids"],
        tokenizer("Question: Why is the sky blue?\nAnswer:")["input_ids"],
        start + long_ids[1000:1300],
        start + long_ids[3000:3500],
        start + long_ids[5000:5900],  # > window + chunk: the sliding layers' ring wraps during prefill
    ]


@pytest.fixture(scope="module")
def reference_logits(hf_model, prompts):
    with torch.no_grad():
        return [hf_model[0](torch.tensor([ids])).logits[0, -1].numpy() for ids in prompts]


def test_prompts_start_with_bos(prompts, hf_model):
    assert all(ids[0] == hf_model[1].bos_token_id == 2 for ids in prompts)
    assert [len(ids) for ids in prompts][2:] == [301, 501, 901]


def test_bundle_adds_bos_and_has_rings(bundles, hf_model):
    model = Model.load(bundles["cpu"])
    assert model.encode("The capital of France is") == hf_model[1]("The capital of France is")["input_ids"]
    layers = model.manifest["cache"]["layers"]
    assert collections.Counter((layer["window"], layer["capacity"]) for layer in layers) == {
        (512, 512 + CHUNK): SLIDING,
        (0, 2048): GLOBAL,
    }
    lowered = onnx.load(str(bundles["cpu"] / "model.onnx"), load_external_data=False)
    ops = collections.Counter(node.op_type for node in lowered.graph.node)
    assert (ops["GroupQueryAttention"], ops["KVAttention"]) == (GLOBAL, SLIDING)


@pytest.mark.parametrize("target", ["cpu", "cpu-portable"])
def test_first_step_logits(bundles, reference_logits, prompts, target):
    model = Model.load(bundles[target])
    for ids, want in zip(prompts, reference_logits, strict=True):
        assert np.abs(model.next_token_logits(ids) - want).max() < 1e-3


def test_greedy_64_tokens_identical_to_transformers(bundles, hf_model, prompts):
    model = Model.load(bundles["cpu"])
    for ids in prompts:
        with torch.no_grad():
            want = hf_model[0].generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        want = want[0, len(ids) :].tolist()
        got = list(model.generate_ids(ids, max_new_tokens=NEW_TOKENS))
        assert got == want, (model.decode(got), model.decode(want))


def test_greedy_portable_bundle_agrees(bundles, prompts):
    """Short: the portable graph's long-prompt path is covered by its first-step logits, and the rings run the
    same function body on both targets."""
    portable, fused = Model.load(bundles["cpu-portable"]), Model.load(bundles["cpu"])
    ids = prompts[0]
    assert list(portable.generate_ids(ids, max_new_tokens=32)) == list(fused.generate_ids(ids, max_new_tokens=32))
