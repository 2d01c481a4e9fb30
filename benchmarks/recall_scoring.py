"""How well a block summary finds a passkey's evicted tokens: read a passkey prompt into a ``--kv-recall`` bundle,
then, in each global layer, rank the host tier's blocks against the prompt's last query by several summaries
(mean key, Quest's min/max bound) and block sizes, recall ``--slots`` tokens not in the op's slots, and count
how many of the evicted key-digit tokens each brings back (plus the exact top-``slots`` tokens by q·k).

    nice -n 10 python benchmarks/recall_scoring.py BUNDLE --length 2000 --depth-index 0 --kv-capacity 128 --kv-recall 2

The bundle: a Gemma-3-270m ``--kv-recall`` bundle (benchmarks/passkey.py builds one). Prints one line per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402
import passkey  # noqa: E402


def summaries(keys: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """keys [N, D] → per block of ``block`` positions: min, max, mean (each [blocks, D])."""
    count = -(-len(keys) // block)
    padded = np.zeros((count * block, keys.shape[1]), np.float32)
    padded[: len(keys)] = keys
    grouped = padded.reshape(count, block, -1)
    real = (np.arange(count * block) < len(keys)).reshape(count, block, 1)
    low = np.where(real, grouped, np.inf).min(1)
    high = np.where(real, grouped, -np.inf).max(1)
    return low, high, np.where(real, grouped, 0).sum(1) / real.sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depth-index", type=int, default=0, help="0, 1, 2: depth 0.1, 0.5, 0.9 (passkey.py's)")
    parser.add_argument("--kv-capacity", type=int, default=128)
    parser.add_argument("--kv-recall", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64, help="tokens recalled")
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from edgec.kvcache.quantize import dequantize
    from edgec.kvcache.recall import block_scores, choose
    from edgec.runtime import Model

    trial = passkey.make_trials([args.length], [0.1, 0.5, 0.9], 3, 0)[args.depth_index]
    tokenizer = Tokenizer.from_file(str(args.bundle / "tokenizer.json"))
    bos = json.loads((args.bundle / "manifest.json").read_text())["generation"]["bos_token_id"]
    filler = tokenizer.encode("\n".join(models.austen_text(b) for b in passkey.FILLER_BOOKS), add_special_tokens=False)
    ids = np.asarray(passkey.prompt_ids(tokenizer, bos, trial, filler.ids), np.int64)
    digits = set(tokenizer.encode(str(trial["key"]), add_special_tokens=False).ids)
    needle = [i for i in range(5, len(ids) - 30) if ids[i] in digits]  # not the BOS/intro, not the question
    print(f"key {trial['key']} at positions {needle}")
    model = Model.load(args.bundle, kv_capacity=args.kv_capacity, kv_recall=args.kv_recall)
    compression = model.cache_spec.compression
    with model._state() as state:
        model._prefill(state, ids, all_logits=False)
        tier = state.tier
        for layer in (entry.layer for entry in model.cache_spec.layers if entry.compressed and not entry.window):
            rows = state.rows(layer)
            query = state._queries[layer][0]
            scale = tier.arrays["k_scale"][rows, : tier.length] if "k_scale" in tier.arrays else None
            keys = dequantize(tier.arrays["k"][rows, : tier.length], scale, compression.dtype, compression.group)[0]
            op_slots = state._views[layer]["pos"][0, 0, : state._views[layer]["pos"].shape[2] - state.reserved]
            candidate = np.ones((1, tier.length), bool)
            candidate[0, op_slots[op_slots >= 0]] = False
            missing = [p for p in needle if candidate[0, p]]
            none = np.zeros_like(candidate)
            found = {}
            for block in (16, 8, 4):
                low, high, mean = summaries(keys, block)
                grouped = query.reshape(-1, query.shape[-1])
                quest = (np.maximum(grouped, 0) @ high.T + np.minimum(grouped, 0) @ low.T).max(0)
                for name, score in (("mean", block_scores(query, mean[None])[0]), ("quest", quest)):
                    chosen = set(choose(score[None], candidate, none, block, args.slots)[0].tolist())
                    found[f"{name}{block}"] = sum(p in chosen for p in missing)
            exact = set(choose((query @ keys.T).max(0)[None], candidate, none, 1, args.slots)[0].tolist())
            found["exact q·k"] = sum(p in exact for p in missing)
            print(f"layer {layer}: {len(missing)} of {len(needle)} key tokens not in the op's slots; recalled: {found}")


if __name__ == "__main__":
    main()
