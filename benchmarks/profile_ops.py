"""Where a decode step's time goes, by op type: ONNX Runtime's profiler over decode steps of a built bundle.

    python benchmarks/profile_ops.py BUNDLE [--prompt 128] [--steps 32]

Prints, per op type, the mean time per decode step and its share (ORT's node events; a step's Python and
session overhead are outside them). The prefill's events are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402


def profile(bundle: Path, prompt: int, steps: int, threads: int) -> dict[str, float]:
    from edgec.runtime import Model

    class ProfiledOptions(ort.SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(models.OUT / "ort-profile")

    plain, ort.SessionOptions = ort.SessionOptions, ProfiledOptions  # the runtime builds its session with these
    try:
        model = Model.load(bundle, threads=threads)
    finally:
        ort.SessionOptions = plain
    ids = model.encode(models.austen_text())[:prompt]
    tokens = model.generate_ids(ids, max_new_tokens=steps + 1)
    for _ in tokens:
        pass
    events = json.loads(Path(model._backend.graph.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-steps:]  # decode steps
    per_op: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if any(run["ts"] <= event["ts"] <= run["ts"] + run["dur"] for run in runs):
            per_op[event["args"]["op_name"]] += event["dur"] / len(runs)
    return dict(sorted(per_op.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    per_op = profile(args.bundle, args.prompt, args.steps, args.threads)
    total = sum(per_op.values())
    print(f"{args.bundle.name}: {total / 1000:.2f} ms of kernels per decode step (prompt {args.prompt})")
    for op, micros in per_op.items():
        print(f"  {op:<32} {micros / 1000:7.3f} ms  {micros / total:6.1%}")


if __name__ == "__main__":
    main()
