"""Decode speed with recall against plain eviction, interleaved so that a changing load hits both alike: one
``--kv-recall`` bundle loaded twice (``kv_recall=0``: plain eviction over the same slots; and with recall), the same
passkey prompt read into each, then ``--steps`` decode steps fed to each in alternating groups of ``--group``.

    nice -n 10 python benchmarks/recall_speed.py BUNDLE --length 8000 --steps 64

Prints ms per step for each and the runtime's own recall time per step (host-tier copy, scoring, writes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402
import passkey  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from edgec.runtime import Model

    trial = passkey.make_trials([args.length], [0.1], 1, 0)[0]
    tokenizer = Tokenizer.from_file(str(args.bundle / "tokenizer.json"))
    bos = json.loads((args.bundle / "manifest.json").read_text())["generation"]["bos_token_id"]
    filler = tokenizer.encode("\n".join(models.austen_text(b) for b in passkey.FILLER_BOOKS), add_special_tokens=False)
    ids = np.asarray(passkey.prompt_ids(tokenizer, bos, trial, filler.ids), np.int64)
    continuation = filler.ids[: args.steps]
    runs = {}
    for name, load in (("plain eviction", {"kv_recall": 0}), ("recall", {})):
        model = Model.load(args.bundle, **load)
        state = model._backend.open_state()
        model._prefill(state, ids, all_logits=False)
        runs[name] = {"state": state, "seconds": 0.0, "recall_before": getattr(state, "recall_seconds", 0.0)}
    for start in range(0, args.steps, args.group):
        for run in runs.values():
            began = time.perf_counter()
            for offset in range(start, min(start + args.group, args.steps)):
                run["state"].run(np.array([continuation[offset]], np.int64), len(ids) + offset, last_only=True)
            run["seconds"] += time.perf_counter() - began
    for name, run in runs.items():
        recall = getattr(run["state"], "recall_seconds", 0.0) - run["recall_before"]
        print(
            f"{name}: {1000 * run['seconds'] / args.steps:.1f} ms/step ({args.steps / run['seconds']:.2f} tokens/s), "
            f"recall {1000 * recall / args.steps:.2f} ms/step"
        )
    tier = runs["recall"]["state"].tier
    print(f"host tier: {tier.length} positions × {tier.heads} rows, {tier.nbytes() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
