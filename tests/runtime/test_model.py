"""edgec.runtime.Model on a tiny random-weight bundle, against transformers."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from edgec.errors import BundleError, GenerationError
from edgec.runtime import Model

PROMPT = "The built-in function len() returns"


@pytest.fixture(scope="module")
def model(tiny_bundle) -> Model:
    return Model.load(tiny_bundle)


def hf_greedy(hf_model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("bundle", ["tiny_bundle", "tiny_portable_bundle"])
def test_greedy_matches_transformers(bundle, request, tiny_hf_model):
    model = Model.load(request.getfixturevalue(bundle))
    model.eos_token_ids = set()  # compare the full 40 tokens
    for prompt in (PROMPT, "x = [i * i for i in range(10)]\n" * 3):
        ids = model.encode(prompt)
        assert list(model.generate_ids(ids, max_new_tokens=40)) == hf_greedy(tiny_hf_model, ids, 40)


def test_logprobs_match_transformers(model, tiny_hf_model):
    from tests.conftest import pydoc_text

    ids = model.encode(pydoc_text()[:3000])[:120]  # crosses several 16-token prefill chunks
    got = model.logprobs(ids)
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    assert got.shape == (len(ids) - 1,)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_stream_yields_the_same_text(model):
    text = model.generate(PROMPT, max_new_tokens=30)
    pieces = list(model.generate(PROMPT, max_new_tokens=30, stream=True))
    assert "".join(pieces) == text
    assert len(pieces) > 1


def test_stop_string_ends_generation(model):
    text = model.generate(PROMPT, max_new_tokens=30)
    stop = text[5:8]
    assert model.generate(PROMPT, max_new_tokens=30, stop=[stop]) == text[: text.index(stop)]
    assert "".join(model.generate(PROMPT, max_new_tokens=30, stop=stop, stream=True)) == text[: text.index(stop)]


def test_sampling_is_seeded(model):
    first = model.generate(PROMPT, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=3)
    assert first == model.generate(PROMPT, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=3)
    others = {model.generate(PROMPT, max_new_tokens=20, temperature=1.5, seed=s) for s in range(5)}
    assert len(others) > 1
    greedy = model.generate(PROMPT, max_new_tokens=20)
    assert model.generate(PROMPT, max_new_tokens=20, temperature=0.7, top_k=1, seed=0) == greedy


def test_chat_format_matches_the_template(model, tiny_tokenizer):
    messages = [{"role": "user", "content": "What does len do?"}]
    want = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(want, dict) or hasattr(want, "input_ids"):
        want = want["input_ids"]
    assert model.tokenizer.encode_chat(messages) == list(want)
    assert isinstance(model.generate(messages=messages, max_new_tokens=5), str)
    assert model.generate("What does len do?", chat=True, max_new_tokens=5) == model.generate(
        messages=messages, max_new_tokens=5
    )


def test_generation_stops_at_the_context(model):
    ids = model.encode(PROMPT)
    model_context = model.context
    tokens = list(model.generate_ids(ids, max_new_tokens=10 * model_context))
    assert len(ids) + len(tokens) <= model_context + 1


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(prompt=""), GenerationError),
        (dict(prompt=[]), GenerationError),
        (dict(prompt=[10**9]), GenerationError),
        (dict(prompt=[-1]), GenerationError),
        (dict(prompt=[1.5]), TypeError),
        (dict(prompt=42), TypeError),
        (dict(prompt=None), GenerationError),
        (dict(prompt="hi", max_new_tokens=-1), GenerationError),
        (dict(prompt="hi", max_new_tokens=2.5), TypeError),
        (dict(prompt="hi", temperature=float("nan")), GenerationError),
        (dict(prompt="hi", temperature=-0.1), GenerationError),
        (dict(prompt="hi", top_p=0.0), GenerationError),
        (dict(prompt="hi", top_p=1.5), GenerationError),
        (dict(prompt="hi", top_k=-2), GenerationError),
        (dict(prompt="hi", stop=[""]), GenerationError),
        (dict(messages=[{"role": "robot", "content": "x"}]), GenerationError),
        (dict(messages=[]), GenerationError),
    ],
)
def test_bad_arguments_raise_clear_errors(model, kwargs, error):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(error):
        result = model.generate(prompt, **kwargs)
        list(result)


def test_prompt_longer_than_context(model):
    with pytest.raises(GenerationError, match="context is 128"):
        model.generate([5] * 129, max_new_tokens=1)
    with pytest.raises(GenerationError, match="context"):
        model.logprobs([5] * 200)


def test_load_refuses_a_damaged_bundle(tiny_bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy.edgec"
    shutil.copytree(tiny_bundle, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="missing tokenizer.json"):
        Model.load(copy)
    shutil.copy(tiny_bundle / "tokenizer.json", copy / "tokenizer.json")
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (copy / "model.onnx.data").write_bytes(bytes(data))
    Model.load(copy)  # same size: only the full hash check sees it
    with pytest.raises(BundleError, match="model.onnx.data"):
        Model.load(copy, check_hashes=True)
    (copy / "model.onnx.data").write_bytes(bytes(data[:-10]))
    with pytest.raises(BundleError, match="truncated"):
        Model.load(copy)


def test_runtime_imports_neither_torch_nor_onnx(tiny_bundle):
    code = (
        "import sys\n"
        "from edgec.runtime import Model\n"
        f"m = Model.load({str(tiny_bundle)!r})\n"
        "m.generate('def f(x):', max_new_tokens=5)\n"
        "m.logprobs(m.encode('return the length'))\n"
        "heavy = [name for name in ('torch', 'transformers', 'onnx', 'onnx_ir', 'onnxscript', 'jinja2') "
        "if name in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_one_token_prefill_chunks_do_not_alias(tiny_bundle, tiny_hf_model):
    """Decode-sized steps reuse one logits buffer; scoring with 1-token chunks must still keep every row."""
    model = Model.load(tiny_bundle)
    model.prefill_chunk = 1
    ids = model.encode(PROMPT)
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(model.logprobs(ids), want, atol=1e-4)
    first = model.next_token_logits(ids[:1])
    second = model.next_token_logits(ids[:1] + ids[:1])
    assert not np.shares_memory(first, second)
