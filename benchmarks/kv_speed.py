"""Decode speed, time to first token and memory with an 8K-token prompt: int4 weights with the compressed cache
(1024 int8 slots, and 1024 fp32 slots, which one-token steps read through ONNX Runtime's GroupQueryAttention) vs
int4 and fp32 with the full cache vs onnxruntime-genai fp32 and int4, SmolLM2-135M, in one run with the
runtimes (and thread counts) alternating, each runtime in a process of its own.

    python benchmarks/kv_speed.py          # 3 rounds, prompt 8000 tokens, 64 new tokens, 1 and 2 threads

Each round, for each thread count and runtime: prefill the 8000-token prompt, then 64 greedy decode steps.
Ratios are medians of per-round ratios (each pair ran in the same round): decode against onnxruntime-genai int4
and fp32, prefill of the compressed bundle against edgec int4's plain prefill and genai fp32's. Every runtime
runs with its defaults (edgec: spinning at each thread count as the bundle's calibration on this machine measured
it — what `edgec run` does on its first start — no EDGEC_ORT_SPIN). Each runtime runs in a worker process of
its own, loaded once for the whole run, as a user runs one model in a process — two bundles loaded in one process
can time by the order they were loaded in (a decode step 0.91× one way, 0.98–1.03× the other; docs/BENCHMARKS.md,
twenty-seventh round), though the paired ratios of the twenty-eighth round came out the same either way.
``--one-process`` loads them all in this process instead, as runs before that round did. Peak RSS per runtime in
its own fresh process. The compressed bundle uses the default ``--prefill-compress end`` (the prompt is read whole,
then 1024 slots per head are kept) and snapkv. onnxruntime-genai pre-allocates its cache for max_length
(prompt + 72 here) and attends over all of it.
Results: benchmarks/out/kv_speed.json / kv_speed.png (kv_speed-subset.* with --runtimes); the printed table goes
into docs/BENCHMARKS.md, then issue 21's targets over this run's rounds with an interval and a verdict
(``pool_rounds.py``; pass it several runs' files to pool their rounds). Quick checks: ``--runtimes "edgec int4, 1024
int8 slots;onnxruntime-genai int4" --rss none --prompt 2000``. ``--runtimes`` may also name "edgec int4 one row of
int8 activations, 1024 int8 slots": the same cache with ``--no-split-activations`` (onnxruntime-genai int4's own
arithmetic, not the exact default), and "edgec int4, 1024 int8 slots, chunk prefill": the same cache compressed
between prompt chunks (``--prefill-compress chunk``: each chunk attends to the kept slots, not to the whole prompt
before it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402
import pool_rounds  # noqa: E402

OUT = models.OUT
CONTEXT = 8192
COMPRESSED, PLAIN_INT4 = "edgec int4, 1024 int8 slots", "edgec int4, full fp32 cache"
ONE_ROW = "edgec int4 one row of int8 activations, 1024 int8 slots"
CHUNK = "edgec int4, 1024 int8 slots, chunk prefill"
FP32_SLOTS = "edgec int4, 1024 fp32 slots"  # one-token steps through GroupQueryAttention in place (decode_kernel gqa)
BUNDLES = {  # runner name → (bundle folder, extra edgec build options)
    "edgec fp32, full fp32 cache": ("kv/smollm2-plain.edgec", []),
    PLAIN_INT4: ("kv/smollm2-plain-int4.edgec", ["--weights", "int4"]),
    COMPRESSED: (
        "kv/smollm2-speed-int4-int8.edgec",
        ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "int8"],
    ),
    # the slots unquantized: the build reads them with ONNX Runtime's GroupQueryAttention in one-token steps
    FP32_SLOTS: (
        "kv/smollm2-speed-int4-fp32slots-gqa.edgec",
        ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "fp32"],
    ),
    # genai int4's own arithmetic (one row of int8 activations), not the exact default: only with --runtimes
    ONE_ROW: (
        "kv/smollm2-speed-int4-int8-onerow.edgec",
        ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "int8", "--no-split-activations"],
    ),
    # compressed between prompt chunks (--prefill-compress chunk): each chunk attends to the slots, not the whole
    # prompt before it — less attention work, a different meaning than the default `end`; only with --runtimes
    CHUNK: (
        "kv/smollm2-speed-int4-int8-chunk.edgec",
        ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "int8", "--prefill-compress", "chunk"],
    ),
}
OPTIONAL = (ONE_ROW, CHUNK)  # run only when --runtimes names them
GENAI_FP32, GENAI_INT4 = "onnxruntime-genai fp32", "onnxruntime-genai int4"
GENAI = {GENAI_FP32: "genai-fp32", GENAI_INT4: "genai-int4"}


def build_bundles(names: list[str]) -> None:
    """Build (once) the edgec bundles of ``names`` from the SmolLM2 GGUF."""
    for name in names:
        folder, options = BUNDLES[name]
        path = OUT / folder
        if not (path / "manifest.json").exists():
            command = [sys.executable, "-m", "edgec.cli", "build", str(models.smollm2_gguf()), "-o", str(path)]
            subprocess.run([*command, "--context", str(CONTEXT), *options], check=True, stdout=subprocess.DEVNULL)


def prepare(names: list[str] | None = None) -> None:
    """Build the bundles of ``names`` (default: all but the one-row variant) and the fp32 one (its tokenizer)."""
    wanted = names or [name for name in BUNDLES if name not in OPTIONAL]
    build_bundles([name for name in BUNDLES if name in wanted or name == "edgec fp32, full fp32 cache"])
    for folder in GENAI.values():
        config_path = OUT / folder / "genai_config.json"
        if not config_path.exists():
            sys.exit(f"{config_path} is missing: run benchmarks/decode.py (and --precision int4) once first")
        config = json.loads(config_path.read_text())
        config["model"]["context_length"] = max(config["model"]["context_length"], CONTEXT)
        config_path.write_text(json.dumps(config, indent=4))


def set_genai_threads(folder: Path, threads: int) -> None:
    """onnxruntime-genai reads its thread count from the config when a model is created."""
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))


class EdgecRunner:
    def __init__(self, name: str, threads: int) -> None:
        from edgec.runtime import Model

        self.name = name
        # as `edgec run` loads: spinning at this thread count by this machine's stored calibration (measured once)
        self.model = Model.load(OUT / BUNDLES[name][0], threads=threads, calibrate=True)

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_edgec(self.model, ids, new_tokens)


class GenaiRunner:
    def __init__(self, name: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.name, self.og = name, og
        set_genai_threads(OUT / GENAI[name], threads)
        self.model = og.Model(str(OUT / GENAI[name]))

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_genai(self.og, self.model, ids, new_tokens)


def runner(name: str, threads: int):
    return EdgecRunner(name, threads) if name in BUNDLES else GenaiRunner(name, threads)


class WorkerRunner:
    """A runner in a process of its own (``command``: one that ends in ``serve``), driven one line at a time: the
    process answers "ready" once loaded, then each (ids, new_tokens) line with that run's (prefill s, decode tok/s)."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._answer() != "ready":  # loading (and a first calibration) alone: workers start one at a time
            raise RuntimeError(f"{name}: the worker did not start")

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([list(ids), new_tokens]) + "\n")
        self.process.stdin.flush()
        prefill, decode = self._answer()
        return float(prefill), float(decode)

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait()

    def _answer(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited with status {self.process.wait()}")
        return json.loads(line)


def own_process_runner(name: str, threads: int) -> WorkerRunner:
    return WorkerRunner(name, [sys.executable, __file__, "--serve", name, "--threads", str(threads)])


def serve(measured, lines, answers) -> None:
    """The worker's side of ``WorkerRunner``: "ready", then one answer per request line until ``lines`` ends."""
    print(json.dumps("ready"), file=answers, flush=True)
    for line in lines:
        ids, new_tokens = json.loads(line)
        print(json.dumps(list(measured.run(ids, new_tokens))), file=answers, flush=True)


def answers_channel():
    """This process's stdout kept for the answers alone: whatever else writes to file descriptor 1 (a library's
    message) goes to stderr instead of into the protocol."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return channel


def prompt_ids(length: int, bundle: Path | None = None) -> list[int]:
    """The benchmark prompt: Pride and Prejudice from character 5000, ``length`` tokens by ``bundle``'s tokenizer
    (default: the fp32 bundle's; every SmolLM2 bundle has the same)."""
    from tokenizers import Tokenizer

    bundle = bundle or OUT / BUNDLES["edgec fp32, full fp32 cache"][0]
    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
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
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (all in one run)")
    parser.add_argument("--rss", help="runtimes whose peak RSS to measure, separated by ; (default: all; none: no RSS)")
    parser.add_argument(
        "--runtimes", help="the runtimes to run, separated by ; (default: all; ratios to an absent one: -)"
    )
    parser.add_argument(
        "--one-process", action="store_true", help="every runtime in this process (as before the 28th round)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    if args.serve:  # a timing worker: one runtime, loaded once, runs what the parent sends
        channel = answers_channel()
        serve(runner(args.serve, thread_counts[0]), sys.stdin, channel)
        return
    if args.worker:  # memory phase: one runtime, fresh process, print peak RSS in GB
        measured = runner(args.worker, thread_counts[0])
        measured.run(prompt_ids(args.prompt), args.new_tokens)
        print(measure.peak_rss_gb())
        return
    names = [name for name in [*BUNDLES, *GENAI] if name not in OPTIONAL or args.runtimes]  # default: exact, end
    if args.runtimes:
        unknown = set(args.runtimes.split(";")) - set(names)
        if unknown:
            sys.exit(f"unknown runtime(s) {sorted(unknown)}; choose from {names}")
        names = [name for name in names if name in args.runtimes.split(";")]
    prepare(names)
    ids = prompt_ids(args.prompt)
    start = runner if args.one_process else own_process_runner
    runners = {(threads, name): start(name, threads) for threads in thread_counts for name in names}
    for measured in runners.values():  # warm-up
        measured.run(ids[:256], 4)
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {key: [] for key in runners}
    for round_index in range(args.rounds):
        for (threads, name), measured in runners.items():
            samples[threads, name].append(measured.run(ids, args.new_tokens))
            print(f"round {round_index}, {threads} thread(s): {name} {samples[threads, name][-1]}", flush=True)
    for measured in runners.values():
        if isinstance(measured, WorkerRunner):
            measured.close()
    del runners
    rss = {}
    for name in [] if args.rss == "none" else args.rss.split(";") if args.rss else names:
        command = [sys.executable, __file__, "--worker", name, "--threads", str(thread_counts[-1])]
        done = subprocess.run([*command, "--prompt", str(args.prompt)], capture_output=True, text=True, check=True)
        rss[name] = float(done.stdout.strip().splitlines()[-1])

    def paired(threads: int, name: str, against: str, index: int) -> float | None:
        """Median over rounds of this round's ratio (index 0: prefill seconds, 1: decode tok/s); None when
        ``against`` did not run."""
        if (threads, against) not in samples:
            return None
        pairs = zip(samples[threads, name], samples[threads, against], strict=True)
        return float(np.median([a[index] / b[index] for a, b in pairs]))

    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "processes": "one" if args.one_process else "one per runtime",
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "threads": thread_counts,
        "prompt": args.prompt,
        "rows": {
            pool_rounds.row_key(name, threads): {
                "name": name,
                "threads": threads,
                "prefill_s": float(np.median([p for p, _ in runs])),
                "prefill_s_all": [round(p, 2) for p, _ in runs],
                "decode_tok_s": float(np.median([d for _, d in runs])),
                "decode_tok_s_all": [round(d, 1) for _, d in runs],
                "decode_vs_genai_int4": paired(threads, name, GENAI_INT4, 1),
                "decode_vs_genai_fp32": paired(threads, name, GENAI_FP32, 1),
                "prefill_vs_edgec_int4_plain": paired(threads, name, PLAIN_INT4, 0),
                "prefill_vs_genai_fp32": paired(threads, name, GENAI_FP32, 0),
                "peak_rss_gb": round(rss[name], 2) if name in rss else None,
                "kv_bytes": kv_bytes(name, args.prompt, args.new_tokens),
            }
            for (threads, name), runs in samples.items()
        },
    }
    stem = "kv_speed-subset" if args.runtimes else "kv_speed"  # a subset does not replace the full run's results
    (OUT / f"{stem}.json").write_text(json.dumps(results, indent=2))
    fp16 = 23_040 * (args.prompt + args.new_tokens)
    print(
        f"| runtime, prompt {args.prompt} | threads | decode tok/s | vs genai int4 | vs genai fp32 | prefill | "
        "prefill vs edgec int4 plain | prefill vs genai fp32 | peak RSS | KV bytes (vs fp16) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results["rows"].values():
        print(
            f"| {row['name']} | {row['threads']} | {row['decode_tok_s']:.1f} | {_x(row['decode_vs_genai_int4'])} | "
            f"{_x(row['decode_vs_genai_fp32'])} | {row['prefill_s']:.1f} s | "
            f"{_x(row['prefill_vs_edgec_int4_plain'])} | "
            f"{_x(row['prefill_vs_genai_fp32'])} | {_gb(row['peak_rss_gb'])} | {row['kv_bytes'] / 2**20:.1f} MiB "
            f"({fp16 / row['kv_bytes']:.1f}× smaller) |"
        )
    plot(results, OUT / f"{stem}.png")
    # one run's medians hide how far its rounds spread: the targets over its rounds, with their interval
    # (benchmarks/pool_rounds.py pools several runs' files the same way)
    pooled = pool_rounds.pool_runs([results])
    if pooled:
        print(f"\nissue 21's targets over this run's {args.rounds} round(s) (~95 % interval of the geometric mean):")
        print(pool_rounds.table(pooled))


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}×"


def _gb(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} GB"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = results["rows"]
    labels = list(rows)
    colors = [f"C{list(dict.fromkeys(r['name'] for r in rows.values())).index(rows[n]['name'])}" for n in labels]
    figure, axes = plt.subplots(1, 3, figsize=(16, 5))
    axes[0].barh(labels, [rows[n]["decode_tok_s"] for n in labels], color=colors)
    axes[0].set_xlabel(f"decode tokens/s after a {results['prompt']}-token prompt (higher is better)")
    axes[1].barh(labels, [rows[n]["prefill_s"] for n in labels], color=colors)
    axes[1].set_xlabel("time to first token, s (lower is better)")
    axes[1].set_yticks([])
    axes[2].barh(labels, [rows[n]["kv_bytes"] / 2**20 for n in labels], color=colors)
    axes[2].set_xscale("log")
    axes[2].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # 2×10¹, 3×10¹… overlapped
    axes[2].set_xlabel("KV cache MiB (log, lower is better)")
    axes[2].set_yticks([])
    figure.suptitle(f"SmolLM2-135M, {results['machine']}, {results['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
