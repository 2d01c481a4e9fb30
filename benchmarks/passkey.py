"""Passkey retrieval at long context with Gemma-3-270m: edgec's runtime vs PyTorch, plus the time and peak RSS of
the longest prefill.

    nice -n 10 python benchmarks/passkey.py                          # 10 trials, 2K-32K tokens, edgec only
    nice -n 10 python benchmarks/passkey.py --torch-max-tokens 8192  # also PyTorch on the trials up to 8K
    nice -n 10 python benchmarks/passkey.py --lengths 2000 --depths 0.5 --trials 1   # a quick look
    python benchmarks/passkey.py --context 32768 --kv-capacity 4096  # unknown options go to `edgec build`
    # the hierarchical cache: the same bundle with recall off (plain eviction, all C slots) and on, in one run
    python benchmarks/passkey.py --lengths 8000 --context 8192 --kv-capacity 256 --kv-recall 4 --compare-recall
    # issue 21's Gemma row in one run: compressed builds against the uncompressed one and PyTorch, same prompts
    python benchmarks/passkey.py --lengths 32000 --trials 3 --torch-max-tokens 32000 \
        --compare-builds "--kv-capacity 2048 --kv-dtype int8" "--kv-capacity 2048 --kv-dtype fp32"

A 5-digit key is hidden at a relative depth of Jane Austen filler (benchmarks/data/austen); the prompt ends with
"What is the pass key? The pass key is" and a trial succeeds when the greedy continuation (8 tokens) contains the
key. Prompts are built in token space from the bundle's tokenizer, so every engine sees the same ids. Each engine
runs in its own process so its peak RSS (VmHWM) is its own. Results: benchmarks/out/passkey-<bundle>.json.
``--compare-recall`` (a bundle built with ``--kv-recall``) runs edgec twice, loaded with recall off
(``kv_recall=0``: plain eviction over the same C slots) and on, and also times ``--speed-steps`` decode steps
after the first trial's answer in each (tokens/s, and the share of it the runtime spends in host-tier copies and
recalls).
``--compare-builds OPTIONS ...`` runs each set of extra `edgec build` options as a bundle of its own beside the
uncompressed one (the options outside it) and prints time to first token and peak RSS against the uncompressed
bundle and against PyTorch: per engine the median prefill over its trials, and the ratios as geometric means of
per-trial ratios over the prompts both engines read (each ratio within one run, on one machine). Results:
benchmarks/out/passkey-compare-<context>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
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


def worker(engine: str, bundle: Path, trials: list[dict], load: dict | None = None, speed_steps: int = 0) -> None:
    """Run the trials on one engine in this process; print one JSON line per trial, then the peak RSS.
    ``load``: Model.load options (edgec); ``speed_steps``: also time that many decode steps after the first
    trial's prompt (edgec)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    bos = json.loads((bundle / "manifest.json").read_text())["generation"]["bos_token_id"]
    filler = tokenizer.encode("\n".join(models.austen_text(b) for b in FILLER_BOOKS), add_special_tokens=False).ids
    generate = _edgec_generator(bundle, load or {}) if engine == "edgec" else _torch_generator()
    timing = None
    for number, trial in enumerate(trials):
        ids = prompt_ids(tokenizer, bos, trial, filler)
        start = time.perf_counter()
        if number == 0 and speed_steps and engine == "edgec":  # the first trial also times decode steps after it
            new_ids, prefill_s, timing = generate.with_speed(ids, filler[:speed_steps])
        else:
            new_ids, prefill_s = generate(ids)
        answer = tokenizer.decode(new_ids)
        record = trial | {
            "engine": engine,
            "tokens": len(ids),
            "answer": answer,
            "success": str(trial["key"]) in answer,
            "prefill_s": round(prefill_s, 4),  # a tiny bundle's prompt can take under 5 ms
            "total_s": round(time.perf_counter() - start, 2),
        }
        print(json.dumps(record), flush=True)
    if timing:
        print(json.dumps({"speed": timing}), flush=True)
    print(json.dumps({"engine": engine, "peak_rss_gb": round(measure.peak_rss_gb(), 2)}), flush=True)


