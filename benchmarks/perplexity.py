"""Perplexity of built bundles on Pride and Prejudice: four 1024-token windows, through the runtime.

    python benchmarks/perplexity.py BUNDLE [BUNDLE ...]
    python benchmarks/perplexity.py --genai benchmarks/out/genai-int4     # an onnxruntime-genai model folder

Each window is scored on its own (``Model.logprobs`` over ``encode(text)[i*1024:(i+1)*1024]``, i = 0..3), the
way docs/BENCHMARKS.md reports every perplexity (``edgec.evaluate.window_perplexity``, as `edgec eval --windows
1024 --window-count 4` computes it); also prints the bundle's weight bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from edgec.evaluate import window_perplexity

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
    return window_perplexity(model.logprobs, ids, WINDOW, WINDOWS)["perplexity"]  # what `edgec eval` reports


def genai_perplexity(folder: Path) -> float:
    """The same windows through onnxruntime-genai, one token at a time (its graph keeps only the last position's
    logits), tokenized by the same tokenizer (the genai folder's tokenizer.json is SmolLM2's)."""
    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    from edgec.runtime.model import _log_softmax_at

    model = og.Model(str(folder))
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(models.austen_text()).ids
    logprobs = []
    for i in range(WINDOWS):
        window = ids[i * WINDOW : (i + 1) * WINDOW]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=WINDOW + 8, do_sample=False)
        generator = og.Generator(model, params)
        for token, following in zip(window[:-1], window[1:], strict=True):
            generator.append_tokens(np.array([[token]], np.int32))
            # the runtime's own log-softmax, so both sides of a comparison do the same arithmetic
            logprobs.append(_log_softmax_at(generator.get_logits()[0, -1:], np.array([following]))[0])
    return float(np.exp(-np.mean(logprobs)))


def genai_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("model.onnx*"))


def bytes_per_parameter(bundle: Path, parameters: int) -> float:
    manifest = json.loads((bundle / "manifest.json").read_text())
    size = sum(entry["size"] for name, entry in manifest["files"].items() if name.startswith("model.onnx"))
    return size / parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="*", type=Path)
    parser.add_argument("--genai", type=Path, action="append", default=[], help="an onnxruntime-genai model folder")
    parser.add_argument("--onnx-cpu", action="store_true", help="run a GPU bundle's model.onnx on ORT CPU")
    parser.add_argument("--parameters", type=int, default=134_515_008, help="SmolLM2-135M's count (tied table once)")
    args = parser.parse_args()
    for bundle in args.bundles:
        ppl = perplexity(bundle, onnx_cpu=args.onnx_cpu)
        print(f"{bundle.name}: perplexity {ppl:.3f}, {bytes_per_parameter(bundle, args.parameters):.3f} bytes/param")
    for folder in args.genai:
        ppl, size = genai_perplexity(folder), genai_bytes(folder)
        print(f"{folder.name} (onnxruntime-genai): perplexity {ppl:.3f}, {size / args.parameters:.3f} bytes/param")


if __name__ == "__main__":
    main()
