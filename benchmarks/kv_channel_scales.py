"""Would static per-channel int8 scales — the cache format ONNX Runtime's GroupQueryAttention reads itself
(benchmarks/gqa_native_ceiling.py) — keep the cache's quality? A storage-only probe in PyTorch:

    python benchmarks/kv_channel_scales.py [--tokens 2048] [--calibration-tokens 2048]

SmolLM2-135M (fp32, the HF folder made from the GGUF) scores a window of Pride and Prejudice with every
attention's keys (after RoPE) and values stored as int8 in one of these ways (every token kept, no eviction: the
storage's own error):

- **per-slot groups** — today's format: each token's k and v rows in groups of 32 channels, absmax/127 per group;
- **per channel, calibrated** — one scale per layer, KV head and channel, absmax/127 over a calibration text of
  another domain (pydoc_data.topics, in every Python) times a headroom; what exceeds it is clipped. This is what a
  bundle could carry as constants;
- **per channel, from the prompt** — the absmax of the window's first half (what a runtime could set when a prompt
  ends, before decoding) times a headroom, the whole window scored with it;
- **per channel, from the window** — the same with the scored window's own absmax (an oracle: the best any static
  per-channel scale could do on this text).

Reported per storage: perplexity, its change against fp32 storage, the mean KL of the next-token distributions
against fp32 storage, and how many of the stored values were clipped. ``--passkeys``: also the six passkey prompts
of benchmarks/kv_passkey.py (~3,500 tokens, two keys at three depths), every token kept: how many keys stay the
top-1 continuation and the keys' mean log-probability, per storage. Results: benchmarks/out/kv_channel_scales.json;
the printed table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402

RESULTS = models.OUT / "kv_channel_scales.json"
GROUP = 32


def group_int8(x):
    """Today's storage: x [..., D] rounded per group of ``GROUP`` channels of each row, absmax/127 (symmetric)."""
    import torch

    groups = x.reshape(*x.shape[:-1], -1, GROUP)
    step = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(groups / step) * step).reshape(x.shape)


def channel_int8(x, scale):
    """Per-channel storage: x [B, Hkv, T, D] as round(x / scale) clipped to int8, scale [Hkv, 1, D] — as
    GroupQueryAttention quantizes (PER_CHANNEL, 8 bits). Returns (stored values, how many were clipped)."""
    import torch

    codes = torch.round(x / scale)
    clipped = int(((codes < -128) | (codes > 127)).sum())
    return codes.clamp(-128, 127) * scale, clipped


