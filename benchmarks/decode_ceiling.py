"""How fast could any KV cache make edgec's decode, against onnxruntime-genai int4 at a long prompt? One run:

    python benchmarks/decode_ceiling.py [--prompt 8000] [--threads 1,2] [--rounds 2] [--compressed NAME]

For each thread count, round by round in one process: onnxruntime-genai int4 decoding after the long prompt (its
step reads the whole fp32 cache), edgec's compressed int4 bundle after the same prompt (``--compressed``: one of
benchmarks/kv_speed.py's bundles, by default its 1024 fp32 slots read in place by GroupQueryAttention — the fastest
built; "edgec int4, 1024 int8 slots" for the op's own int8 slots; the default exact int4 weights), and edgec's
plain int4 bundle after a 64-token prompt
— the **floor**: the same weights and graph around attention, with a cache too short to cost anything. A cache that
cost nothing at all would decode at the floor's speed, so ``genai step / floor step`` is the most any cache design
can give over genai int4 at this prompt, and ``compressed step - floor step`` is what edgec's cache costs now.
The compressed bundle also decodes after the 64-token prompt (``compressed, short``): its op then reads ~64 slots
instead of 1024, so ``short - floor`` is what the op's nodes cost whatever they read (ONNX Runtime's per-node work)
and ``compressed - short`` what reading the full slots adds — for the int8 slots; the fp32 slots' kernel attends
every one of its C + 1 rows whatever is filled (empty ones masked), so for them the two steps cost the same.

Results: benchmarks/out/decode_ceiling.json and .png (``--plot-only`` redraws the plot from the json); the printed
table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_speed  # noqa: E402
import measure  # noqa: E402

FLOOR_PROMPT = 64
RESULTS = kv_speed.OUT / "decode_ceiling.json"


def step_ms(runner, ids: list[int], new_tokens: int) -> float:
    _, tokens_per_second = runner.run(ids, new_tokens)
    return 1000.0 / tokens_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=2)
    compressed = [name for name in kv_speed.BUNDLES if "slots" in name]  # the compressed caches
    parser.add_argument("--compressed", default=kv_speed.FP32_SLOTS, choices=compressed)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the saved results")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(RESULTS.read_text()), RESULTS.with_suffix(".png"))
        return
    thread_counts = [int(t) for t in args.threads.split(",")]
    names = [kv_speed.GENAI_INT4, args.compressed, kv_speed.PLAIN_INT4]
    kv_speed.prepare(names)
    ids = kv_speed.prompt_ids(args.prompt)
    rows = {}
    for threads in thread_counts:
        runners = {name: kv_speed.runner(name, threads) for name in names}
        for runner in runners.values():  # warm-up
            runner.run(ids[:256], 4)
        steps: dict[str, list[float]] = {"genai": [], "compressed": [], "floor": [], "short": []}
        for round_index in range(args.rounds):
            steps["genai"].append(step_ms(runners[kv_speed.GENAI_INT4], ids, args.new_tokens))
            steps["compressed"].append(step_ms(runners[args.compressed], ids, args.new_tokens))
            steps["floor"].append(step_ms(runners[kv_speed.PLAIN_INT4], ids[:FLOOR_PROMPT], args.new_tokens))
            steps["short"].append(step_ms(runners[args.compressed], ids[:FLOOR_PROMPT], args.new_tokens))
            latest = ", ".join(f"{name} {values[-1]:.1f} ms" for name, values in steps.items())
            print(f"{threads} thread(s), round {round_index}: {latest}", flush=True)
        del runners
        # one dict per round: the four steps that ran back to back in it
        paired = [dict(zip(steps, values, strict=True)) for values in zip(*steps.values(), strict=True)]

        def median(per_round, paired=paired) -> float:
            return float(np.median([per_round(r) for r in paired]))

        rows[threads] = {
            "steps_ms": {name: [round(s, 2) for s in values] for name, values in steps.items()},
            "genai_int4_ms": float(np.median(steps["genai"])),
            "compressed_ms": float(np.median(steps["compressed"])),
            "floor_ms": float(np.median(steps["floor"])),
            "compressed_short_ms": float(np.median(steps["short"])),
            "compressed_vs_genai_int4": median(lambda r: r["genai"] / r["compressed"]),
            "ceiling_vs_genai_int4": median(lambda r: r["genai"] / r["floor"]),
            "cache_cost_ms": median(lambda r: r["compressed"] - r["floor"]),
            # the op's nodes at ~64 slots (per-node work), and what the full slots add to it
            "op_nodes_ms": median(lambda r: r["short"] - r["floor"]),
            "slot_reads_ms": median(lambda r: r["compressed"] - r["short"]),
        }
    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "prompt": args.prompt,
        "floor_prompt": FLOOR_PROMPT,
        "compressed": args.compressed,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(results, indent=2))
    plot(results, RESULTS.with_suffix(".png"))
    print(
        f"| threads | genai int4 step, prompt {args.prompt} | edgec compressed step | edgec floor step "
        f"(prompt {FLOOR_PROMPT}) | compressed vs genai int4 | **ceiling vs genai int4** | cache's cost now "
        f"| of it: the op's nodes (compressed at prompt {FLOOR_PROMPT} − floor) | reading the full slots |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for threads, row in rows.items():
        print(
            f"| {threads} | {row['genai_int4_ms']:.1f} ms | {row['compressed_ms']:.1f} ms | {row['floor_ms']:.1f} ms | "
            f"{row['compressed_vs_genai_int4']:.2f}× | **{row['ceiling_vs_genai_int4']:.2f}×** | "
            f"{row['cache_cost_ms']:.1f} ms | {row['op_nodes_ms']:.1f} ms | {row['slot_reads_ms']:.1f} ms |"
        )


def plot(results: dict, path: Path) -> None:
    """Per thread count: the three steps as bars, the ceiling and the achieved ratio written on them."""
    rows = results["rows"]
    compressed = results.get("compressed", kv_speed.COMPRESSED)  # older results: the int8 slots
    kinds = [
        ("genai_int4_ms", f"onnxruntime-genai int4, prompt {results['prompt']}"),
        ("compressed_ms", f"{compressed}, prompt {results['prompt']}"),
        ("floor_ms", f"edgec int4, prompt {results['floor_prompt']} (no cache cost: the floor)"),
        ("compressed_short_ms", f"{compressed}, prompt {results['floor_prompt']} (the op's nodes)"),
    ]
    kinds = [(key, label) for key, label in kinds if all(key in row for row in rows.values())]  # older results
    notes = [
        f"now {row['compressed_vs_genai_int4']:.2f}×, ceiling {row['ceiling_vs_genai_int4']:.2f}×"
        for row in rows.values()
    ]
    title = f"Decode vs onnxruntime-genai int4: the most a KV cache can give ({results['machine']}, {results['date']})"
    step_bars(rows, kinds, notes, title, path, headroom=1.35, title_size=10)


def step_bars(
    rows: dict,
    kinds: list[tuple[str, str]],
    notes: list[str],
    title: str,
    path: Path,
    headroom: float,
    title_size: float | None = None,
) -> None:
    """Grouped bars of decode steps per thread count (``rows``: thread count → results; ``kinds``: (key, label) of
    each bar, the first the tallest), each group's note written above its first bar; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(kinds)
    for index, (key, label) in enumerate(kinds):
        positions = [t + (index - (len(kinds) - 1) / 2) * width for t in range(len(rows))]
        axis.bar(positions, [row[key] for row in rows.values()], width, label=label, color=f"C{index}")
    first = kinds[0][0]
    for t, (row, note) in enumerate(zip(rows.values(), notes, strict=True)):
        axis.annotate(note, (t, row[first]), ha="center", va="bottom", xytext=(0, 4), textcoords="offset points")
    axis.set_xticks(range(len(rows)), [f"{t} thread{'s' if int(t) > 1 else ''}" for t in rows])
    axis.set_ylabel("ms per decode step (lower is better)")
    axis.legend(loc="upper right", fontsize=8)
    axis.set_ylim(0, max(row[first] for row in rows.values()) * headroom)
    axis.set_title(title, **({"fontsize": title_size} if title_size else {}))  # None would drop the default
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
