"""Passkey retrieval at long context with Gemma-3-270m: edgec's runtime vs PyTorch, plus the time and peak RSS of
the longest prefill.

    nice -n 10 python benchmarks/passkey.py                          # 10 trials, 2K-32K tokens, edgec only
    nice -n 10 python benchmarks/passkey.py --torch-max-tokens 8192  # also PyTorch on the trials up to 8K
    nice -n 10 python benchmarks/passkey.py --lengths 2000 --depths 0.5 --trials 1   # a quick look
    python benchmarks/passkey.py --context 32768 --kv-capacity 4096  # unknown options go to `edgec build`

A 5-digit key is hidden at a relative depth of Jane Austen filler (../shared/data/austen); the prompt ends with
"What is the pass key? The pass key is" and a trial succeeds when the greedy continuation (8 tokens) contains the
key. Prompts are built in token space from the bundle's tokenizer, so every engine sees the same ids. Each engine
runs in its own process so its peak RSS (VmHWM) is its own. Results: benchmarks/out/passkey-<bundle>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from edgec.errors import EdgecError
from edgec.evaluate import INTRO, NEEDLE, PASSKEY_NEW_TOKENS, QUESTION, passkey_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402

NEW_TOKENS = PASSKEY_NEW_TOKENS
FILLER_BOOKS = ("prideprejudice.txt", "emma.txt", "mansfieldpark.txt")  # > 32K tokens together


def make_trials(lengths: list[int], depths: list[float], count: int, seed: int) -> list[dict]:
    """``count`` trials cycling over (length, depth) pairs, longest first so the costly ones are never cut."""
    pairs = [(length, depth) for length in sorted(lengths, reverse=True) for depth in depths]
    rng = np.random.default_rng(seed)
    chosen = [pairs[i % len(pairs)] for i in range(count)]
    return [{"length": length, "depth": depth, "key": int(rng.integers(10_000, 99_999))} for length, depth in chosen]


def prompt_ids(tokenizer, bos: int | None, trial: dict, filler: list[int]) -> list[int]:
    """[BOS] intro filler[:a] needle filler[a:b] question, ``trial['length']`` tokens in all (the prompt `edgec eval`
    builds: ``edgec.evaluate.passkey_ids``)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    head = ([bos] if bos is not None else []) + encode(INTRO)
    needle, question = encode(NEEDLE.format(key=trial["key"])), encode(QUESTION)
    try:
        return passkey_ids(head, filler, needle, question, trial["length"], trial["depth"])
    except EdgecError as error:
        sys.exit(str(error))


def worker(engine: str, bundle: Path, trials: list[dict]) -> None:
    """Run the trials on one engine in this process; print one JSON line per trial, then the peak RSS."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    bos = json.loads((bundle / "manifest.json").read_text())["generation"]["bos_token_id"]
    filler = tokenizer.encode("\n".join(models.austen_text(b) for b in FILLER_BOOKS), add_special_tokens=False).ids
    generate = _edgec_generator(bundle) if engine == "edgec" else _torch_generator()
    for trial in trials:
        ids = prompt_ids(tokenizer, bos, trial, filler)
        start = time.perf_counter()
        new_ids, prefill_s = generate(ids)
        answer = tokenizer.decode(new_ids)
        record = trial | {
            "engine": engine,
            "tokens": len(ids),
            "answer": answer,
            "success": str(trial["key"]) in answer,
            "prefill_s": round(prefill_s, 2),
            "total_s": round(time.perf_counter() - start, 2),
        }
        print(json.dumps(record), flush=True)
    print(json.dumps({"engine": engine, "peak_rss_gb": round(measure.peak_rss_gb(), 2)}), flush=True)


def _edgec_generator(bundle: Path):
    from edgec.runtime import Model

    model = Model.load(bundle)

    def generate(ids: list[int]) -> tuple[list[int], float]:
        start = time.perf_counter()
        stream = model.generate_ids(ids, max_new_tokens=NEW_TOKENS)
        new_ids = [next(stream)]  # the first token comes right after the prefill
        prefill_s = time.perf_counter() - start
        return new_ids + list(stream), prefill_s

    return generate


def _torch_generator():
    import torch
    import transformers

    gguf = models.gemma3_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    def generate(ids: list[int]) -> tuple[list[int], float]:
        first_call: list[float] = []

        def note_prefill_done(input_ids, scores):  # a logits processor: first called right after the prefill
            first_call.append(first_call[0] if first_call else time.perf_counter())
            return scores

        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([note_prefill_done]),
            )
        return out[0, len(ids) :].tolist(), first_call[0] - start

    return generate


def build_bundle(context: int, build_options: list[str]) -> Path:
    """The cpu bundle for these options, built once (extra options pass straight to `edgec build`)."""
    tag = hashlib.sha256(" ".join(build_options).encode()).hexdigest()[:8] if build_options else "plain"
    bundle = models.OUT / f"gemma3-270m-cpu-{context}-{tag}.edgec"
    if not (bundle / "manifest.json").exists():
        command = [sys.executable, "-m", "edgec.cli", "build", str(models.gemma3_gguf()), "--target", "cpu"]
        command += ["-o", str(bundle), "--context", str(context), "--overwrite", *build_options]
        print("building:", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=True)
    return bundle


def run_worker(engine: str, bundle: Path, trials: list[dict]) -> tuple[list[dict], float]:
    command = [sys.executable, __file__, "--worker", engine, "--bundle", str(bundle)]
    command += ["--trial-json", json.dumps(trials)]
    records, peak = [], float("nan")
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            record = json.loads(line)
            if "peak_rss_gb" in record:
                peak = record["peak_rss_gb"]
                continue
            records.append(record)
            mark = "ok " if record["success"] else "MISS"
            print(
                f"{engine:6} {mark} {record['tokens']:>6} tokens depth {record['depth']:.2f} key {record['key']} "
                f"→ {record['answer']!r}  prefill {record['prefill_s']:.1f} s",
                flush=True,
            )
    if process.returncode:
        sys.exit(f"{engine} worker failed (exit {process.returncode})")
    return records, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32000, 16000, 8000, 2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=32768, help="bundle context (edgec build --context)")
    parser.add_argument("--torch-max-tokens", type=int, default=0, help="also run PyTorch on trials up to this length")
    parser.add_argument("--worker", choices=["edgec", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trial-json", help=argparse.SUPPRESS)
    args, build_options = parser.parse_known_args()
    if args.worker:
        return worker(args.worker, args.bundle, json.loads(args.trial_json))

    bundle = build_bundle(args.context, build_options)
    trials = make_trials(args.lengths, args.depths, args.trials, args.seed)
    # the longest trial first in the edgec worker's run, so the peak RSS it reports is that prefill's
    results = {"edgec": run_worker("edgec", bundle, trials)}
    torch_trials = [trial for trial in trials if trial["length"] <= args.torch_max_tokens]
    if torch_trials:
        results["torch"] = run_worker("torch", bundle, torch_trials)
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/passkey.py", *sys.argv[1:]]),
        "bundle": bundle.name,
        "build_options": build_options,
        "engines": {
            engine: {
                "successes": sum(r["success"] for r in records),
                "trials": len(records),
                "peak_rss_gb": peak,
                "records": records,
            }
            for engine, (records, peak) in results.items()
        },
    }
    out = models.OUT / f"passkey-{bundle.stem}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    for engine, summary in report["engines"].items():
        print(f"{engine}: {summary['successes']}/{summary['trials']} passkeys, peak RSS {summary['peak_rss_gb']} GB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
