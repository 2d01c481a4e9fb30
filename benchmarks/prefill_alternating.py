"""Time to first token of several bundles in ONE process, prompt by prompt in alternation, each prompt's steps
timed: the tightest pairing this shared box allows for "what does the compressed prompt cost over the plain one".

    python benchmarks/prefill_alternating.py [BUNDLE ...] [--prompt 8000] [--threads 2] [--rounds 3] [--one-row]

Default bundles: kv_speed.py's plain int4 one and its compressed one (1024 int8 slots, ``end``), built if missing.
Every bundle is loaded once (threads as given, spinning by the calibration as `edgec run` loads), warmed with one
short prompt, then each round reads the same prompt through every bundle — in order on even rounds, reversed on odd
ones, so no bundle always follows the same neighbour — timing each step of the prompt (``state.run``) and the slot
selection after it (``state.end_prompt``). kv_speed.py's rounds put a minute of decode and two other runtimes
between the two prefills it pairs; here they are back to back.

Prints per bundle the median of: the whole prompt, its first step, the steps between (the appending chunks of an
``end`` prompt), its last step (the one that observes) and the selection; then each bundle's per-round ratio to the
first bundle, pooled (geometric mean, ~95 % interval: ``pool_rounds.pool``, verdict against ``--bound``).
``--one-row`` also reads every prompt the way a bundle without ``model.no_logits_rows`` does (a logits row for each
chunk): what skipping the lm_head for the chunks before the last buys. Results:
benchmarks/out/prefill_alternating.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_speed  # noqa: E402
import models  # noqa: E402
import pool_rounds  # noqa: E402
from measure import machine  # noqa: E402

PHASES = ("total", "first step", "middle steps", "last step", "selection")


class TimedState:
    """A cache state whose prompt steps and selection are timed (everything else passes through)."""

    def __init__(self, state) -> None:
        self.state, self.steps, self.selection = state, [], 0.0

    def __getattr__(self, name: str):
        return getattr(self.state, name)

    def run(self, *args, **kwargs):
        started = time.perf_counter()
        result = self.state.run(*args, **kwargs)
        self.steps.append(time.perf_counter() - started)
        return result

    def feed(self, *args, **kwargs) -> None:  # a chunk before the last, whose logits nobody reads
        started = time.perf_counter()
        self.state.feed(*args, **kwargs)
        self.steps.append(time.perf_counter() - started)

    def end_prompt(self, *args, **kwargs) -> None:
        started = time.perf_counter()
        self.state.end_prompt(*args, **kwargs)
        self.selection = time.perf_counter() - started


def read_prompt(model, ids: np.ndarray) -> dict[str, float]:
    """Seconds of each phase of one prompt read through ``model`` (the runtime's own prompt path)."""
    with model._state() as state:
        timed = TimedState(state)
        started = time.perf_counter()
        model._prefill(timed, ids, all_logits=False)
        total = time.perf_counter() - started
    steps = timed.steps
    middle = sum(steps[1:-1]) if len(steps) > 2 else 0.0
    last = steps[-1] if len(steps) > 1 else 0.0
    return dict(zip(PHASES, (total, steps[0], middle, last, timed.selection), strict=True))


def measure(
    bundles: list[Path], ids: np.ndarray, threads: int, rounds: int, calibrate: bool = True, one_row: bool = False
) -> dict[str, list[dict[str, float]]]:
    """Every bundle's phases per round (``calibrate``: spinning as this machine's stored measurement says).
    ``one_row``: each bundle also loaded a second time computing a logits row for every prompt chunk, as bundles
    without ``model.no_logits_rows`` do (first, so the ratios are against the first bundle's one-row reading)."""
    from edgec.runtime import Model

    loaded = {}
    for bundle in bundles:
        if one_row:
            model = Model.load(bundle, threads=threads, calibrate=calibrate)
            if not model._backend.no_logits_rows:
                sys.exit(f"{bundle.name} computes a logits row for every chunk already (rebuild it to compare)")
            model._backend.no_logits_rows = False
            loaded[f"{bundle.name}, a logits row per chunk"] = model
        loaded[bundle.name] = Model.load(bundle, threads=threads, calibrate=calibrate)
    for model in loaded.values():  # warm-up: the first prompt of a session pays its one-time costs
        read_prompt(model, ids[: min(len(ids), 600)])
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in loaded}
    for index in range(rounds):
        order = list(loaded) if index % 2 == 0 else list(loaded)[::-1]
        for name in order:
            samples[name].append(read_prompt(loaded[name], ids))
            print(f"round {index}: {name} {samples[name][-1]['total']:.2f} s", flush=True)
    return samples


def summary(samples: dict[str, list[dict[str, float]]], bound: float, threads: int) -> dict:
    """Medians per phase, and every bundle's per-round total against the first bundle's, pooled
    (``pool_rounds.Pooled`` as a dict)."""
    names = list(samples)
    medians = {
        name: {phase: statistics.median(sample[phase] for sample in runs) for phase in PHASES}
        for name, runs in samples.items()
    }
    pooled = {}
    for name in names[1:]:
        ratios = [a["total"] / b["total"] for a, b in zip(samples[name], samples[names[0]], strict=True)]
        target = pool_rounds.Target(f"{name} vs {names[0]}", name, names[0], "total", bound, True)
        pooled[name] = dataclasses.asdict(pool_rounds.pool(ratios, target, threads))
    return {"medians": medians, "pooled": pooled}


def default_bundles() -> list[Path]:
    names = [kv_speed.PLAIN_INT4, kv_speed.COMPRESSED]
    kv_speed.build_bundles(names)  # onnxruntime-genai's models are not needed here
    return [kv_speed.OUT / kv_speed.BUNDLES[name][0] for name in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="*", type=Path, help="bundles to compare (ratios against the first)")
    parser.add_argument("--prompt", type=int, default=8000, help="prompt tokens (Pride and Prejudice)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bound", type=float, default=1.10, help="the ratio each bundle should stay within")
    parser.add_argument("--out", type=Path, default=models.OUT / "prefill_alternating.json")
    parser.add_argument(
        "--one-row",
        action="store_true",
        help="also read each prompt computing a logits row for every chunk (no model.no_logits_rows): one bundle "
        "then compares against itself",
    )
    args = parser.parse_args(argv)
    bundles = args.bundles or default_bundles()
    if len(bundles) < (1 if args.one_row else 2):
        sys.exit("give two or more bundles (ratios are against the first), or one with --one-row")
    if missing := [str(b) for b in bundles if not (b / "manifest.json").is_file()]:
        sys.exit(f"not a bundle: {missing[0]}")
    ids = np.asarray(kv_speed.prompt_ids(args.prompt, bundles[0]), np.int64)
    samples = measure(bundles, ids, args.threads, args.rounds, one_row=args.one_row)
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": date.today().isoformat(),
        "machine": machine(),
        "threads": args.threads,
        "prompt": len(ids),
        "samples": samples,
        **summary(samples, args.bound, args.threads),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n| bundle, prompt {len(ids)}, {args.threads} thread(s) | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for name, medians in result["medians"].items():
        print(f"| {name} | " + " | ".join(f"{medians[phase]:.2f} s" for phase in PHASES) + " |")
    print()
    print(pool_rounds.table([pool_rounds.Pooled(**entry) for entry in result["pooled"].values()]))


if __name__ == "__main__":
    main()
