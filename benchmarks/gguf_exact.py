"""Does an int4 bundle built from a GGUF keep the model's answers? Issue 16's checks, against the fp32 bundle of the
same GGUF (which is the GGUF's weights, dequantized):

    python benchmarks/gguf_exact.py GGUF FP32_BUNDLE INT4_BUNDLE [INT4_BUNDLE ...]

For each int4 bundle: greedy output (48 new tokens) on 5 prompts, 2 chat and 3 plain, identical or not; the largest
|Δ| of the first-step logits over those prompts; perplexity on benchmarks/perplexity.py's four 1024-token windows and
its change against the fp32 bundle; weight bytes (model.onnx + model.onnx.data) against the GGUF file's size.
Prints one JSON line per bundle and a markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perplexity  # noqa: E402

NEW_TOKENS = 48
CHAT = ["What is the capital of France?", "Give me three tips for learning to play the guitar."]
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
]


def weight_bytes(bundle: Path) -> int:
    return sum(path.stat().st_size for path in bundle.glob("model.onnx*"))


# for a bundle without a chat format (Gemma-3-270m's GGUF carries no template): the questions as plain text
CHAT_AS_PLAIN = ["Question: What is the capital of France?\nAnswer:", "Three tips for learning to play the guitar:\n1."]


def answers(model) -> list[tuple[str, str, np.ndarray]]:
    """(kind, greedy text, first-step logits) per prompt."""
    out = []
    if model.tokenizer.chat_format is None:
        for text in CHAT_AS_PLAIN:
            out.append(("plain", model.generate(text, max_new_tokens=NEW_TOKENS), model.next_token_logits(text)))
    for text in CHAT if model.tokenizer.chat_format is not None else []:
        messages = [{"role": "user", "content": text}]
        ids = model.tokenizer.encode_chat(messages)
        out.append(("chat", model.generate(messages=messages, max_new_tokens=NEW_TOKENS), model.next_token_logits(ids)))
    for text in PLAIN:
        out.append(("plain", model.generate(text, max_new_tokens=NEW_TOKENS), model.next_token_logits(text)))
    return out


def main() -> None:
    from edgec.runtime import Model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("reference", type=Path, help="the fp32 bundle of the same GGUF")
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--no-perplexity", action="store_true")
    args = parser.parse_args()
    reference = answers(Model.load(args.reference))
    reference_ppl = None if args.no_perplexity else perplexity.perplexity(args.reference)
    rows = []
    for bundle in args.bundles:
        got = answers(Model.load(bundle))
        same = [want[1] == have[1] for want, have in zip(reference, got, strict=True)]
        logit_error = max(float(np.abs(want[2] - have[2]).max()) for want, have in zip(reference, got, strict=True))
        ppl = None if args.no_perplexity else perplexity.perplexity(bundle)
        row = {
            "bundle": bundle.name,
            "greedy_identical": f"{sum(same)}/{len(same)}",
            "differs_on": [
                f"{kind}: {have[1][:80]!r} vs {want[1][:80]!r}"
                for (kind, *_), want, have, ok in zip(got, reference, got, same, strict=True)
                if not ok
            ],
            "first_step_max_abs_logit_error": logit_error,
            "perplexity": ppl,
            "reference_perplexity": reference_ppl,
            "perplexity_change": None if ppl is None else ppl / reference_ppl - 1,
            "weight_bytes": weight_bytes(bundle),
            "gguf_bytes": args.gguf.stat().st_size,
            "weights_over_gguf": weight_bytes(bundle) / args.gguf.stat().st_size,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| bundle | greedy identical | first-step max abs Δlogit | perplexity (fp32 bundle) | weights / GGUF |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        ppl = (
            "–"
            if row["perplexity"] is None
            else (f"{row['perplexity']:.3f} ({row['reference_perplexity']:.3f}, {row['perplexity_change']:+.2%})")
        )
        print(
            f"| {row['bundle']} | {row['greedy_identical']} | {row['first_step_max_abs_logit_error']:.2e} | {ppl} | "
            f"{row['weight_bytes'] / 1e6:.1f} MB / {row['gguf_bytes'] / 1e6:.1f} MB = {row['weights_over_gguf']:.3f}× |"
        )


if __name__ == "__main__":
    main()