class _EdgecGenerator:
    def __init__(self, bundle: Path, load: dict) -> None:
        from edgec.runtime import Model

        self.model = Model.load(bundle, **load)

    def __call__(self, ids: list[int]) -> tuple[list[int], float]:
        start = time.perf_counter()
        stream = self.model.generate_ids(ids, max_new_tokens=NEW_TOKENS)
        new_ids = [next(stream)]  # the first token comes right after the prefill
        prefill_s = time.perf_counter() - start
        return new_ids + list(stream), prefill_s

    def with_speed(self, ids: list[int], continuation: list[int]) -> tuple[list[int], float, dict]:
        """A trial as ``__call__`` runs it (greedy, the same steps ``generate`` takes), then ``continuation`` fed
        one token at a time on the same state, timed: decode steps/s with the cache as long prompts leave it, and
        the part of each step the runtime spends in host-tier copies and recalls (0 with recall off)."""
        model = self.model
        with model._state() as state:
            start = time.perf_counter()
            logits = model._prefill(state, np.asarray(ids, np.int64), all_logits=False)[-1]
            prefill_s = time.perf_counter() - start
            new_ids, position = [int(np.argmax(logits))], len(ids)
            while len(new_ids) < NEW_TOKENS and new_ids[-1] not in model.eos_token_ids:
                logits = state.run(np.array([new_ids[-1]], np.int64), position, last_only=True)
                new_ids.append(int(np.argmax(logits)))
                position += 1
            recall_before = getattr(state, "recall_seconds", 0.0)
            began = time.perf_counter()
            for offset, token in enumerate(continuation):
                state.run(np.array([token], np.int64), position + offset, last_only=True)
            elapsed = time.perf_counter() - began
            recall_s = getattr(state, "recall_seconds", 0.0) - recall_before
        steps = len(continuation)
        timing = {
            "steps": steps,
            "tokens_per_s": round(steps / elapsed, 2),
            "ms_per_step": round(1000 * elapsed / steps, 2),
            "recall_ms_per_step": round(1000 * recall_s / steps, 3),
        }
        return new_ids, prefill_s, timing


def _edgec_generator(bundle: Path, load: dict) -> _EdgecGenerator:
    return _EdgecGenerator(bundle, load)


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


def run_worker(
    engine: str, bundle: Path, trials: list[dict], label: str | None = None, load: dict | None = None, speed: int = 0
) -> tuple[list[dict], float, dict | None]:
    """One engine's trials in a process of its own: (records, peak RSS, decode speed or None)."""
    label = label or engine
    command = [sys.executable, __file__, "--worker", engine, "--bundle", str(bundle)]
    command += ["--trial-json", json.dumps(trials), "--load-json", json.dumps(load or {}), "--speed-steps", str(speed)]
    records, peak, timing = [], float("nan"), None
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            record = json.loads(line)
            if "peak_rss_gb" in record:
                peak = record["peak_rss_gb"]
                continue
            if "speed" in record:
                timing = record["speed"]
                print(f"{label:12} decode {timing}", flush=True)
                continue
            records.append(record)
            mark = "ok " if record["success"] else "MISS"
            print(
                f"{label:12} {mark} {record['tokens']:>6} tokens depth {record['depth']:.2f} key {record['key']} "
                f"→ {record['answer']!r}  prefill {record['prefill_s']:.1f} s",
                flush=True,
            )
    if process.returncode:
        sys.exit(f"{label} worker failed (exit {process.returncode})")
    return records, peak, timing


UNCOMPRESSED = "edgec, uncompressed"
SHOWN = {"torch": "PyTorch fp32 (transformers)"}  # a worker's engine name as the table and plot show it


