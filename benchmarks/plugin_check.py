"""The compressed cache's TensorRT-RTX plugin against its standard-op lowering, on a GPU that runs TensorRT-RTX
(compute capability 7.5/8.6/8.9/12.x; not sm90): two bundles that differ only in ``--kv-plugin``.

    # here (no GPU): build the pair for the GPU's target (SmolLM2 with a 16K config, int8 slots)
    python benchmarks/plugin_check.py prepare --target rtx3060 -o benchmarks/out/plugin-pair
    # on the GPU machine (edgec[tensorrt-rtx] installed):
    python benchmarks/plugin_check.py run benchmarks/out/plugin-pair --out plugin-check.json

``run`` reports, per bundle, decode tok/s after a ~4K and a ~16K-token prompt (64 greedy steps, timed apart from
the prefill; the two bundles alternate, three rounds, median), and between the two: the logits of a short prompt
and 16 teacher-forced decode steps (max |Δlogit|, top-1 agreement) and the decode speed ratio plugin / standard.
Without such a GPU it says why and exits 0 with nothing measured (the check is skipped, not failed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TENSORRT_RTX_CAPABILITIES = ((7, 5), (8, 6), (8, 9), (12, 0), (12, 1))
LENGTHS = (4096, 16000)
DECODE_STEPS = 64
ROUNDS = 3
SHORT_PROMPT, FORCED_STEPS = 32, 16
PAIR = ("standard", "plugin")  # the bundle folders' names: --kv-plugin off, on
KV = ("--kv-capacity", "4096", "--kv-dtype", "int8", "--kv-group", "32")


def prepare(model: Path, target: str, out: Path, context: int = 16384) -> list[Path]:
    """Build the pair with the edgec CLI: the same model, target and cache, the plugin off and on."""
    built = []
    for name in PAIR:
        bundle = out / f"{name}.edgec"
        flag = "on" if name == "plugin" else "off"
        command = [sys.executable, "-c", "from edgec.cli import main; main()", "build", str(model), "--target", target]
        command += ["-o", str(bundle)]
        command += ["--context", str(context), *KV, "--kv-plugin", flag, "--overwrite"]
        subprocess.run(command, check=True)
        built.append(bundle)
    return built


def gpu_capability() -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of GPU 0 by nvidia-smi; None without one."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return None
    line = done.stdout.strip().splitlines()[:1]
    if done.returncode or not line:
        return None
    name, _, capability = line[0].rpartition(",")
    major, _, minor = capability.strip().partition(".")
    return name.strip(), (int(major), int(minor or 0))


def skip_reason(gpu: tuple[str, tuple[int, int]] | None) -> str | None:
    if gpu is None:
        return "no NVIDIA GPU here (nvidia-smi finds none)"
    name, capability = gpu
    if capability not in TENSORRT_RTX_CAPABILITIES:
        return f"TensorRT-RTX does not run on sm{capability[0]}{capability[1]} ({name})"
    return None


def _prompt(model, length: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    ids = model.encode(text)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def decode_speed(model, length: int) -> float:
    """Decode tok/s: DECODE_STEPS greedy steps after a ``length``-token prompt, the prefill not timed."""
    import numpy as np

    ids = _prompt(model, length)
    with model._state() as state:
        logits = model._prefill(state, np.asarray(ids), all_logits=False)[-1]
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            logits = state.run(np.array([int(logits.argmax())]), length + step, last_only=True)[-1]
        return DECODE_STEPS / (time.perf_counter() - start)


def forced_logits(model, tokens: list[int]) -> list:
    """The logits before each of ``tokens[SHORT_PROMPT:]`` (prefill, then one token a step)."""
    import numpy as np

    with model._state() as state:
        rows = [model._prefill(state, np.asarray(tokens[:SHORT_PROMPT]), all_logits=False)[-1].astype(np.float32)]
        for position in range(SHORT_PROMPT, len(tokens) - 1):
            rows.append(state.run(np.array([tokens[position]]), position, last_only=True)[-1].astype(np.float32))
    return rows


def agreement(standard: list, plugin: list) -> dict[str, Any]:
    """Max |Δlogit| over the steps and how many steps pick the same top-1 token."""
    import numpy as np

    deltas = [float(np.abs(a - b).max()) for a, b in zip(standard, plugin, strict=True)]
    same = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(standard, plugin, strict=True))
    return {"max_abs_logit_delta": max(deltas), "top1_agree": same, "steps": len(deltas)}


def run(pair: Path) -> dict[str, Any]:
    from edgec.runtime import Model

    models = {name: Model.load(pair / f"{name}.edgec") for name in PAIR}
    reference = models["standard"]
    tokens = _prompt(reference, SHORT_PROMPT + FORCED_STEPS)
    logits = {name: forced_logits(model, tokens) for name, model in models.items()}
    speeds: dict[str, dict[str, list[float]]] = {name: {str(n): [] for n in LENGTHS} for name in PAIR}
    for _ in range(ROUNDS):  # alternating: drift in clocks or temperature hits both alike
        for length in LENGTHS:
            for name, model in models.items():
                speeds[name][str(length)].append(decode_speed(model, length))
    decode = {name: {n: statistics.median(v) for n, v in by.items()} for name, by in speeds.items()}
    ratio = {n: decode["plugin"][n] / decode["standard"][n] for n in decode["plugin"]}
    return {"logits": agreement(logits["standard"], logits["plugin"]), "decode_tok_s": decode, "ratio": ratio,
            "runs": speeds}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    lines = ["bundle     " + "".join(f"decode tok/s @{n:>6}  " for n in LENGTHS)]
    for name in PAIR:
        lines.append(f"{name:<10} " + "".join(f"{result['decode_tok_s'][name][str(n)]:>20.1f}  " for n in LENGTHS))
    lines.append("plugin/std " + "".join(f"{result['ratio'][str(n)]:>20.2f}x " for n in LENGTHS))
    agree = result["logits"]
    lines.append(
        f"logits: max |Δ| {agree['max_abs_logit_delta']:.4f}, top-1 agrees {agree['top1_agree']}/{agree['steps']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("prepare", help="build the standard/plugin pair here")
    make.add_argument("--target", default="rtx3060")
    make.add_argument("--model", type=Path, default=None, help="a model folder (default: SmolLM2 with a 16K config)")
    make.add_argument("-o", "--out", type=Path, required=True)
    check = commands.add_parser("run", help="measure the pair on this machine's GPU")
    check.add_argument("pair", type=Path)
    check.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from gpu_prepare import smollm2_long

            model = smollm2_long(args.out / "smollm2-16k-src")
        prepare(model, args.target, args.out)
        return 0
    if reason := skip_reason(gpu_capability()):
        print(f"skipped: {reason}; the plugin check needs a GPU that runs TensorRT-RTX")
        return 0
    result = run(args.pair)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
