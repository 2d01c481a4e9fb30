"""What the compressed-cache op itself costs over an `end` prompt: CompressedKVAttention alone (SmolLM2's head
layout; the cpu target's body), an int8 temporary state of ``--slots`` (default 8192: an 8K prompt), 16 chunks of
512 as the runtime feeds them (every chunk but the last unobserved), the state bound in place — ONNX Runtime's
profiler on: kernel milliseconds per op type, the GroupQueryAttention apart (the plain prefill pays it too).

    python benchmarks/end_prompt_op.py [--threads 1] [--against REV] [--rounds 3]

``--against REV``: the op's body as git revision REV wrote it (``edgec/kvcache/compressed_function.py`` there),
beside today's, rounds interleaved in one process; both must leave the same state (checked). ``--storage
int8,fp32``: today's body over a temporary state of each slot storage (what a prompt state kept in fp32 until
`end` selects its slots would save). ``--plain``: also GroupQueryAttention alone over an fp32 cache bound in place
(past and present one buffer, as the plain bundle runs it): what a plain prefill pays for the same chunks.
``--native``: the same over int8 slots with per-channel scales (benchmarks/gqa_native_ceiling.py). Results:
benchmarks/out/end_prompt_op.json. Kernel times come from the profiler (its per-node overhead included); the
wall times from runs without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_mixed_step  # noqa: E402
import measure  # noqa: E402
import models  # noqa: E402

from edgec.kvcache import compressed_function as cf  # noqa: E402
from edgec.kvcache.compression import Compression  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 512


def body_at(revision: str, compression: Compression):
    """The op's function as ``revision``'s compressed_function.py builds it."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:edgec/kvcache/compressed_function.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "compressed_function_then.py").write_text(source)
    spec = importlib.util.spec_from_file_location("compressed_function_then", folder / "compressed_function_then.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.make_function(compression, 23, module.Heads(9, 3, 64), fused_attention=True)


def prompt(chunks: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    feeds = []
    for index in range(chunks):
        feeds.append(
            {
                "q": rng.standard_normal((1, 9, CHUNK, 64), np.float32),
                "k": rng.standard_normal((1, 3, CHUNK, 64), np.float32),
                "v": rng.standard_normal((1, 3, CHUNK, 64), np.float32),
                "position_ids": np.arange(index * CHUNK, (index + 1) * CHUNK, dtype=np.int64)[None],
                "protect": np.zeros((1, CHUNK), bool),
                "observe": np.array([index == chunks - 1]),
            }
        )
    return feeds


def read_prompt(sess: ort.InferenceSession, empty: dict[str, np.ndarray], feeds) -> tuple[float, dict]:
    """One prompt into a fresh state, in place (as backend_ort binds it); seconds and the final state."""
    bound = {name: ort.OrtValue.ortvalue_from_numpy(value.copy()) for name, value in empty.items()}
    started = time.perf_counter()
    for chunk in feeds:
        binding = sess.io_binding()
        binding.bind_output("out")
        for name, value in chunk.items():
            binding.bind_cpu_input(name, value)
        for name, value in bound.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(f"{name}_out", value)
        sess.run_with_iobinding(binding)
    seconds = time.perf_counter() - started
    # copies: numpy() is a view of the OrtValue's memory, freed with ``bound`` when this returns
    return seconds, {name: np.array(value.numpy(), copy=True) for name, value in bound.items()}


def plain_model(slots: int, native: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """GroupQueryAttention alone, the plain bundle's way: past and present one [1,3,slots,64] buffer per k and v
    (bound in place), the new chunk written at its positions by the kernel; an empty cache of ``slots``.
    ``native``: the buffers int8 with per-channel scales (the kernel quantizes each chunk into them and reads them
    itself: benchmarks/gqa_native_ceiling.py's format), constant scales of 0.05."""
    f = TensorProto.FLOAT
    cache_type = TensorProto.INT8 if native else f
    heads = kv_mixed_step.HEADS
    inputs = [helper.make_tensor_value_info(n, f, [1, "T", w]) for n, w in (("q", 576), ("k", 192), ("v", 192))]
    inputs += [helper.make_tensor_value_info(n, cache_type, [1, 3, slots, 64]) for n in ("k_cache", "v_cache")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1])]
    inputs += [helper.make_tensor_value_info("total_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("out", f, [1, "T", 576])]
    shape = [1, 3, slots, 64]
    outputs += [helper.make_tensor_value_info(f"{n}_out", cache_type, shape) for n in ("k_cache", "v_cache")]
    names = ["q", "k", "v", "k_cache", "v_cache", "seqlens_k", "total_length"]
    quantized, scales = {}, []
    if native:
        names += [""] * 5 + ["channel_scale", "channel_scale"]
        quantized = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
        scales = [onnx.numpy_helper.from_array(np.full((3, 1, 64), 0.05, np.float32), "channel_scale")]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["out", "k_cache_out", "v_cache_out"],
        domain="com.microsoft",
        num_heads=heads.query,
        kv_num_heads=heads.kv,
        scale=0.125,
        **quantized,
    )
    model = helper.make_model(
        helper.make_graph([node], "plain", inputs, outputs, scales),
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)],
    )
    storage = np.int8 if native else np.float32
    empty = {name: np.zeros((1, 3, slots, 64), storage) for name in ("k_cache", "v_cache")}
    return model, empty


