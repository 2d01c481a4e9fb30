"""What the exact int4 import costs a decode step: the bundle's one-token graph timed against timing-only copies
without its two exact parts.

    python benchmarks/exact_cost.py [BUNDLE] [--threads 2,1] [--rounds 3] [--prompt 1200] [--steps 64]

The exact import of a GGUF's blocks (issue 16, ``passes/_weights.py``) adds two things to every product of a
decode step:

- **the split**: the activations as two rows, ``high`` on each block's int8 grid and ``low = x - high``
  (``_split_rows``: 11 small nodes a product, a second row for MatMulNBits and a ReduceSum over the two);
- **the minima**: a Q4_1 / K-quant block's minimum as ``blocksum(x) @ offsets`` added to the product (a ReduceSum,
  an fp32 MatMul over [blocks, N] offsets and an Add).

The copies (``timing_only``) drop one or both: "one row" feeds MatMulNBits the activations themselves (int8
activations, onnxruntime-genai int4's arithmetic), "no minima" leaves the offsets' product out (wrong answers).
Neither is a bundle anyone should run: they exist to price the parts. Each (variant, thread count) runs in a
process of its own, the variants alternating round by round; a process reads a ``--prompt``-token prompt (enough
to fill a compressed bundle's slots) and reports its mean decode step over ``--steps`` steps after 8 warm ones,
the better of two generations. BUNDLE defaults to benchmarks/kv_speed.py's fp32-slot bundle (built when missing).

Results: benchmarks/out/exact_cost.json and exact_cost.png; docs/BENCHMARKS.md, issue 21's thirty-second round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

VARIANTS = ("exact (the bundle)", "no minima", "one row", "one row, no minima")
DROPS = {
    "exact (the bundle)": set(),
    "no minima": {"minima"},
    "one row": {"split"},
    "one row, no minima": {"split", "minima"},
}
WARM_STEPS = 8


def _consumers(graph) -> dict[str, list]:
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def drop_exact_parts(model, drops: set[str]) -> dict[str, int]:
    """Rewrite ``model`` (an onnx ModelProto, in place) without the exact import's ``drops`` ("split", "minima");
    returns how many products lost each part. The nodes left dead are for the caller to remove."""
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    consumers = _consumers(graph)
    dropped = {"split": 0, "minima": 0}
    removed = []
    for product in [node for node in graph.node if node.op_type == "MatMulNBits"]:
        halves_sum = next((c for c in consumers.get(product.output[0], []) if c.op_type == "ReduceSum"), None)
        if halves_sum is None:
            continue  # not a split product (the prompt graph's, or a bundle without the split)
        if "split" in drops:
            rows = producer[product.input[0]]  # Reshape of Concat(high, low)
            both = producer[rows.input[0]]
            high = producer[both.input[0]]  # Mul(Round(Div(blocks, step)), step)
            blocks = producer[producer[producer[high.input[0]].input[0]].input[0]]
            if (rows.op_type, both.op_type, high.op_type, blocks.op_type) != ("Reshape", "Concat", "Mul", "Reshape"):
                raise ValueError(f"{product.name}: not the split's form")
            product.input[0] = blocks.input[0]  # the activations themselves, one row
            dropped["split"] += 1
        if "minima" in drops:
            plus = next((c for c in consumers.get(halves_sum.output[0], []) if c.op_type == "Add"), None)
            offsets = plus and next(name for name in plus.input if name != halves_sum.output[0])
            # the offsets product (blocksum(x) @ offsets), not an Add that follows a product without minima
            if plus is not None and producer.get(offsets) is not None and producer[offsets].op_type == "MatMul":
                halves_sum.output[0] = plus.output[0]
                removed.append(plus)
                dropped["minima"] += 1
    for node in removed:
        graph.node.remove(node)
    return dropped


def timing_only(bundle: Path, destination: Path, drops: set[str]) -> dict[str, int]:
    """A copy of ``bundle`` whose decode graph lacks ``drops`` (``models.bundle_variant``: the other files
    hard-linked, the manifest re-hashed); the nodes left dead are removed by onnx-ir's pass."""
    import onnx
    import onnx_ir
    import onnx_ir.passes.common

    manifest = json.loads((bundle / "manifest.json").read_text())
    model_file = manifest["model"].get("decode_file", manifest["model"]["file"])
    model = onnx.load(bundle / model_file, load_external_data=False)
    dropped = drop_exact_parts(model, drops)
    pruned = onnx_ir.from_proto(model)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(pruned)
    models.bundle_variant(bundle, destination, {model_file: onnx_ir.to_proto(pruned)}, manifest)
    return dropped


