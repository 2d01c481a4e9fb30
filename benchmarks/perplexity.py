"""Perplexity of built bundles on Pride and Prejudice: four 1024-token windows, through the runtime.

    python benchmarks/perplexity.py BUNDLE [BUNDLE ...]

Each window is scored on its own (``Model.logprobs`` over ``encode(text)[i*1024:(i+1)*1024]``, i = 0..3), the
way docs/BENCHMARKS.md reports every perplexity; also prints the bundle's weight bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

WINDOWS, WINDOW = 4, 1024


def perplexity(bundle: Path, threads: int = 2, onnx_cpu: bool = False) -> float:
    from edgec.runtime import Model

    if onnx_cpu:  # a TensorRT-RTX bundle's model.onnx (the graph its engine came from), on ONNX Runtime CPU
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["runtime"] = {"library": "onnxruntime", "providers": ["CPUExecutionProvider"]}
        model = Model(bundle, manifest, threads=threads)
    else:
        model = Model.load(bundle, threads=threads)
    ids = model.encode(models.austen_text())
    logprobs = np.concatenate([model.logprobs(ids[i * WINDOW : (i + 1) * WINDOW]) for i in range(WINDOWS)])
    return float(np.exp(-logprobs.mean()))


def bytes_per_parameter(bundle: Path, parameters: int) -> float:
    manifest = json.loads((bundle / "manifest.json").read_text())
    size = sum(entry["size"] for name, entry in manifest["files"].items() if name.startswith("model.onnx"))
    return size / parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--onnx-cpu", action="store_true", help="run a GPU bundle's model.onnx on ORT CPU")
    parser.add_argument("--parameters", type=int, default=134_515_008, help="SmolLM2-135M's count (tied table once)")
    args = parser.parse_args()
    for bundle in args.bundles:
        ppl = perplexity(bundle, onnx_cpu=args.onnx_cpu)
        print(f"{bundle.name}: perplexity {ppl:.3f}, {bytes_per_parameter(bundle, args.parameters):.3f} bytes/param")


if __name__ == "__main__":
    main()