def compare_rows(results: dict[str, tuple[list[dict], float, dict | None]]) -> list[dict]:
    """One row per engine of ``results`` (label → records, peak RSS GB, decode timing): passkeys, the median
    prefill, and prefill and peak RSS as ratios to the uncompressed bundle's and to PyTorch's (``None`` where that
    engine did not run). A prefill ratio is the geometric mean of per-trial ratios over the trials (same length,
    depth and key) both engines ran."""

    def key(record: dict) -> tuple:
        return record["length"], record["depth"], record["key"]

    def prefill_ratio(records: list[dict], reference: list[dict]) -> float | None:
        theirs = {key(r): r["prefill_s"] for r in reference}
        # a time that rounded to 0 has no ratio (a tiny test bundle's): left out, not a log of 0
        ratios = [r["prefill_s"] / theirs[key(r)] for r in records if theirs.get(key(r)) and r["prefill_s"] > 0]
        return round(math.exp(statistics.fmean(math.log(x) for x in ratios)), 3) if ratios else None

    references = {"uncompressed": results.get(UNCOMPRESSED), "torch": results.get("torch")}
    rows = []
    for label, (records, peak, _) in results.items():
        row = {
            "engine": SHOWN.get(label, label),
            "passkeys": f"{sum(r['success'] for r in records)}/{len(records)}",
            # 4 decimals, as each trial's: a tiny bundle's median prompt can take under 5 ms, which 2 made 0
            "prefill_s": round(statistics.median(r["prefill_s"] for r in records), 4) if records else None,
            "peak_rss_gb": peak,
        }
        for name, reference in references.items():
            row[f"prefill_vs_{name}"] = prefill_ratio(records, reference[0]) if reference else None
            measured = reference and not math.isnan(peak) and not math.isnan(reference[1])  # NaN: none reported
            row[f"rss_vs_{name}"] = round(peak / reference[1], 3) if measured else None
        rows.append(row)
    return rows


def compare_table(rows: list[dict]) -> str:
    """The rows as a markdown table (— where a ratio has no reference)."""
    shown = lambda value, unit="": "—" if value is None else f"{value}{unit}"  # noqa: E731
    lines = [
        "| engine | passkeys | time to first token (median) | vs uncompressed | vs PyTorch | peak RSS | vs uncompressed"
        " | vs PyTorch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['engine']} | {row['passkeys']} | {shown(row['prefill_s'], ' s')} | "
            f"{shown(row['prefill_vs_uncompressed'], '×')} | {shown(row['prefill_vs_torch'], '×')} | "
            f"{shown(row['peak_rss_gb'], ' GB')} | {shown(row['rss_vs_uncompressed'], '×')} | "
            f"{shown(row['rss_vs_torch'], '×')} |"
        )
    return "\n".join(lines)


