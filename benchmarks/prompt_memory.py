"""Resident memory through a long prompt, chunk by chunk: where a compressed bundle's peak comes from.

    python benchmarks/prompt_memory.py [BUNDLE ...] [--prompt 8000] [--threads 2] [--rounds 2] [--orders both]
        [--prompts 1]

Default bundles: kv_speed.py's plain int4 one and its 1,024-fp32-slot one (``end`` prompts), built if missing.
Each (bundle, prompt-session order, round) runs in a process of its own, in alternation: load, open a state, read
the prompt chunk by chunk as ``Model`` does, then select the slots. After each chunk it reads the process's VmRSS and
the peak within the chunk (VmHWM, reset before each chunk through /proc/self/clear_refs where the kernel allows),
so the curve shows what grows with the prompt (the cache, or an `end` prompt's temporary state) and what the chunk
itself needs. Each row also splits the resident memory by kind (/proc/self/status): anonymous (the heap, ONNX
Runtime's sessions and arena, numpy's arrays), shared (an `end` prompt's temporary state lies in mappings of its own)
and file pages (the mapped weights); and the same split is kept after loading, after opening a state, after
``begin_prompt`` and after the selection — where a peak's excess sits, not only how large it is. ``--prompts N``
reads the prompt N times in each process, one after another as a chat or a server would, and reports each one's
peak (the rows and stages are the last prompt's): a state's second prompt starts with the first one's slots.
``--orders``: the prompt session in the order the runtime chooses (``runtime``), in ONNX Runtime's default order
(``default``), or both — what ``backend_ort.prompt_order_by_priority`` buys. Results:
benchmarks/out/prompt_memory.json and a PNG of the curves beside it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_speed  # noqa: E402
from measure import machine  # noqa: E402

DEFAULT_BUNDLES = (kv_speed.PLAIN_INT4, kv_speed.FP32_SLOTS)
ORDERS = {"runtime": ("runtime",), "default": ("default",), "both": ("runtime", "default")}


KINDS = ("RssAnon", "RssShmem", "RssFile")  # resident memory by kind, as /proc/self/status splits VmRSS


def _status_gib() -> dict[str, float]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:", *(f"{kind}:" for kind in KINDS))):
            values[line.split(":")[0]] = int(line.split()[1]) / 2**20
    return values


def _kinds(status: dict[str, float]) -> dict[str, float]:
    """VmRSS and its split by kind, GiB (a kernel without the split gives VmRSS alone)."""
    return {name: round(status[name], 4) for name in ("VmRSS", *KINDS) if name in status}


def _reset_peak() -> bool:
    """VmHWM := VmRSS; False where the kernel does not allow it (the peaks are then the process's so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def worker(bundle: Path, ids: list[int], threads: int, order: str, prompts: int = 1) -> dict:
    """``prompts`` prompts of ``ids`` through ``bundle``, one after another in this process (as a chat or a server
    reads them): GiB after loading; for the last prompt, per chunk (end token, VmRSS, VmHWM within the chunk, then
    RssAnon, RssShmem, RssFile) and after the selection; the split by kind at each stage (``begun`` and after it:
    the last prompt's); each prompt's own peak; the last prompt's seconds."""
    import numpy as np

    from edgec.runtime import Model, backend_ort

    if order == "default":
        backend_ort.prompt_order_by_priority = lambda spec: False
    model = Model.load(bundle, threads=threads)
    status = _status_gib()
    loaded = status["VmRSS"]
    stages = {"loaded": _kinds(status)}
    state = model._backend.open_state()
    stages["opened"] = _kinds(_status_gib())
    prompt = np.asarray(ids, np.int64)
    chunks = model._chunks(len(prompt), getattr(state, "compression", None))
    peaks = []
    for _ in range(prompts):
        resets = [_reset_peak()]
        state.reset()
        state.begin_prompt(len(prompt))
        stages["begun"] = _kinds(_status_gib())
        rows = []
        started = time.perf_counter()
        for start, end in chunks:
            resets.append(_reset_peak())
            if end < len(prompt) and hasattr(state, "feed"):
                state.feed(prompt[start:end], start)
            else:
                state.run(prompt[start:end], start, last_only=True)
            now = _status_gib()
            kinds = (round(now.get(kind, 0.0), 4) for kind in KINDS)
            rows.append([end, round(now["VmRSS"], 4), round(now["VmHWM"], 4), *kinds])
        stages["last chunk"] = _kinds(now)
        resets.append(_reset_peak())
        state.end_prompt(len(prompt) - 1, last_chunk_start=chunks[-1][0])
        after = _status_gib()
        stages["selected"] = _kinds(after)
        seconds = time.perf_counter() - started
        peaks.append(round(max([after["VmHWM"], *(row[2] for row in rows)]), 4))
    return {
        "loaded_gib": round(loaded, 4),
        "stages": stages,
        "chunks": rows,
        "selection_peak_gib": round(after["VmHWM"], 4),
        "after_gib": round(after["VmRSS"], 4),
        "peak_gib": max(peaks),
        "prompt_peaks_gib": peaks,
        "prompt_s": round(seconds, 2),
        "peak_per_chunk": all(resets),  # False: each chunk's "peak" is the process's peak up to it
    }


def run(bundles: list[Path], length: int, threads: int, rounds: int, orders: tuple[str, ...], prompts: int = 1) -> dict:
    ids = kv_speed.prompt_ids(length, bundles[0])
    if len(ids) < length:
        sys.exit(f"the prompt text gives {len(ids)} tokens, fewer than --prompt {length}")
    runs: dict[str, list[dict]] = {}
    for number in range(rounds):
        pairs = [(bundle, order) for bundle in bundles for order in orders]
        for bundle, order in pairs if number % 2 == 0 else reversed(pairs):
            command = [sys.executable, __file__, "--worker", str(bundle), "--threads", str(threads), "--order", order]
            command += ["--prompts", str(prompts)]
            done = subprocess.run(command, input=json.dumps(ids), capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{bundle.name} ({order} order) failed: {done.stderr.strip().splitlines()[-1:]}")
            runs.setdefault(f"{bundle.name} ({order} order)", []).append(json.loads(done.stdout.splitlines()[-1]))
    return {
        "date": str(date.today()),
        "machine": machine(),
        "command": "python benchmarks/prompt_memory.py " + " ".join(sys.argv[1:]),
        "prompt": length,
        "prompts": prompts,
        "threads": threads,
        "runs": runs,
        "summary": {name: _summary(results) for name, results in runs.items()},
    }


def _summary(results: list[dict]) -> dict:
    """Medians over a bundle's runs: loaded, peak and prompt seconds, and each stage's split by kind."""
    summary = {key: statistics.median(r[key] for r in results) for key in ("loaded_gib", "peak_gib", "prompt_s")}
    summary["prompt_peaks_gib"] = [
        round(statistics.median(one), 4) for one in zip(*(r["prompt_peaks_gib"] for r in results), strict=True)
    ]
    stages = results[0]["stages"]
    summary["stages"] = {
        stage: {kind: round(statistics.median(r["stages"][stage][kind] for r in results), 4) for kind in kinds}
        for stage, kinds in stages.items()
    }
    return summary


def stage_table(summary: dict) -> str:
    """The stages' split by kind, GiB, one bundle per block (Markdown)."""
    lines = []
    for name, values in summary.items():
        stages = values["stages"]
        kinds = [kind for kind in ("VmRSS", *KINDS) if all(kind in one for one in stages.values())]
        lines += [f"{name}", "", "| stage | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {stage} | " + " | ".join(f"{one[k]:.3f}" for k in kinds) + " |" for stage, one in stages.items()]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, kinds) = plt.subplots(2, 1, figsize=(10, 9), sharex=True)
    for index, (name, results) in enumerate(result["runs"].items()):
        for number, one in enumerate(results):
            ends = [row[0] for row in one["chunks"]]
            label = name if number == 0 else None
            axis.plot(ends, [row[2] for row in one["chunks"]], color=f"C{index}", alpha=0.8, label=label)
            if all(len(row) > 4 for row in one["chunks"]):  # anonymous solid, shared dashed
                kinds.plot(ends, [row[3] for row in one["chunks"]], color=f"C{index}", alpha=0.8, label=label)
                kinds.plot(ends, [row[4] for row in one["chunks"]], color=f"C{index}", alpha=0.8, linestyle="--")
    axis.set_ylabel("process peak within the chunk, GiB")
    axis.set_title(f"Resident memory through a {result['prompt']}-token prompt ({result['machine']}, {result['date']})")
    axis.legend(fontsize=8)
    kinds.set_xlabel("prompt tokens read")
    kinds.set_ylabel("after the chunk, GiB: anonymous (solid), shared (dashed)")
    kinds.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="*", type=Path)
    parser.add_argument("--prompt", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--orders", choices=list(ORDERS), default="both")
    parser.add_argument(
        "--prompts", type=int, default=1, help="prompts read one after another in each process (a chat, a server)"
    )
    parser.add_argument("--out", type=Path, default=kv_speed.OUT / "prompt_memory.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--order", choices=("runtime", "default"), default="runtime", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(sys.stdin.read()), args.threads, args.order, args.prompts)))
        return
    if not Path("/proc/self/status").exists():
        sys.exit("this benchmark reads /proc/self/status (Linux)")
    if args.prompt < 2 or args.rounds < 1 or args.prompts < 1:
        sys.exit("--prompt must be ≥ 2, --rounds and --prompts ≥ 1")
    bundles = args.bundles
    if not bundles:
        kv_speed.prepare(list(DEFAULT_BUNDLES))
        bundles = [kv_speed.OUT / kv_speed.BUNDLES[name][0] for name in DEFAULT_BUNDLES]
    for bundle in bundles:
        if not (bundle / "manifest.json").is_file():
            sys.exit(f"not a bundle: {bundle}")
    result = run(bundles, args.prompt, args.threads, args.rounds, ORDERS[args.orders], args.prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for name, values in result["summary"].items():
        print(
            f"{name:60s} loaded {values['loaded_gib']:.3f} GiB  peak {values['peak_gib']:.3f} GiB  "
            f"prompt {values['prompt_s']:.1f} s"
            + (
                f"  each prompt's peak {', '.join(f'{x:.3f}' for x in values['prompt_peaks_gib'])} GiB"
                if args.prompts > 1
                else ""
            )
        )
    print()
    print(stage_table(result["summary"]))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
