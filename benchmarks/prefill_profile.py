"""Where a long prompt's time goes, by ONNX Runtime op type: the plain int4 bundle and the compressed one (1024 int8
slots, ``end``) of benchmarks/kv_speed.py, and with ``--genai`` onnxruntime-genai fp32 (kv_speed's peer), one after
the other in one process, ONNX Runtime's profiler on.

    python benchmarks/prefill_profile.py [--prompt 4000] [--threads 1] [--genai]

Prints each runtime's prefill seconds (with the profiler's own overhead), kernel seconds per op type (an ``If``
counts its branches' nodes too, which are also listed by type), how many GroupQueryAttention calls ran against
the number of layers × chunks (fewer: some chunk took the materialized fallback), the compressed / plain ratio,
and the same kernels grouped: attention (GroupQueryAttention), weight products (MatMulNBits; MatMul and Add
outside the cache op: edgec's Q4_1 offsets, genai's fp32 weights), and the rest (norms, the cache op's own
work). Results: benchmarks/out/prefill_profile.json. Not a speed claim (the profiler slows small nodes); a map of
where the compressed prefill's extra goes, and of whether genai's kernels do the same work faster.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_speed  # noqa: E402
import measure  # noqa: E402

BUNDLES = (kv_speed.PLAIN_INT4, kv_speed.COMPRESSED)


def profile(name: str, ids: list[int], threads: int, folder: Path) -> dict:
    import onnxruntime as ort

    from edgec.runtime import Model

    class Profiling(ort.SessionOptions):  # every session the runtime opens profiles itself
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(folder / name.replace(" ", "_").replace(",", ""))

    plain_options, ort.SessionOptions = ort.SessionOptions, Profiling
    try:
        model = Model.load(kv_speed.OUT / kv_speed.BUNDLES[name][0], threads=threads, spin=False)
    finally:
        ort.SessionOptions = plain_options
    started = time.perf_counter()
    with model._state() as state:
        model._prefill(state, np.asarray(ids, np.int64), all_logits=False)
    seconds = time.perf_counter() - started
    backend = model._backend
    session = (backend.prefill or backend.graph).session
    events = json.loads(Path(session.end_profiling()).read_text())
    chunks = len(model._chunks(len(ids)))
    return kernels(events, seconds, len(model.cache_spec.layers) * chunks)


def kernels(events: list[dict], seconds: float, attention_calls: int, within: dict | None = None) -> dict:
    """A profile's kernel seconds and calls per op type (only those inside the ``within`` event, if given)."""
    per_op, calls = collections.defaultdict(float), collections.Counter()
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if within is None or within["ts"] <= event["ts"] <= within["ts"] + within["dur"]:
            per_op[event["args"]["op_name"]] += event["dur"] / 1e6
            calls[event["args"]["op_name"]] += 1
    return {
        "prefill_seconds": seconds,
        "kernel_seconds": dict(sorted(per_op.items(), key=lambda item: -item[1])),
        "calls": dict(calls),
        "attention_calls_expected": attention_calls,
    }


def profile_genai(ids: list[int], threads: int, folder: Path) -> dict:
    """onnxruntime-genai fp32 reading the same prompt (one call: genai feeds a prompt whole), profiled through its
    config's session options on a copy of the config (the weights are linked, not copied)."""
    import onnxruntime_genai as og

    from edgec.bench import time_genai

    source, model_folder = kv_speed.OUT / kv_speed.GENAI[kv_speed.GENAI_FP32], folder / "genai-fp32"
    model_folder.mkdir()
    for path in source.iterdir():
        if path.name != "genai_config.json":
            (model_folder / path.name).symlink_to(path.resolve())
    config = json.loads((source / "genai_config.json").read_text())
    options = config["model"]["decoder"]["session_options"]
    options |= {"intra_op_num_threads": threads, "enable_profiling": str(folder / "genai")}
    (model_folder / "genai_config.json").write_text(json.dumps(config))
    model = og.Model(str(model_folder))
    seconds, _, _ = time_genai(og, model, ids, 1)
    del model  # the profile is written when the session closes
    events = json.loads(next(folder.glob("genai*.json")).read_text())
    prompt = next(e for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    layers = config["model"]["decoder"]["num_hidden_layers"]  # one attention call per layer: the prompt at once
    return kernels(events, seconds, layers, within=prompt)


def grouped(kernel_seconds: dict[str, float]) -> dict[str, float]:
    """Attention, weight products, the rest (an ``If`` is left out: its nodes are counted by their own types)."""
    products = ("MatMulNBits", "MatMul", "Add")
    groups = {"attention": 0.0, "weight products": 0.0, "rest": 0.0}
    for op, seconds in kernel_seconds.items():
        if op == "If":
            continue
        key = "attention" if op == "GroupQueryAttention" else "weight products" if op in products else "rest"
        groups[key] += seconds
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--genai", action="store_true", help="also profile onnxruntime-genai fp32")
    args = parser.parse_args()
    kv_speed.prepare([*BUNDLES])
    ids = kv_speed.prompt_ids(args.prompt)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in BUNDLES:
            results[name] = profile(name, ids, args.threads, Path(folder))
        if args.genai:
            results[kv_speed.GENAI_FP32] = profile_genai(ids, args.threads, Path(folder))
    for name, result in results.items():
        result["grouped_seconds"] = grouped(result["kernel_seconds"])
        gqa = result["calls"].get("GroupQueryAttention", 0)
        print(f"{name}: prefill {result['prefill_seconds']:.1f} s; GroupQueryAttention ran {gqa} of "
              f"{result['attention_calls_expected']} layer-chunks")  # fmt: skip
        for op, seconds in list(result["kernel_seconds"].items())[:15]:
            print(f"  {seconds:8.3f} s  {result['calls'][op]:6d}  {op}")
        groups = result["grouped_seconds"].items()
        print("  grouped: " + ", ".join(f"{group} {seconds:.2f} s" for group, seconds in groups))
    plain, compressed = (results[name]["prefill_seconds"] for name in BUNDLES)
    print(f"compressed / plain prefill: {compressed / plain:.3f}")
    record = {
        "date": date.today().isoformat(),
        "machine": f"{measure.machine()}, {args.threads} threads",
        "command": "python " + " ".join(sys.argv),
        "prompt_tokens": len(ids),
        "results": results,
    }
    kv_speed.OUT.mkdir(parents=True, exist_ok=True)
    (kv_speed.OUT / "prefill_profile.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