def plot_compare(rows: list[dict], title: str, path: Path) -> None:
    """Two panels: time to first token and peak RSS per engine, each bar labelled with its passkeys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["engine"] for row in rows]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for axis, field, label in ((axes[0], "prefill_s", "time to first token, s (median)"),
                               (axes[1], "peak_rss_gb", "peak RSS, GB")):  # fmt: skip
        values = [row[field] if row[field] is not None else 0.0 for row in rows]
        bars = axis.barh(names, values, color=[f"C{i}" for i in range(len(rows))])
        for bar, row in zip(bars, rows, strict=True):
            axis.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['passkeys']}", va="center")
        axis.set_xlabel(label)
        axis.margins(x=0.12)  # room for the passkeys after the longest bar
        axis.invert_yaxis()
    axes[1].set_yticks([])
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32000, 16000, 8000, 2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=32768, help="bundle context (edgec build --context)")
    parser.add_argument("--torch-max-tokens", type=int, default=0, help="also run PyTorch on trials up to this length")
    parser.add_argument(
        "--compare-recall", action="store_true", help="a --kv-recall bundle: run edgec with recall off, then on"
    )
    parser.add_argument("--speed-steps", type=int, default=64, help="with --compare-recall: decode steps timed")
    parser.add_argument(
        "--load-capacity", type=int, help="with --compare-recall: the compressed slots at load (Model.load kv_capacity)"
    )
    parser.add_argument("--load-recall", type=int, help="with --compare-recall: recalled blocks at load (kv_recall)")
    parser.add_argument(
        "--compare-builds",
        nargs="+",
        metavar="OPTIONS",
        help="each a quoted set of extra `edgec build` options: run those bundles beside the uncompressed one",
    )
    parser.add_argument("--worker", choices=["edgec", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trial-json", help=argparse.SUPPRESS)
    parser.add_argument("--load-json", default="{}", help=argparse.SUPPRESS)
    args, build_options = parser.parse_known_args(argv)
    if args.worker:
        load = json.loads(args.load_json)
        return worker(args.worker, args.bundle, json.loads(args.trial_json), load, args.speed_steps)
    if args.compare_recall and "--kv-recall" not in build_options:
        sys.exit("--compare-recall needs a bundle built with recall: add --kv-recall BLOCKS")
    if args.compare_builds and args.compare_recall:
        sys.exit("--compare-builds and --compare-recall are separate runs")
    if args.compare_builds:
        return compare_builds(args, build_options)

    bundle = build_bundle(args.context, build_options)
    trials = make_trials(args.lengths, args.depths, args.trials, args.seed)
    # the longest trial first in the edgec worker's run, so the peak RSS it reports is that prefill's
    if args.compare_recall:  # the same bundle and slots: plain eviction, then with recall
        load = {"kv_capacity": args.load_capacity} if args.load_capacity else {}
        on = load | ({"kv_recall": args.load_recall} if args.load_recall else {})
        results = {
            "edgec (no recall)": run_worker(
                "edgec", bundle, trials, "no recall", load | {"kv_recall": 0}, args.speed_steps
            ),
            "edgec (recall)": run_worker("edgec", bundle, trials, "recall", on, args.speed_steps),
        }
    else:
        results = {"edgec": run_worker("edgec", bundle, trials)}
    torch_trials = [trial for trial in trials if trial["length"] <= args.torch_max_tokens]
    if torch_trials:
        results["torch"] = run_worker("torch", bundle, torch_trials)
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load": round(os.getloadavg()[0], 2),
        "command": " ".join(["python", "benchmarks/passkey.py", *sys.argv[1:]]),
        "bundle": bundle.name,
        "build_options": build_options,
        "load_options": {"kv_capacity": args.load_capacity, "kv_recall": args.load_recall},
        "engines": {
            engine: {
                "successes": sum(r["success"] for r in records),
                "trials": len(records),
                "peak_rss_gb": peak,
                **({"decode": timing} if timing else {}),
                "records": records,
            }
            for engine, (records, peak, timing) in results.items()
        },
    }
    tag = f"-recall-{args.load_capacity or 'built'}-{args.load_recall or 'built'}" if args.compare_recall else ""
    out = models.OUT / f"passkey-{bundle.stem}{tag}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("| engine | passkeys | decode tokens/s | recall ms/step | peak RSS GB |")
    print("|---|---|---|---|---|")
    for engine, summary in report["engines"].items():
        decode = summary.get("decode", {})
        print(
            f"| {engine} | {summary['successes']}/{summary['trials']} | {decode.get('tokens_per_s', '—')} | "
            f"{decode.get('recall_ms_per_step', '—')} | {summary['peak_rss_gb']} |"
        )
    print(f"wrote {out}")


def compare_builds(args: argparse.Namespace, build_options: list[str]) -> None:
    """The uncompressed bundle, each ``--compare-builds`` bundle and PyTorch on the same trials, each engine in a
    process of its own; the table, a JSON and a PNG."""
    extra = [shlex.split(options) for options in args.compare_builds]
    if any(not options for options in extra):
        sys.exit("--compare-builds: an empty set of build options (that is the uncompressed bundle, always run)")
    trials = make_trials(args.lengths, args.depths, args.trials, args.seed)
    bundles = {UNCOMPRESSED: build_bundle(args.context, build_options)}
    bundles |= {f"edgec, {' '.join(options)}": build_bundle(args.context, build_options + options) for options in extra}
    results = {label: run_worker("edgec", bundle, trials, label) for label, bundle in bundles.items()}
    torch_trials = [trial for trial in trials if trial["length"] <= args.torch_max_tokens]
    if torch_trials:
        results["torch"] = run_worker("torch", bundles[UNCOMPRESSED], torch_trials)
    rows = compare_rows(results)
    report = {
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "load": round(os.getloadavg()[0], 2),
        "command": " ".join(["python", "benchmarks/passkey.py", *map(shlex.quote, sys.argv[1:])]),
        "bundles": {label: bundle.name for label, bundle in bundles.items()},
        "rows": rows,
        "engines": {label: {"peak_rss_gb": peak, "records": records} for label, (records, peak, _) in results.items()},
    }
    out = models.OUT / f"passkey-compare-{args.context}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    lengths = "/".join(str(length) for length in sorted(args.lengths, reverse=True))
    title = f"Gemma-3-270m passkeys, {lengths}-token prompts ({report['machine']}, {report['date']})"
    plot_compare(rows, title, out.with_suffix(".png"))
    print(compare_table(rows))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