def step_ms(bundle: Path, threads: int, prompt: int, steps: int) -> float:
    """Mean decode step (ms) after a ``prompt``-token prompt: the better of two generations of ``steps`` tokens."""
    from edgec.runtime import Model

    model = Model.load(bundle, threads=threads)
    ids = model.encode(models.austen_text())[:prompt]
    means = []
    for _ in range(2):
        gaps, last = [], None
        for _token in model.generate_ids(ids, max_new_tokens=WARM_STEPS + steps + 1):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        means.append(statistics.fmean(gaps[WARM_STEPS:]) * 1000)
    return min(means)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thread_counts = sorted({int(t) for t in rows})
    figure, axes = plt.subplots(1, len(thread_counts), figsize=(5 * len(thread_counts), 3.2), squeeze=False)
    for axis, threads in zip(axes[0], thread_counts, strict=True):
        table = rows[str(threads)]
        names = list(table)
        axis.barh(names, [table[name]["median_ms"] for name in names], color=["#555", "#4a8", "#48c", "#c84"])
        for y, name in enumerate(names):
            axis.text(table[name]["median_ms"], y, f" {table[name]['ratio']:.3f}×", va="center")
        axis.invert_yaxis()
        axis.set_xlabel("decode step, ms (median of rounds)")
        axis.set_title(f"{threads} thread{'s' if threads > 1 else ''}")
    figure.suptitle("what the exact int4 import costs a decode step (timing-only copies)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", nargs="?", type=Path)
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--time", type=Path, help=argparse.SUPPRESS)  # a timing worker: one bundle, print its ms
    args = parser.parse_args()
    if args.time:
        print(json.dumps(step_ms(args.time, int(args.threads), args.prompt, args.steps)))
        return
    bundle = args.bundle
    if bundle is None:
        import kv_speed

        kv_speed.build_bundles([kv_speed.FP32_SLOTS])
        bundle = kv_speed.OUT / kv_speed.BUNDLES[kv_speed.FP32_SLOTS][0]
    folder = models.OUT / "exact_cost"
    paths = {VARIANTS[0]: bundle}
    for name in VARIANTS[1:]:
        paths[name] = folder / (name.replace(", ", "-").replace(" ", "-") + ".edgec")
        print(f"{name}: {timing_only(bundle, paths[name], DROPS[name])} products changed", flush=True)
    samples: dict[tuple[int, str], list[float]] = {}
    for round_index in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            for name in order:
                command = [sys.executable, __file__, "--time", str(paths[name]), "--threads", str(threads)]
                command += ["--prompt", str(args.prompt), "--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                samples.setdefault((threads, name), []).append(float(done.stdout.strip().splitlines()[-1]))
                print(
                    f"round {round_index}, {threads} thread(s): {name} {samples[threads, name][-1]:.2f} ms", flush=True
                )
    rows: dict[str, dict] = {}
    print("\n| threads | graph | decode step, ms (per round) | vs the bundle (geometric mean of rounds) |")
    print("|---|---|---|---|")
    for (threads, name), values in samples.items():
        base = samples[threads, VARIANTS[0]]
        ratio = statistics.geometric_mean([value / first for value, first in zip(values, base, strict=True)])
        rows.setdefault(str(threads), {})[name] = {"ms": values, "median_ms": statistics.median(values), "ratio": ratio}
        per_round = ", ".join(f"{value:.2f}" for value in values)
        print(f"| {threads} | {name} | {statistics.median(values):.2f} ({per_round}) | {ratio:.3f}× |")
    result = {"bundle": str(bundle), "prompt": args.prompt, "steps": args.steps, "rows": rows, "date": time.ctime()}
    (models.OUT / "exact_cost.json").write_text(json.dumps(result, indent=1))
    plot(rows, models.OUT / "exact_cost.png")
    print(f"\nwrote {models.OUT / 'exact_cost.json'} and exact_cost.png")


if __name__ == "__main__":
    main()
