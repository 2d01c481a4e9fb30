"""Error accumulation of the compressed cache's storage: KL(full fp32 cache ‖ compressed cache) at every position
of 1024 teacher-forced tokens of Pride and Prejudice, for fp16 / int8 / int4 / int4 + rotation slots.

    python benchmarks/kv_error_curve.py                    # SmolLM2-135M fp32 weights, 512 slots, snapkv
    python benchmarks/kv_error_curve.py --capacity 1024    # no eviction: storage alone

The first 16 tokens are read as a prompt, every later one is fed as a decode step (``Model.iter_logits``), so the
cache quantizes and (past the capacity) evicts exactly as it does while generating; the reference is the plain,
uncompressed fp32 cache of the same weights (``edgec eval``'s error curve: ``edgec.evaluate.compare_logits``).
Bundles come from benchmarks/kv_quality.py (8K context, ``--prefill-compress chunk``, built once, capacity set at
load). Results: benchmarks/out/kv_error_curve.json and docs/img/kv-error-curve.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quality  # noqa: E402
import models  # noqa: E402

PROMPT = 16
CACHES = {  # label → (policy, dtype, rotated)
    "fp16": ("snapkv", "fp16", False),
    "int8": ("snapkv", "int8", False),
    "int4": ("snapkv", "int4", False),
    "int4 + rotation": ("snapkv", "int4", True),
}


def curve(path: Path, capacity: int | None, ids: list[int], reference: list[np.ndarray], threads: int) -> dict:
    from edgec.evaluate import compare_logits
    from edgec.runtime import Model

    model = Model.load(path, threads=threads, kv_capacity=capacity)
    ours = np.concatenate([logits for _, logits in model.iter_logits(ids, prompt_tokens=PROMPT)])
    kl, largest, top1 = compare_logits(np.concatenate(reference), ours)
    return {"kl": kl.tolist(), "max_abs_logit": largest.tolist(), "top1": top1.mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES), help="which caches")
    parser.add_argument(
        "--plot", type=Path, default=Path(__file__).resolve().parents[1] / "docs/img/kv-error-curve.png"
    )
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from edgec.runtime import Model

    plain = kv_quality.bundle(None, None)
    tokenizer = Tokenizer.from_file(str(plain / "tokenizer.json"))
    ids = tokenizer.encode(models.austen_text()[5000:]).ids[: args.tokens]
    started = time.time()
    reference = [logits.copy() for _, logits in Model.load(plain, threads=args.threads).iter_logits(ids, PROMPT)]
    print(f"reference: {time.time() - started:.0f} s", flush=True)
    results = {}
    for label in args.caches:
        policy, dtype, rotated = CACHES[label]
        started = time.time()
        path = kv_quality.bundle(policy, dtype, rotation=rotated)
        results[label] = curve(path, args.capacity, ids, reference, args.threads)
        kl = np.asarray(results[label]["kl"])
        quarters = " → ".join(f"{part.mean():.2e}" for part in np.array_split(kl, 4))
        print(
            f"{label:16} mean KL {kl.mean():.2e} ({quarters}), max {kl.max():.2e}, top-1 "
            f"{results[label]['top1']:.1%}  [{time.time() - started:.0f} s]",
            flush=True,
        )
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {args.threads} threads",
        "command": "python " + " ".join(sys.argv),
        "tokens": args.tokens,
        "capacity": args.capacity,
        "results": results,
    }
    (models.OUT / "kv_error_curve.json").write_text(json.dumps(report) + "\n")
    plot(results, args)


def plot(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgec.plots import _smooth

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for label, result in results.items():
        kl = np.asarray(result["kl"])
        smooth = np.maximum(_smooth(kl, 32), 1e-12)
        axis.plot(np.arange(len(smooth)) + 15.5, smooth, label=f"{label} (mean KL {kl.mean():.1e})")
    axis.axvline(args.capacity, color="grey", linestyle=":", label=f"{args.capacity} slots full: eviction starts")
    axis.set_yscale("log")
    axis.set_xlabel("position (16-token prompt, then one decode step per token)")
    axis.set_ylabel("KL(full fp32 cache ‖ compressed), 32-token mean")
    axis.set_title(f"SmolLM2-135M: error accumulation of the cache's storage, {args.capacity} snapkv slots")
    axis.legend(fontsize=8)
    figure.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
