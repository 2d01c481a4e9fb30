"""Which ``--prefill-compress`` mode keeps the answer: a passkey hidden in a long SmolLM2 prompt, read through
a compressed cache that must drop most of the prompt, then asked for at the end.

    python benchmarks/kv_passkey.py            # 3 depths × 2 keys, prompt ~3500 tokens, 512 and 1024 slots

SmolLM2 retrieves passkeys only about half the time even uncompressed (ENVIRONMENT.md), so compression is judged
by the key's log-probability (teacher-forced, through ``Model.continuation_logprobs``) relative to the
uncompressed cache, and by whether every key token is still the top-1 choice. ``end`` reads the whole prompt
before choosing (the question is in the observation window: query-aware); ``chunk`` chooses between chunks, so
the key is judged before the question exists. Same bundle, mode and capacity chosen at load.
Results: benchmarks/out/kv_passkey.json; the printed table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quality  # noqa: E402
import models  # noqa: E402

KEYS = ("71432", "58219")
DEPTHS = (0.1, 0.5, 0.9)


def prompts(tokenizer, length: int) -> list[tuple[str, float, list[int], list[int]]]:
    filler = tokenizer.encode(models.austen_text()[20000:]).ids[:length]
    cases = []
    for key in KEYS:
        needle = tokenizer.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n").ids
        question = tokenizer.encode("\nWhat is the pass key? The pass key is").ids
        answer = tokenizer.encode(f" {key}").ids
        for depth in DEPTHS:
            cut = int(depth * len(filler))
            cases.append((key, depth, filler[:cut] + needle + filler[cut:] + question, answer))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=3500)
    parser.add_argument("--capacities", default="512,1024")
    parser.add_argument("--policies", default="snapkv,streaming")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--split-window", action="store_true", help="recent window = capacity/2 (H2O's split), end mode only"
    )
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from edgec.runtime import Model

    plain_path = kv_quality.bundle(None, None)
    tokenizer = Tokenizer.from_file(str(plain_path / "tokenizer.json"))
    cases = prompts(tokenizer, args.length)
    configs = [("uncompressed", None, None, None)]
    for policy in args.policies.split(","):
        for capacity in (int(c) for c in args.capacities.split(",")):
            modes = ("end",) if args.split_window else ("end", "chunk")
            configs += [(policy, "int8", capacity, mode) for mode in modes]
    rows = []
    for policy, dtype, capacity, mode in configs:
        if policy == "uncompressed":
            model = Model.load(plain_path, threads=args.threads)
        else:
            path = kv_quality.bundle(policy, dtype, capacity // 2 if args.split_window else None)
            model = Model.load(path, threads=args.threads, kv_capacity=capacity, prefill_compress=mode)
        logprobs, found = [], []
        for _, _, context, answer in cases:
            scores, top1 = model.continuation_logprobs(context, answer, with_top1=True)
            logprobs.append(float(scores.sum()))
            found.append(bool((top1 == np.asarray(answer)).all()))
        row = {"policy": policy, "dtype": dtype, "capacity": capacity, "mode": mode, "key_logprob": logprobs}
        row["window"] = capacity // 2 if args.split_window and capacity else 64
        row |= {"retrieved": sum(found), "cases": len(cases)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = np.asarray(rows[0]["key_logprob"])
    print("| cache | slots | prefill-compress | key retrieved (top-1) | mean key log-prob | Δ vs uncompressed |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        values = np.asarray(row["key_logprob"])
        print(
            f"| {row['policy']} {row['dtype'] or ''} | {row['capacity'] or 'all'} | {row['mode'] or '-'} | "
            f"{row['retrieved']}/{row['cases']} | {values.mean():.2f} | {(values - base).mean():+.2f} |"
        )
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {args.threads} threads",
        "command": "python " + " ".join(sys.argv),
        "prompt_tokens": len(cases[0][2]),
        "rows": rows,
    }
    (models.OUT / f"kv_passkey{'_split' if args.split_window else ''}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
