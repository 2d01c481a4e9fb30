"""Pool the rounds of several paired ``kv_speed.py`` runs into one estimate per target of issue 21.

    python benchmarks/pool_rounds.py benchmarks/out/kv_speed-eighth.json benchmarks/out/kv_speed-ninth.json ...

One run's ratio is a median over 2–3 rounds, and this box moves the same prefill by ±5–10 % between rounds, so a
target within a few percent is met or missed by which run one quotes. Every round of ``kv_speed.py`` runs each
runtime once, so round i of one runtime pairs with round i of another; this pools those per-round ratios over
runs (only runs of the same bundles should be pooled: the files' commands say which), and reports per thread count
the number of rounds, their geometric mean, range and an approximate 95 % interval (Student's t on the log ratios).
A target is *met* when the whole interval is on its side, *missed* when the whole interval is on the other,
and *undecided* otherwise.

Writes benchmarks/out/pool_rounds.json and .png (each round a dot, the pooled mean and the target as lines).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

COMPRESSED, PLAIN = "edgec int4, 1024 int8 slots", "edgec int4, full fp32 cache"
FP32_SLOTS = "edgec int4, 1024 fp32 slots"  # kv_speed.FP32_SLOTS: decode through GroupQueryAttention in place
GENAI_FP32, GENAI_INT4 = "onnxruntime-genai fp32", "onnxruntime-genai int4"


@dataclass(frozen=True)
class Target:
    """Issue 21's bar for one ratio: ``runtime``'s over ``against``'s (``field``: prefill seconds or decode tok/s)."""

    label: str
    runtime: str
    against: str
    field: str
    bound: float
    at_most: bool  # True: the ratio must be ≤ bound; False: ≥ bound


TARGETS = (
    Target("compressed prefill vs edgec plain", COMPRESSED, PLAIN, "prefill_s_all", 1.10, True),
    Target("compressed prefill vs genai fp32", COMPRESSED, GENAI_FP32, "prefill_s_all", 1.00, True),
    Target("compressed decode vs genai int4", COMPRESSED, GENAI_INT4, "decode_tok_s_all", 3.00, False),
    Target("plain prefill vs genai fp32", PLAIN, GENAI_FP32, "prefill_s_all", 1.00, True),  # item 2: beat genai's
    Target("fp32-slot prefill vs edgec plain", FP32_SLOTS, PLAIN, "prefill_s_all", 1.10, True),
    Target("fp32-slot prefill vs genai fp32", FP32_SLOTS, GENAI_FP32, "prefill_s_all", 1.00, True),
    Target("fp32-slot decode vs genai int4", FP32_SLOTS, GENAI_INT4, "decode_tok_s_all", 3.00, False),
)

# two-sided 95 % Student t quantiles by degrees of freedom (1..30); beyond, the normal's 1.96 is close enough
T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10)
T95 += (2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


@dataclass(frozen=True)
class Pooled:
    label: str
    threads: int
    bound: float
    at_most: bool
    ratios: list[float]
    geomean: float
    low: float  # approximate 95 % interval of the geometric mean (equal to geomean for one round: undecided)
    high: float
    verdict: str  # met / missed / undecided


def row_key(name: str, threads: int) -> str:
    """A runtime's row in kv_speed.py's results (kv_speed names its rows with this)."""
    return f"{name}, {threads} thread{'s' if threads > 1 else ''}"


def round_ratios(run: dict, target: Target, threads: int) -> list[float]:
    """This run's per-round ratios for ``target`` at ``threads`` ([] when either runtime did not run)."""
    rows = run.get("rows", {})
    mine, theirs = rows.get(row_key(target.runtime, threads)), rows.get(row_key(target.against, threads))
    if not mine or not theirs:
        return []
    pairs = list(zip(mine[target.field], theirs[target.field], strict=True))
    return [a / b for a, b in pairs if a > 0 and b > 0]


def pool(ratios: list[float], target: Target, threads: int) -> Pooled:
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) > 1:
        t = T95[len(logs) - 2] if len(logs) - 1 <= len(T95) else 1.96
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    else:
        half = 0.0
    low, high = math.exp(mean - half), math.exp(mean + half)
    if len(logs) < 2:  # one round has no spread to judge it by
        verdict = "undecided"
    elif target.at_most:
        verdict = "met" if high <= target.bound else "missed" if low > target.bound else "undecided"
    else:
        verdict = "met" if low >= target.bound else "missed" if high < target.bound else "undecided"
    rounded = [round(r, 4) for r in ratios]
    return Pooled(target.label, threads, target.bound, target.at_most, rounded, math.exp(mean), low, high, verdict)


def pool_runs(runs: list[dict]) -> list[Pooled]:
    """Every target at every thread count any run measured, pooled over all runs' rounds."""
    thread_counts = sorted({t for run in runs for t in run.get("threads", [])})
    pooled = []
    for target in TARGETS:
        for threads in thread_counts:
            ratios = [r for run in runs for r in round_ratios(run, target, threads)]
            if ratios:
                pooled.append(pool(ratios, target, threads))
    return pooled


def table(pooled: list[Pooled]) -> str:
    """The pooled targets as a markdown table."""
    lines = [
        "| target | threads | rounds | pooled ratio | range | ~95 % interval | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in pooled:
        bound = f"{'≤' if p.at_most else '≥'} {p.bound:.2f}×"
        lines.append(
            f"| {p.label} ({bound}) | {p.threads} | {len(p.ratios)} | {p.geomean:.3f}× | "
            f"{min(p.ratios):.2f}–{max(p.ratios):.2f}× | {p.low:.3f}–{p.high:.3f}× | {p.verdict} |"
        )
    return "\n".join(lines)


def plot(pooled: list[Pooled], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TARGETS), figsize=(5 * len(TARGETS), 4), squeeze=False)
    for axis, target in zip(axes[0], TARGETS, strict=True):
        mine = [p for p in pooled if p.label == target.label]
        for x, entry in enumerate(mine):
            axis.plot([x] * len(entry.ratios), entry.ratios, "o", alpha=0.5, color="C0")
            axis.errorbar(
                x + 0.15,
                entry.geomean,
                [[entry.geomean - entry.low], [entry.high - entry.geomean]],
                fmt="s",
                color="C1",
            )
        sign = "≤" if target.at_most else "≥"
        axis.axhline(target.bound, color="C3", linestyle="--", label=f"target {sign} {target.bound}")
        axis.set_xticks(range(len(mine)), [f"{p.threads} thread{'s' if p.threads > 1 else ''}" for p in mine])
        axis.set_title(target.label, fontsize=10)
        axis.set_ylabel("ratio: rounds (dots), pooled mean ± 95 %")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="kv_speed.py result files (benchmarks/out/kv_speed*.json)")
    parser.add_argument("--out", type=Path, default=models.OUT / "pool_rounds.json")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            sys.exit(f"cannot read {path}: {error}")
    try:
        pooled = pool_runs(runs)
    except (AttributeError, KeyError, TypeError, ValueError) as error:  # rounds of unequal count, a non-number
        sys.exit(f"not kv_speed.py results with paired rounds: {error!r}")
    if not pooled:
        sys.exit("no paired rounds in these files (kv_speed.py results with the compressed bundle and its peers)")
    print(table(pooled))
    commands = [run.get("command", "") for run in runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": commands, "pooled": [asdict(p) for p in pooled]}, indent=2))
    plot(pooled, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