class Storage:
    """What every attention call does to its keys and values: ``mode`` fp32 / group / channel / record."""

    def __init__(self) -> None:
        self.mode = "fp32"
        self.scales: dict[tuple[int, str], object] = {}  # (layer, "k"/"v") → [Hkv, 1, D]
        self.absmax: dict[tuple[int, str], object] = {}
        self.clipped = 0
        self.values = 0
        self.rotation = None  # (signs [Hkv, 1, D], H/√D [D, D]) torch tensors: --kv-rotation hadamard's transform

    def __call__(self, layer: int, key, value):
        if self.rotation is None:
            return self._store(layer, key, value)
        signs, matrix = self.rotation  # stored rotated, read back rotated back: x → (x ⊙ s) H → (y H) ⊙ s
        stored = self._store(layer, (key * signs) @ matrix, (value * signs) @ matrix)
        return [(y @ matrix) * signs for y in stored]

    def _store(self, layer: int, key, value):
        stored = []
        for kind, x in (("k", key), ("v", value)):
            if self.mode == "record":
                seen = x.abs().amax(dim=(0, 2)).unsqueeze(1)  # [Hkv, 1, D]
                previous = self.absmax.get((layer, kind))
                self.absmax[layer, kind] = seen if previous is None else previous.maximum(seen)
                stored.append(x)
            elif self.mode == "group":
                stored.append(group_int8(x))
            elif self.mode == "channel":
                quantized, clipped = channel_int8(x, self.scales[layer, kind])
                self.clipped += clipped
                self.values += x.numel()
                stored.append(quantized)
            else:
                stored.append(x)
        return stored

    def scales_from(self, absmax: dict, headroom: float) -> dict:
        return {key: (value * headroom / 127).clamp_min(1e-8) for key, value in absmax.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--headrooms", default="1.0,1.25,1.5")
    parser.add_argument("--passkeys", action="store_true", help="also the passkey prompts of kv_passkey.py")
    args = parser.parse_args()

    import pydoc_data.topics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    folder = models.smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    storage = Storage()
    original = modeling_llama.eager_attention_forward

    def attention(module, query, key, value, *rest, **options):
        key, value = storage(module.layer_idx, key, value)
        return original(module, query, key, value, *rest, **options)

    modeling_llama.eager_attention_forward = attention
    window = tokenizer(models.austen_text()[5000:], return_tensors="pt").input_ids[:, : args.tokens]
    calibration_text = "\n".join(pydoc_data.topics.topics.values())
    calibration = tokenizer(calibration_text, return_tensors="pt").input_ids[:, : args.calibration_tokens]

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0, :-1].float(), -1)

    storage.mode = "fp32"
    reference = logprobs(window)
    targets = window[0, 1:]

    def score(name: str) -> dict:
        storage.clipped = storage.values = 0
        scored = logprobs(window)
        nll = -scored.gather(1, targets[:, None]).mean()
        kl = (reference.exp() * (reference - scored)).sum(-1).mean()
        row = {"storage": name, "perplexity": float(nll.exp()), "kl_vs_fp32": float(kl)}
        row["clipped_fraction"] = storage.clipped / storage.values if storage.values else 0.0
        if cases:
            row |= passkeys()
        print(row, flush=True)
        return row

    cases = []
    if args.passkeys:
        import kv_passkey
        from tokenizers import Tokenizer

        cases = kv_passkey.prompts(Tokenizer.from_file(str(folder / "tokenizer.json")), 3500)

    def passkeys() -> dict:
        """Every passkey prompt teacher-forced through its answer: keys still top-1, mean key log-probability."""
        found, key_logprobs = 0, []
        for _, _, context, answer in cases:
            scored = logprobs(torch.tensor([context + answer]))[len(context) - 1 :]
            target = torch.tensor(answer)
            key_logprobs.append(float(scored.gather(1, target[:, None]).sum()))
            found += bool((scored.argmax(-1) == target).all())
        return {"passkeys_top1": found, "passkey_cases": len(cases), "passkey_logprob": key_logprobs}

    rows = [score("fp32 (no quantization)")]
    storage.mode = "group"
    rows.append(score(f"int8, per-slot groups of {GROUP} (today)"))
    storage.mode = "record"
    logprobs(calibration)
    calibrated = dict(storage.absmax)
    storage.absmax = {}
    logprobs(window)
    oracle = dict(storage.absmax)
    storage.absmax = {}
    logprobs(window[:, : window.shape[1] // 2])
    prompt = dict(storage.absmax)
    storage.mode = "channel"
    for headroom in [float(h) for h in args.headrooms.split(",")]:
        storage.scales = storage.scales_from(calibrated, headroom)
        rows.append(score(f"int8, per channel, calibrated on pydoc × {headroom:g}"))
    for headroom in (1.0, 1.25):
        storage.scales = storage.scales_from(prompt, headroom)
        rows.append(score(f"int8, per channel, the window's first half × {headroom:g}"))
    storage.scales = storage.scales_from(oracle, 1.0)
    rows.append(score("int8, per channel, the window's own absmax (oracle)"))
    # the same with --kv-rotation hadamard's transform (edgec.kvcache.rotation) before storing
    from edgec.kvcache import rotation

    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    signs = torch.from_numpy(rotation.signs(0, kv_heads, head_dim))[:, None, :]
    storage.rotation = (signs, torch.from_numpy(rotation.hadamard(head_dim)))
    storage.mode = "group"
    rows.append(score(f"rotated, int8, per-slot groups of {GROUP} (today with --kv-rotation hadamard)"))
    storage.mode = "record"
    storage.absmax = {}
    logprobs(calibration)
    calibrated = dict(storage.absmax)
    storage.mode = "channel"
    for headroom in (1.0, 1.25):
        storage.scales = storage.scales_from(calibrated, headroom)
        rows.append(score(f"rotated, int8, per channel, calibrated on pydoc × {headroom:g}"))
    fp32 = rows[0]["perplexity"]
    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "tokens": int(window.shape[1]),
        "calibration_tokens": int(calibration.shape[1]),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(results, indent=2))
    keys = " | passkeys top-1 | mean key log-prob" if cases else ""
    head = f"| storage of k (after RoPE) and v, {window.shape[1]} tokens | perplexity | vs fp32 | mean KL | clipped"
    print(f"{head}{keys} |")
    print("|---|---|---|---|---|" + ("---|---|" if cases else ""))
    for row in rows:
        change = (row["perplexity"] / fp32 - 1) * 100
        found = ""
        if cases:
            mean = sum(row["passkey_logprob"]) / len(cases)
            found = f" {row['passkeys_top1']}/{row['passkey_cases']} | {mean:.3f} |"
        print(
            f"| {row['storage']} | {row['perplexity']:.3f} | {change:+.2f} % | {row['kl_vs_fp32']:.2e} | "
            f"{row['clipped_fraction'] * 100:.3f} % |{found}"
        )


if __name__ == "__main__":
    main()
