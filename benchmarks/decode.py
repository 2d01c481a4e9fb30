"""Decode speed, prefill time and peak memory: edgec vs onnxruntime-genai vs PyTorch eager, on SmolLM2-135M.

    python benchmarks/decode.py                      # fp32 (the foundation comparison)
    python benchmarks/decode.py --precision int4     # edgec --weights int4 vs onnxruntime-genai -p int4
    python benchmarks/decode.py --rounds 7 --threads 2

Speed is measured with the runtimes alternating round by round inside a process, in ``--processes`` fresh worker
processes one after another, each with the runtimes in a rotated order: a loaded instance's speed moves by a few
percent from one process to the next (memory placement; identical bundles loaded twice differ by up to 3 %), and
the order inside a round matters too. Reported: the median tok/s over every round of every process, and the median
of the per-round ratios to onnxruntime-genai (each pair ran back to back), with the spread of the per-process ones.
Peak RSS is measured per runtime in its own fresh process (load + 1024-token prefill + 64 decode steps).
Results: benchmarks/out/decode.json and decode.png; paste the printed table into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402

OUT = models.OUT
PRECISION = "int4" if "int4" in sys.argv else "fp32"  # chosen before the runners are defined (also for workers)
EDGEC_BUNDLE = OUT / f"smollm2-cpu-{PRECISION}.edgec"
# int4 variants of the edgec build, each its own runner: runner name → (bundle, extra `edgec build` flags)
EDGEC_VARIANTS = {
    # the default: the GGUF's Q4_1 blocks carried across exactly (MatMulNBits + a per-block offset product), int8
    # activations split in two rows
    "edgec": (EDGEC_BUNDLE, []),
    # the same blocks with one row of int8 activations (--no-split-activations): fastest, answers may change
    "edgec-one-row": (OUT / f"smollm2-cpu-{PRECISION}-one-row.edgec", ["--no-split-activations"]),
    # the exact form at fp32 activations (--accuracy-level 1): the GGUF's numbers computed as the fp32 bundle does
    "edgec-l1": (OUT / f"smollm2-cpu-{PRECISION}-l1.edgec", ["--accuracy-level", "1"]),
    # the exact form as an earlier edgec built it, for a before/after run: built by hand with that release
    # (`edgec build … --weights int4 -o benchmarks/out/smollm2-cpu-int4-before.edgec`), never here
    "edgec-before": (OUT / f"smollm2-cpu-{PRECISION}-before.edgec", None),
    # genai's own int4 layout (symmetric block 32, 4-bit shared table), rounded with AWQ: the like-for-like check
    "edgec-awq": (
        OUT / "smollm2-cpu-int4-awq.edgec",
        ["--quant-method", "awq", "--symmetric", "--embedding-bits", "4"],
    ),
    # the recommended fast build: AWQ, block 64 with integer zero points, 4-bit shared table (MatMulNBits)
    "edgec-awq64": (
        OUT / "smollm2-cpu-int4-awq64.edgec",
        ["--quant-method", "awq", "--block-size", "64", "--embedding-bits", "4"],
    ),
    # the same numbers in the portable form: DequantizeLinear(uint4, block 64, zero points) + MatMul (fp32 table)
    "edgec-qdq": (
        OUT / "smollm2-cpu-int4-qdq-awq64.edgec",
        ["--int4-form", "qdq", "--quant-method", "awq", "--block-size", "64"],
    ),
    "edgec-gptq": (
        OUT / "smollm2-cpu-int4-gptq.edgec",
        ["--quant-method", "gptq", "--block-size", "64", "--embedding-bits", "4"],
    ),
}
GENAI_MODEL = OUT / f"genai-{PRECISION}"
CONTEXT = 2048  # enough for the 1024-token prompt + 64 new tokens; genai sizes its cache to max_length likewise


def run_measured(command: list[str]) -> tuple[float, float]:
    """Run a command; return (seconds, its peak RSS in GB) — a wrapper process isolates the child accounting."""
    wrapper = (
        "import resource,subprocess,sys,time;t=time.time();r=subprocess.run(sys.argv[1:]);"
        "print(time.time()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);sys.exit(r.returncode)"
    )
    done = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    seconds, rss_kb = done.stdout.strip().splitlines()[-1].split()
    return float(seconds), int(rss_kb) / 2**20


def prepare(threads: int, names: list[str]) -> dict:
    builds = {}
    for name in names:
        bundle, flags = EDGEC_VARIANTS.get(name, (None, []))
        if bundle is None or (bundle / "manifest.json").exists():
            continue
        if flags is None:
            sys.exit(f"{name} needs {bundle}, built by hand (see EDGEC_VARIANTS)")
        command = [
            str(Path(sys.executable).parent / "edgec"),
            "build",
            str(models.smollm2_gguf()),
            "-o",
            str(bundle),
            "--context",
            str(CONTEXT),
        ]
        builds[name] = run_measured([*command, "--weights", PRECISION, *flags])
    if not (GENAI_MODEL / "genai_config.json").exists():
        hf = models.smollm2_hf_folder()
        builds["onnxruntime-genai"] = run_measured(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(hf),
                "-o",
                str(GENAI_MODEL),
                "-p",
                PRECISION,
                "-e",
                "cpu",
                "-c",
                str(OUT / f"genai-cache-{PRECISION}"),  # a shared cache reuses the other precision
                "--extra_options",
                "prune_lm_head=true",
            ]
        )
    config_path = GENAI_MODEL / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads  # genai's best here
    config_path.write_text(json.dumps(config, indent=4))
    return {name: {"seconds": round(s, 1), "peak_rss_gb": round(r, 2)} for name, (s, r) in builds.items()}


class EdgecRunner:
    name = f"edgec {PRECISION}"
    variant = "edgec"

    def __init__(self, threads: int) -> None:
        from edgec.runtime import Model

        self.model = Model.load(EDGEC_VARIANTS[self.variant][0], threads=threads)

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_edgec(self.model, ids, new_tokens)


class GenaiRunner:
    name = f"onnxruntime-genai {PRECISION}"

    def __init__(self, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(GENAI_MODEL))

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return measure.time_genai(self.og, self.model, ids, new_tokens)


class TorchRunner:
    name = "PyTorch eager fp32"

    def __init__(self, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(models.smollm2_hf_folder(), dtype=torch.float32)
        self.model.eval()

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        torch = self.torch
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model(torch.tensor([ids]), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            prefilled = time.perf_counter()
            cache = out.past_key_values
            for _ in range(new_tokens):
                out = self.model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return prefilled - start, new_tokens / (time.perf_counter() - prefilled)


class EdgecQdqRunner(EdgecRunner):
    name, variant = "edgec int4 DequantizeLinear+MatMul, awq block 64, zero points", "edgec-qdq"


class EdgecGptqRunner(EdgecRunner):
    name, variant = "edgec int4 gptq block 64, zero points, 4-bit table", "edgec-gptq"


class EdgecAwqRunner(EdgecRunner):
    name, variant = "edgec int4 awq, symmetric block 32, 4-bit table (genai's layout)", "edgec-awq"


class EdgecAwq64Runner(EdgecRunner):
    name, variant = "edgec int4 awq block 64, zero points, 4-bit table", "edgec-awq64"


class EdgecLevel1Runner(EdgecRunner):
    name, variant = "edgec int4 exact, fp32 activations (--accuracy-level 1)", "edgec-l1"


class EdgecOneRowRunner(EdgecRunner):
    name, variant = "edgec int4 exact, one row of int8 activations (--no-split-activations)", "edgec-one-row"


class EdgecBeforeRunner(EdgecRunner):
    name, variant = "edgec int4 exact, before (the earlier release's build)", "edgec-before"


RUNNERS = {
    "edgec-l1": EdgecLevel1Runner,
    "edgec-one-row": EdgecOneRowRunner,
    "edgec-before": EdgecBeforeRunner,
    "edgec": EdgecRunner,
    "edgec-qdq": EdgecQdqRunner,
    "edgec-gptq": EdgecGptqRunner,
    "edgec-awq": EdgecAwqRunner,
    "edgec-awq64": EdgecAwq64Runner,
    "genai": GenaiRunner,
    "torch": TorchRunner,
}


def prompt_ids(length: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(EDGEC_BUNDLE / "tokenizer.json"))
    text = models.austen_text()
    return tokenizer.encode(text[5000 : 5000 + 20 * length]).ids[:length]


def sample_speed(names: list[str], lengths: list[int], rounds: int, new_tokens: int, threads: int) -> dict:
    """One process: every runner loaded, then ``rounds`` rounds of each runner in turn per prompt length;
    {runner name: {length: [(prefill s, decode tok/s), ...]}}."""
    runners = [RUNNERS[name](threads) for name in names]
    prompts = {length: prompt_ids(length) for length in lengths}
    for runner in runners:  # warm-up: first-run allocations and lazy initialisation
        runner.run(prompts[lengths[0]], 4)
    samples = {runner.name: {str(length): [] for length in lengths} for runner in runners}
    for _ in range(rounds):
        for length in lengths:
            for runner in runners:
                samples[runner.name][str(length)].append(runner.run(prompts[length], new_tokens))
    return samples


def measure_speed(
    names: list[str], lengths: list[int], rounds: int, new_tokens: int, threads: int, processes: int
) -> dict:
    per_process = []
    for index in range(processes):
        order = names[index % len(names) :] + names[: index % len(names)]  # rotate: no runner always goes first
        command = [sys.executable, __file__, "--speed-worker", ",".join(order), "--threads", str(threads)]
        command += ["--lengths", ",".join(map(str, lengths)), "--rounds", str(rounds)]
        command += ["--new-tokens", str(new_tokens), "--precision", PRECISION]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"speed worker failed:\n{done.stderr[-3000:]}")
        per_process.append(json.loads(done.stdout.strip().splitlines()[-1]))
    reference = GenaiRunner.name
    results = {}
    for name in per_process[0]:
        results[name] = {}
        for length in per_process[0][name]:
            runs = [run for samples in per_process for run in samples[name][length]]
            entry = {
                "prefill_s": float(np.median([p for p, _ in runs])),
                "decode_tok_s": float(np.median([d for _, d in runs])),
                "decode_tok_s_all": [round(d, 1) for _, d in runs],
            }
            if reference in per_process[0]:
                # per round: this runner's rate over genai's in the same round (back to back)
                ratios = [
                    [mine[1] / theirs[1] for mine, theirs in zip(s[name][length], s[reference][length], strict=True)]
                    for s in per_process
                ]
                entry["ratio"] = float(np.median([r for rs in ratios for r in rs]))
                entry["ratio_per_process"] = [round(float(np.median(rs)), 3) for rs in ratios]
            results[name][length] = entry
    return results


def measure_memory(name: str, threads: int, new_tokens: int) -> float:
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--threads",
            str(threads),
            "--new-tokens",
            str(new_tokens),
            "--precision",
            PRECISION,
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"memory worker {name} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["speed"])
    lengths = list(next(iter(results["speed"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = np.arange(len(lengths)) + i * width
        runs = [results["speed"][name][n]["decode_tok_s_all"] for n in lengths]
        medians = [results["speed"][name][n]["decode_tok_s"] for n in lengths]
        pairs = list(zip(medians, runs, strict=True))
        # the stored runs are rounded to 0.1: clamp so a median equal to a rounded extreme is no negative bar
        spread = [[max(0, m - min(r)) for m, r in pairs], [max(0, max(r) - m) for m, r in pairs]]
        axes[0].bar(xs, medians, width, yerr=spread, capsize=3, label=name)
    axes[0].set_xticks(np.arange(len(lengths)) + width * (len(names) - 1) / 2, [f"prompt {n}" for n in lengths])
    axes[0].set_ylabel("decode tokens / s: median, min–max over rounds")
    axes[0].set_ylim(0, axes[0].get_ylim()[1] * 1.45)  # headroom for the legend above the bars
    axes[0].legend(fontsize=7, loc="upper left")
    # the bars' colours are the legend's; long runner names as tick labels would overlap
    axes[1].bar(
        range(len(names)), [results["peak_rss_gb"][name] for name in names], color=[f"C{i}" for i in range(len(names))]
    )
    axes[1].set_xticks([])
    axes[1].set_xlabel("runtimes in the legend's order and colours")
    axes[1].set_ylabel("peak RSS, GB (lower is better)")
    fig.suptitle(f"SmolLM2-135M {PRECISION}, {results['threads']} threads, {results['machine']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="128,1024")
    parser.add_argument("--runtimes", default="edgec,genai,torch")
    parser.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--speed-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.speed_worker:  # speed phase: runners in this order, rounds alternating; prints the samples as JSON
        lengths = [int(n) for n in args.lengths.split(",")]
        samples = sample_speed(args.speed_worker.split(","), lengths, args.rounds, args.new_tokens, args.threads)
        print(json.dumps(samples))
        return
    if args.worker:  # memory phase: one runtime, fresh process, print peak RSS in GB
        runner = RUNNERS[args.worker](args.threads)
        runner.run(prompt_ids(1024), args.new_tokens)
        print(measure.peak_rss_gb())
        return
    OUT.mkdir(parents=True, exist_ok=True)
    names = args.runtimes.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    builds = prepare(args.threads, names)
    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "processes": args.processes,
        "builds": builds,
        "speed": measure_speed(names, lengths, args.rounds, args.new_tokens, args.threads, args.processes),
    }
    results["peak_rss_gb"] = {
        RUNNERS[n].name: round(measure_memory(n, args.threads, args.new_tokens), 2) for n in names
    }
    (OUT / f"decode-{PRECISION}.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / f"decode-{PRECISION}.png")
    print(
        f"| runtime | {' | '.join(f'decode tok/s, prompt {n}' for n in lengths)} | prefill {lengths[-1]} | peak RSS |"
    )
    print("|---" * (len(lengths) + 3) + "|")
    for name, per_length in results["speed"].items():
        cells = []
        for n in lengths:
            entry = per_length[str(n)]
            spread = entry.get("ratio_per_process", [])
            ratio = f" ({entry['ratio']:.3f}×; {min(spread):.3f}–{max(spread):.3f})" if spread else ""
            cells.append(f"{entry['decode_tok_s']:.1f}{ratio}")
        prefill = per_length[str(lengths[-1])]["prefill_s"]
        print(f"| {name} | {' | '.join(cells)} | {prefill:.2f} s | {results['peak_rss_gb'][name]:.2f} GB |")
    print(f"builds: {builds or 'cached'}; wrote {OUT}/decode-{PRECISION}.json and .png")


if __name__ == "__main__":
    main()
