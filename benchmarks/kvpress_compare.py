"""edgec's compressed KV cache against NVIDIA's kvpress (0.5.5): same model, same text, same budget.

    bash benchmarks/kvpress_env.sh                 # once: .venv-kvpress with kvpress==0.5.5 (transformers < 5.3)
    python benchmarks/kvpress_compare.py           # with the main venv (edgec); runs kvpress in .venv-kvpress
    python benchmarks/kvpress_compare.py --emulate  # also kvpress running edgec's SnapKV rule (a cross-check)
    python benchmarks/kvpress_compare.py --samples 1    # a quicker look (the docs' table: 4 samples, --emulate)

Protocol
  Model: SmolLM2-135M-Instruct, fp32 — the Hugging Face folder holding the GGUF's dequantized weights
  (models.smollm2_hf_folder()); kvpress runs it in PyTorch (sdpa), edgec as an ONNX Runtime bundle built from it.
  Text: Pride and Prejudice after its first 5000 characters (the Gutenberg header, as decode.py), tokenized once
  with the model's tokenizer (no BOS: SmolLM2 uses none). ``--samples`` non-overlapping windows spread evenly
  over the book, each ``--context`` tokens of context followed by ``--continuation`` tokens to score.
  For each press and budget (the share of the context's tokens kept per layer and KV head):
    kvpress  ``with press(model): model(context, past_key_values=DynamicCache())`` compresses the context's cache
             (compression_ratio = 1 - budget); then the continuation (but its last token) is fed teacher-forced in
             one call through that cache with position_ids continuing the original positions, as kvpress's own
             pipeline does for a question. The context's last logits give the first prediction.
    edgec    a bundle built with kv_policy = snapkv | streaming, kv_dtype fp32, prefill_compress "end", loaded
             with ``kv_capacity = budget × context``; ``Model.continuation_logprobs(..., with_top1=True)``: the
             whole context is read into a temporary full cache, the best ``capacity`` slots per KV head are
             kept, the continuation is fed through that cache.
  Uncompressed reference: kvpress without a press; edgec's plain bundle (no --kv-*).
  The continuation is scored in one call in both (edgec feeds min(prefill_chunk, capacity) ≥ continuation
  tokens per call): its tokens attend to the kept context slots plus each other, nothing is evicted meanwhile.
  Metrics per (press, budget): perplexity of the continuation (exp of the mean negative log-likelihood over
  all samples' continuation tokens); top-1 agreement of each implementation with its own uncompressed run
  (argmax of the next-token logits at every continuation position); top-1 agreement kvpress ↔ edgec.

Settings (edgec's defaults; kvpress matched where its parameters allow):
  StreamingLLM   kvpress n_sink=4 + the most recent tokens; edgec sink 4 + everything by recency (score = position).
                 The same rule: the kept sets are identical.
  SnapKV         edgec: attention of the last 32 prompt queries (observe=32), summed over query heads, max-pooled
                 over 7 neighbouring positions; 4 sinks and a recent window of 64 always kept.
                 kvpress ("snapkv"): window_size=32 (observation queries, which are also the only recent tokens
                 it always keeps), kernel_size=7, average-pooled, averaged over query heads; no sinks forced.
                 kvpress ("snapkv-default"): its defaults, window_size=64, kernel_size=5.

Exchange: benchmarks/out/kvpress/samples.npz (token ids) → kvpress.npz (the worker's results, written by this
file run as ``--worker`` in .venv-kvpress) and edgec.npz; summary kvpress.json, kvpress.png, a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "kvpress"
KVPRESS_PYTHON = HERE.parent / ".venv-kvpress" / "bin" / "python"
BUDGETS = (0.5, 0.25, 0.125)
# (label, kvpress press class, its extra parameters, edgec policy)
PRESSES = (
    ("snapkv", "SnapKVPress", {"window_size": 32, "kernel_size": 7}, "snapkv"),
    ("snapkv-default", "SnapKVPress", {"window_size": 64, "kernel_size": 5}, None),
    ("streaming", "StreamingLLMPress", {"n_sink": 4}, "streaming"),
)
TEXT_START = 5000  # characters: past the Gutenberg header
EMULATED = "snapkv-edgec-rule"  # kvpress running edgec's SnapKV rule (--emulate), compared with edgec's snapkv


def configs(emulated: bool = False) -> list[tuple[str, float]]:
    """(press label, budget); ("full", 1.0) is the uncompressed reference."""
    labels = [label for label, *_ in PRESSES] + ([EMULATED] if emulated else [])
    return [("full", 1.0)] + [(label, budget) for label in labels for budget in BUDGETS]


def key(label: str, budget: float) -> str:
    return f"{label}@{budget:g}"


def log_softmax_pick(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
    return logits[np.arange(len(targets)), targets] - log_norm


# --- kvpress (runs in .venv-kvpress) ---------------------------------------------------------------------------
def edgec_rule_press(compression_ratio: float):
    """A kvpress ScorerPress that applies edgec's SnapKV rule at the end of a prompt (reference.select_slots with
    policies/snapkv.py): attention of the last 32 queries, summed over them and the KV head's query heads, max-pooled
    over 7 positions, 4 sinks and the last 64 positions always kept. An independent implementation of edgec's
    selection in kvpress's machinery: it should agree with edgec up to near-ties."""
    import torch
    from kvpress import SnapKVPress
    from kvpress.utils import get_prerope_query_states
    from torch.nn import functional as F
    from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

    observe, pool, sink, window = 32, 7, 4, 64

    class EdgecRuleSnapKVPress(SnapKVPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            bsz, kv_heads, k_len, head_dim = keys.shape
            query = get_prerope_query_states(module, hidden_states[:, -observe:])
            cos, sin = (x[:, -observe:].unsqueeze(1) for x in kwargs["position_embeddings"])
            query = query * cos + rotate_half(query) * sin
            logits = query @ repeat_kv(keys, query.shape[1] // kv_heads).transpose(2, 3) / head_dim**0.5
            future = torch.ones(observe, k_len, dtype=torch.bool).triu(k_len - observe + 1)
            probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1, dtype=torch.float32)
            scores = probs.sum(dim=2).view(bsz, kv_heads, -1, k_len).sum(dim=2)  # [B, Hkv, k_len]
            scores = F.max_pool1d(scores, kernel_size=pool, padding=pool // 2, stride=1)
            scores[..., :sink] = float("inf")
            scores[..., k_len - window :] = float("inf")
            return scores

    return EdgecRuleSnapKVPress(compression_ratio=compression_ratio, window_size=observe)


def kvpress_worker(folder: Path, samples: Path, result: Path, threads: int, emulate: bool) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    data = np.load(samples)
    contexts, continuations = data["context"], data["continuation"]
    out: dict[str, np.ndarray] = {}
    by_label = {label: (getattr(kvpress, cls), params) for label, cls, params, _ in PRESSES}
    for label, budget in [(EMULATED, budget) for budget in BUDGETS] if emulate else configs():
        logprobs, argmax, seconds = [], [], []
        for context, continuation in zip(contexts, continuations, strict=True):
            start = time.perf_counter()
            cache = DynamicCache()
            ids = torch.tensor(context[None])
            with torch.no_grad():
                if label == "full":
                    first = model(ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
                else:
                    if label == EMULATED:
                        press = edgec_rule_press(1 - budget)
                    else:
                        cls, params = by_label[label]
                        press = cls(compression_ratio=1 - budget, **params)
                    with press(model):
                        first = model(ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
                    kept = cache.get_seq_length()
                    assert kept == round(budget * len(context)), (label, budget, kept)
                positions = torch.arange(len(context), len(context) + len(continuation) - 1)[None]
                rest = model(torch.tensor(continuation[None, :-1]), past_key_values=cache, position_ids=positions)
                logits = torch.cat([first[None], rest.logits[0]]).double().numpy()
            seconds.append(time.perf_counter() - start)
            logprobs.append(log_softmax_pick(logits, continuation))
            argmax.append(logits.argmax(-1))
        out[key(label, budget) + ":logprob"] = np.stack(logprobs)
        out[key(label, budget) + ":argmax"] = np.stack(argmax)
        print(f"kvpress {key(label, budget)}: {np.mean(seconds):.1f} s per sample", flush=True)
    versions = {"kvpress": "0.5.5", "torch": torch.__version__, "transformers": transformers.__version__}
    np.savez(result, versions=json.dumps(versions), **out)


# --- edgec (runs in the main venv) -----------------------------------------------------------------------------
def build_bundles(folder: Path, context: int, continuation: int, threads: int) -> dict[str, Path]:
    from edgec.build import BuildSettings, build

    total = context + continuation
    bundles = {"full": OUT / f"smollm2-ctx{total}-plain.edgec"}
    settings = {"full": BuildSettings(target="cpu", context=total)}
    for _, _, _, policy in PRESSES:
        if policy:
            bundles[policy] = OUT / f"smollm2-ctx{total}-{policy}.edgec"
            settings[policy] = BuildSettings(
                target="cpu",
                context=total,
                kv_capacity=round(max(BUDGETS) * context),
                kv_policy=policy,
                kv_dtype="fp32",
                prefill_compress="end",
            )
    for name, path in bundles.items():
        if not (path / "manifest.json").exists():
            start = time.perf_counter()
            build(folder, path, settings[name])
            print(f"built {path.name} in {time.perf_counter() - start:.0f} s", flush=True)
    return bundles


def run_edgec(bundles: dict[str, Path], samples: Path, threads: int) -> dict[str, np.ndarray]:
    from edgec.runtime.model import Model

    data = np.load(samples)
    contexts, continuations = data["context"], data["continuation"]
    out: dict[str, np.ndarray] = {}
    policy_of = {label: policy for label, _, _, policy in PRESSES}
    for label, budget in configs():
        policy = "full" if label == "full" else policy_of[label]
        if policy is None:
            continue  # a kvpress-only variant
        capacity = None if label == "full" else round(budget * contexts.shape[1])
        model = Model.load(bundles[policy], threads=threads, kv_capacity=capacity)
        logprobs, argmax, seconds = [], [], []
        for context, continuation in zip(contexts, continuations, strict=True):
            start = time.perf_counter()
            lp, am = model.continuation_logprobs(context.tolist(), continuation.tolist(), with_top1=True)
            seconds.append(time.perf_counter() - start)
            logprobs.append(lp)
            argmax.append(am)
        out[key(label, budget) + ":logprob"] = np.stack(logprobs)
        out[key(label, budget) + ":argmax"] = np.stack(argmax)
        print(f"edgec {key(label, budget)}: {np.mean(seconds):.1f} s per sample", flush=True)
        del model
    return out


# --- samples, summary ------------------------------------------------------------------------------------------
def make_samples(folder: Path, path: Path, count: int, context: int, continuation: int) -> None:
    from tokenizers import Tokenizer

    sys.path.insert(0, str(HERE))
    import models

    ids = np.asarray(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(models.austen_text()[TEXT_START:]).ids)
    length = context + continuation
    if count * length > len(ids):
        sys.exit(f"the book has {len(ids)} tokens: {count} samples of {length} do not fit")
    starts = [i * (len(ids) - length) // max(count - 1, 1) for i in range(count)]
    windows = np.stack([ids[s : s + length] for s in starts]).astype(np.int64)
    np.savez(path, context=windows[:, :context], continuation=windows[:, context:], starts=np.asarray(starts))


def summarize(kv: dict[str, np.ndarray], ec: dict[str, np.ndarray]) -> dict:
    def ppl(logprob: np.ndarray) -> float:
        return float(np.exp(-logprob.mean()))

    def agree(a: np.ndarray, b: np.ndarray) -> float:
        return float((a == b).mean())

    rows = {}
    full = "full@1"
    for label, budget in configs(emulated=key(EMULATED, BUDGETS[0]) + ":logprob" in kv):
        k = key(label, budget)
        e = key("snapkv", budget) if label == EMULATED else k  # the edgec run it is compared with
        row = {"kvpress_ppl": ppl(kv[k + ":logprob"])}
        row["kvpress_top1_vs_full"] = agree(kv[k + ":argmax"], kv[full + ":argmax"])
        if e + ":logprob" in ec:
            row["edgec_ppl"] = ppl(ec[e + ":logprob"])
            row["edgec_top1_vs_full"] = agree(ec[e + ":argmax"], ec[full + ":argmax"])
            row["top1_kvpress_vs_edgec"] = agree(kv[k + ":argmax"], ec[e + ":argmax"])
        rows[k] = row
    return rows


TABLE_NAMES = {
    "full": "none (full cache)",
    "snapkv": "SnapKV (kvpress window 32, kernel 7)",
    "snapkv-default": "SnapKV (kvpress defaults: window 64, kernel 5; edgec —)",
    "streaming": "StreamingLLM (4 sinks)",
    EMULATED: "SnapKV, kvpress running edgec's rule (vs edgec SnapKV)",
}


def table(rows: dict, context: int) -> str:
    def cell(row, name, fmt):
        return format(row[name], fmt) if name in row else "—"

    lines = [
        "| press | budget (kept tokens) | perplexity kvpress | perplexity edgec | top-1 = full, kvpress "
        "| top-1 = full, edgec | top-1 kvpress = edgec |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, budget in configs(emulated=key(EMULATED, BUDGETS[0]) in rows):
        row = rows[key(label, budget)]
        name = TABLE_NAMES.get(label, label)
        lines.append(
            f"| {name} | {budget:.1%} ({round(budget * context)}) | {cell(row, 'kvpress_ppl', '.2f')} "
            f"| {cell(row, 'edgec_ppl', '.2f')} | {cell(row, 'kvpress_top1_vs_full', '.1%')} "
            f"| {cell(row, 'edgec_top1_vs_full', '.1%')} | {cell(row, 'top1_kvpress_vs_edgec', '.1%')} |"
        )
    return "\n".join(lines)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    full = rows["full@1"]
    axis.axhline(full["kvpress_ppl"], color="grey", linestyle=":", label="full cache (kvpress)")
    styles = {"snapkv": "tab:blue", "snapkv-default": "tab:cyan", "streaming": "tab:orange", EMULATED: "tab:green"}
    names = {
        "snapkv": "snapkv (window 32, kernel 7)",
        "snapkv-default": "snapkv (its defaults: window 64, kernel 5)",
        EMULATED: "with edgec's snapkv rule",
    }
    for label in [label for label, *_ in PRESSES] + ([EMULATED] if key(EMULATED, BUDGETS[0]) in rows else []):
        kv = [rows[key(label, b)]["kvpress_ppl"] for b in BUDGETS]
        axis.plot(BUDGETS, kv, "o--", color=styles[label], label=f"kvpress {names.get(label, label)}")
        if "edgec_ppl" in rows[key(label, BUDGETS[0])] and label != EMULATED:
            ec = [rows[key(label, b)]["edgec_ppl"] for b in BUDGETS]
            axis.plot(BUDGETS, ec, "s-", color=styles[label], label=f"edgec {label}")
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(BUDGETS), [f"{b:.1%}" for b in BUDGETS])
    axis.invert_xaxis()
    axis.set_xlabel("KV cache budget (share of the context kept)")
    axis.set_ylabel("continuation perplexity")
    axis.set_title("SmolLM2-135M fp32, Pride and Prejudice: edgec vs kvpress 0.5.5")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf", type=Path, help="the model's HF folder (default: models.smollm2_hf_folder())")
    parser.add_argument(
        "--emulate", action="store_true", help=f"also run kvpress with edgec's SnapKV rule ({EMULATED})"
    )
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("SAMPLES", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf is None:
        sys.path.insert(0, str(HERE))
        import models

        args.hf = models.smollm2_hf_folder()
    if args.worker:
        kvpress_worker(args.hf, *args.worker, args.threads, args.emulate)
        return
    if min(BUDGETS) * args.context < args.continuation:
        sys.exit("the smallest capacity must hold the continuation (it is scored in one call)")
    OUT.mkdir(parents=True, exist_ok=True)
    tag = f"{args.samples}x{args.context}+{args.continuation}"
    samples, kv_path, ec_path = (OUT / f"{name}-{tag}.npz" for name in ("samples", "kvpress", "edgec"))
    if not samples.exists():
        make_samples(args.hf, samples, args.samples, args.context, args.continuation)
    command = [str(KVPRESS_PYTHON), __file__, "--hf", str(args.hf), "--threads", str(args.threads)]
    if not KVPRESS_PYTHON.exists() and not kv_path.exists():
        sys.exit(f"{KVPRESS_PYTHON} is missing: bash benchmarks/kvpress_env.sh")
    if not kv_path.exists():
        subprocess.run([*command, "--worker", str(samples), str(kv_path)], check=True)
    if not ec_path.exists():
        bundles = build_bundles(args.hf, args.context, args.continuation, args.threads)
        np.savez(ec_path, **run_edgec(bundles, samples, args.threads))
    kv_data = np.load(kv_path)
    kv, ec = dict(kv_data), dict(np.load(ec_path))
    if args.emulate:
        emulated = OUT / f"kvpress-emulate-{tag}.npz"
        if not emulated.exists():
            subprocess.run([*command, "--emulate", "--worker", str(samples), str(emulated)], check=True)
        kv |= {name: value for name, value in np.load(emulated).items() if name.startswith(EMULATED)}
    rows = summarize(kv, ec)
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
        "protocol": vars(args) | {"hf": str(args.hf), "budgets": BUDGETS, "presses": [p[:3] for p in PRESSES]},
        "versions": json.loads(str(kv_data["versions"])),
    }
    (OUT / f"kvpress-{tag}.json").write_text(json.dumps(meta | {"results": rows}, indent=2, default=str))
    plot(rows, OUT / f"kvpress-{tag}.png")
    print(table(rows, args.context))
    print(f"wrote {OUT}/kvpress-{tag}.json and .png")


if __name__ == "__main__":
    main()
