"""Which prompt chunk size reads an 8K-token prompt fastest: the plain int4 bundle and the compressed one (1024 int8
slots, ``end``) of benchmarks/kv_speed.py, every chunk size in ONE process, sizes alternating within each round.

    python benchmarks/prefill_chunk.py [--sizes 256,512,1024,2048] [--rounds 1] [--threads 1] [--prompt 8000]

A bundle's graph takes chunks of any length on the cpu target, so the size is set on the loaded model (what
``--prefill-chunk`` records at build time). Prints prefill seconds per size and the ratio to 512 (the default)
from the same round; results: benchmarks/out/prefill_chunk.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_speed  # noqa: E402

BUNDLES = (kv_speed.PLAIN_INT4, kv_speed.COMPRESSED)


def prefill_seconds(model, ids: list[int], size: int) -> float:
    model.prefill_chunk = size
    start = time.perf_counter()
    tokens = model.generate_ids(list(ids), max_new_tokens=1)
    next(tokens)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=8000)
    args = parser.parse_args()
    from edgec.runtime import Model

    kv_speed.prepare()
    sizes = [int(size) for size in args.sizes.split(",")]
    ids = kv_speed.prompt_ids(args.prompt)
    models = {name: Model.load(kv_speed.OUT / kv_speed.BUNDLES[name][0], threads=args.threads) for name in BUNDLES}
    for model in models.values():  # warm-up
        prefill_seconds(model, ids[:256], 128)
    seconds: dict[str, dict[int, list[float]]] = {name: {size: [] for size in sizes} for name in BUNDLES}
    for round_index in range(args.rounds):
        for size in sizes:
            for name, model in models.items():
                seconds[name][size].append(prefill_seconds(model, ids, size))
                print(f"round {round_index}: {name}, chunk {size}: {seconds[name][size][-1]:.1f} s", flush=True)
    base = 512 if 512 in sizes else sizes[0]
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(
        f"| bundle, prompt {args.prompt}, {args.threads} thread(s) | " + " | ".join(f"chunk {s}" for s in sizes) + " |"
    )
    print("|---|" + "---|" * len(sizes))
    for name in BUNDLES:
        cells = []
        for size in sizes:
            ratio = np.median([a / b for a, b in zip(seconds[name][size], seconds[name][base], strict=True)])
            cells.append(f"{np.median(seconds[name][size]):.1f} s ({ratio:.2f}×)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    results = {"command": "python " + " ".join(sys.argv), "load_average": os.getloadavg(), "seconds": seconds}
    (kv_speed.OUT / "prefill_chunk.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