def plain_feeds(feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The op's chunks as GroupQueryAttention takes them: [B,T,heads·D], the total length so far."""
    plain = []
    for chunk in feeds:
        total = int(chunk["position_ids"][0, -1]) + 1
        plain.append(
            {name: np.ascontiguousarray(chunk[name].transpose(0, 2, 1, 3).reshape(1, CHUNK, -1)) for name in "qkv"}
            | {"seqlens_k": np.array([total - 1], np.int32), "total_length": np.array(total, np.int32)}
        )
    return plain


def open_session(model, threads: int, profile_prefix: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def kernel_ms(sess: ort.InferenceSession) -> dict[str, float]:
    """Kernel milliseconds per op type over the profiled run (an If's own time counts its branches: left out)."""
    events = json.loads(Path(sess.end_profiling()).read_text())
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            if op != "If":
                totals[op] += event["dur"] / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="a git revision: its op body beside today's")
    parser.add_argument("--storage", default="int8", help="comma-separated slot storages, each its own row")
    parser.add_argument("--plain", action="store_true", help="also GroupQueryAttention alone, in place (plain)")
    parser.add_argument(
        "--native", action="store_true", help="also GroupQueryAttention alone over int8 per-channel slots, in place"
    )
    args = parser.parse_args()
    storages = args.storage.split(",")
    if args.against and len(storages) > 1:
        parser.error("--against compares one storage")
    compression = Compression(capacity=args.slots, policy="snapkv", dtype=storages[0])
    feeds = prompt(args.slots // CHUNK)
    # name → (model, empty state, the chunks it reads)
    cases = {}
    for storage in storages:
        at = Compression(capacity=args.slots, policy="snapkv", dtype=storage)
        function = cf.make_function(at, 23, kv_mixed_step.HEADS, fused_attention=True)
        cases["today" if len(storages) == 1 else f"today {storage}"] = (*kv_mixed_step.op_model(at, function), feeds)
    if args.against:
        cases[args.against] = (*kv_mixed_step.op_model(compression, body_at(args.against, compression)), feeds)
    if args.plain:
        cases["plain GroupQueryAttention"] = (*plain_model(args.slots), plain_feeds(feeds))
    if args.native:
        cases["GroupQueryAttention, int8 per-channel slots"] = (*plain_model(args.slots, True), plain_feeds(feeds))
    models.OUT.mkdir(parents=True, exist_ok=True)
    results, states = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        runs = {}
        for name, (model, empty, chunks) in cases.items():
            runs[name] = (open_session(model, args.threads), empty, chunks)
            profiled = open_session(model, args.threads, str(Path(folder) / "profile"))
            read_prompt(profiled, empty, chunks)
            results[name] = {"kernel_ms": kernel_ms(profiled), "wall_seconds": []}
        for _ in range(args.rounds):
            for name, (sess, empty, chunks) in runs.items():
                seconds, states[name] = read_prompt(sess, empty, chunks)
                results[name]["wall_seconds"].append(seconds)
    if args.against:
        for tensor in states["today"]:
            if not np.array_equal(states["today"][tensor], states[args.against][tensor]):
                raise SystemExit(f"error: the two bodies leave different {tensor}")
    for name, result in results.items():
        kernels = result["kernel_ms"]
        attention = kernels.get("GroupQueryAttention", 0.0)
        rest = sum(kernels.values()) - attention
        result |= {
            "attention_ms": attention,
            "rest_ms": rest,
            "median_wall_seconds": statistics.median(result["wall_seconds"]),
        }
        top = ", ".join(f"{op} {ms:.1f}" for op, ms in list(kernels.items())[:8] if op != "GroupQueryAttention")
        print(
            f"{name}: wall {result['median_wall_seconds'] * 1e3:.0f} ms (median of {args.rounds}); kernels: "
            f"attention {attention:.0f} ms, the op's own work {rest:.1f} ms ({top} ms)"
        )
    (models.OUT / "end_prompt_op.json").write_text(
        json.dumps(
            {
                "date": date.today().isoformat(),
                "machine": f"{measure.machine()}, {args.threads} threads",
                "command": "python " + " ".join(sys.argv),
                "slots": args.slots,
                "storage": storages,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
