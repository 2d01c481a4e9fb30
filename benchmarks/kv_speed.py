"""Decode speed and memory with an 8K-token prompt: the compressed cache (1024 int8 slots) vs the full fp32
cache vs onnxruntime-genai fp32 and int4, SmolLM2-135M, in ONE process with the runtimes alternating.

    python benchmarks/kv_speed.py                   # 3 rounds, prompt 8000 tokens, 64 new tokens, 2 threads

Each round: prefill the 8000-token prompt, then 64 greedy decode steps; medians over rounds, ratios vs genai
fp32. Peak RSS per runtime in its own fresh process. The compressed bundles use the default
``--prefill-compress end`` (the prompt is read whole, then 1024 slots per head are kept) and snapkv.
onnxruntime-genai pre-allocates its cache for max_length (prompt + 72 here) and attends over all of it.
Results: benchmarks/out/kv_speed.json / kv_speed.png; the printed table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402

OUT = models.OUT
CONTEXT = 8192
BUNDLES = {  # runner name → (bundle folder, extra edgec build options)
    "edgec fp32, full fp32 cache": ("kv/smollm2-plain.edgec", []),
    "edgec int4, 1024 int8 slots": (
        "kv/smollm2-speed-int4-int8.edgec",
        ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "int8"],
    ),
}
GENAI = {"onnxruntime-genai fp32": "genai-fp32", "onnxruntime-genai int4": "genai-int4"}


def prepare(threads: int) -> None:
    for folder, options in BUNDLES.values():
        path = OUT / folder
        if not (path / "manifest.json").exists():
            command = [sys.executable, "-m", "edgec.cli", "build", str(models.smollm2_gguf()), "-o", str(path)]
            subprocess.run([*command, "--context", str(CONTEXT), *options], check=True, stdout=subprocess.DEVNULL)
    for folder in GENAI.values():
        config_path = OUT / folder / "genai_config.json"
        if not config_path.exists():
            sys.exit(f"{config_path} is missing: run benchmarks/decode.py (and --precision int4) once first")
        config = json.loads(config_path.read_text())
        config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        config["model"]["context_length"] = max(config["model"]["context_length"], CONTEXT)
        config_path.write_text(json.dumps(config, indent=4))


class EdgecRunner:
    def __init__(self, name: str, threads: int) -> None:
        from edgec.runtime import Model

        self.name = name
        self.model = Model.load(OUT / BUNDLES[name][0], threads=threads)

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_edgec(self.model, ids, new_tokens)


class GenaiRunner:
    def __init__(self, name: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.name, self.og = name, og
        self.model = og.Model(str(OUT / GENAI[name]))

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_genai(self.og, self.model, ids, new_tokens)


def runner(name: str, threads: int):
    return EdgecRunner(name, threads) if name in BUNDLES else GenaiRunner(name, threads)


def prompt_ids(length: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(OUT / BUNDLES["edgec fp32, full fp32 cache"][0] / "tokenizer.json"))
    return tokenizer.encode(models.austen_text()[5000:]).ids[:length]


def kv_bytes(name: str, prompt: int, new_tokens: int) -> int:
    """Bytes of k + v (scales included) the runtime holds after the prompt and the new tokens."""
    tokens = prompt + new_tokens
    if name in BUNDLES:
        cache = json.loads((OUT / BUNDLES[name][0] / "manifest.json").read_text())["cache"]
        slots = cache["compression"]["capacity"] if cache.get("compression") else tokens
        return int(cache.get("kv_bytes_per_token", 46_080) * min(slots, tokens))
    return 46_080 * (prompt + new_tokens + 8)  # genai keeps an fp32 cache on CPU at both precisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # memory phase: one runtime, fresh process, print peak RSS in GB
        measured = runner(args.worker, args.threads)
        measured.run(prompt_ids(args.prompt), args.new_tokens)
        print(measure.peak_rss_gb())
        return
    prepare(args.threads)
    ids = prompt_ids(args.prompt)
    names = [*BUNDLES, *GENAI]
    runners = [runner(name, args.threads) for name in names]
    for measured in runners:  # warm-up
        measured.run(ids[:256], 4)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for measured in runners:
            samples[measured.name].append(measured.run(ids, args.new_tokens))
            print(f"round {round_index}: {measured.name} {samples[measured.name][-1]}", flush=True)
    del runners
    rss = {}
    for name in names:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", name, "--threads", str(args.threads), "--prompt", str(args.prompt)],
            capture_output=True,
            text=True,
            check=True,
        )
        rss[name] = float(done.stdout.strip().splitlines()[-1])
    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
        "threads": args.threads,
        "prompt": args.prompt,
        "rows": {
            name: {
                "prefill_s": float(np.median([p for p, _ in runs])),
                "decode_tok_s": float(np.median([d for _, d in runs])),
                "decode_tok_s_all": [round(d, 1) for _, d in runs],
                "peak_rss_gb": round(rss[name], 2),
                "kv_bytes": kv_bytes(name, args.prompt, args.new_tokens),
            }
            for name, runs in samples.items()
        },
    }
    (OUT / "kv_speed.json").write_text(json.dumps(results, indent=2))
    reference = results["rows"]["onnxruntime-genai fp32"]["decode_tok_s"]
    fp16 = 23_040 * (args.prompt + args.new_tokens)
    print(f"| runtime, prompt {args.prompt} | decode tok/s | vs genai fp32 | prefill | peak RSS | KV bytes (vs fp16) |")
    print("|---|---|---|---|---|---|")
    for name, row in results["rows"].items():
        print(
            f"| {name} | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / reference:.2f}× | "
            f"{row['prefill_s']:.1f} s | {row['peak_rss_gb']:.2f} GB | {row['kv_bytes'] / 2**20:.1f} MiB "
            f"({fp16 / row['kv_bytes']:.1f}× smaller) |"
        )
    plot(results, OUT / "kv_speed.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = list(rows)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].barh(names, [rows[n]["decode_tok_s"] for n in names], color=[f"C{i}" for i in range(len(names))])
    axes[0].set_xlabel(f"decode tokens/s after a {results['prompt']}-token prompt (higher is better)")
    axes[1].barh(names, [rows[n]["kv_bytes"] / 2**20 for n in names], color=[f"C{i}" for i in range(len(names))])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("KV cache MiB (log, lower is better)")
    axes[1].set_yticks([])
    figure.suptitle(f"SmolLM2-135M, {results['threads']} threads, {results['machine']}, {results['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
