"""Whether another ONNX Runtime attention kernel would read an `end` prompt faster than GroupQueryAttention inside
the compressed-cache op: one layer of SmolLM2's head layout (9 query heads, 3 KV heads, 64 channels), an 8K
prompt as 16 chunks of 512 over a growing int8 past (group scales of 32 channels), as the op's appending branch
sees them. Each form dequantizes the past the op's way (Cast + Mul), then:

- **GroupQueryAttention** (today's op): the past and the chunk's keys as past and new, causal by its own mask;
- **MultiHeadAttention**: the past and the chunk concatenated, expanded to the 9 query heads (the kernel takes no
  grouped keys), a causal additive bias [1, 1, T, past + T] built in the graph;
- **MultiHeadAttention, grouped rows**: no expansion — each KV head's 3 query heads as 3·T rows of one head
  (3 heads to split over the threads), the causal bias tiled to those rows.

Plus the kernels alone on prepared inputs (keys already expanded, bias given): what MultiHeadAttention's kernel
would save if the copies were free. Every form's output is checked against GroupQueryAttention's.

    python benchmarks/attention_kernels.py [--threads 2] [--rounds 3]

Milliseconds summed over the 16 chunks, the best of ``--rounds``; results: benchmarks/out/attention_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

HEADS, KV_HEADS, DIM, GROUP = 9, 3, 64, 32
CHUNK, CHUNKS = 512, 16
PER_KV = HEADS // KV_HEADS


def _info(name: str, dtype: int = TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, None)


def _const(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value), name)


def _dequantize() -> tuple[list, list]:
    """int8 past k/v [1,Hkv,P,D] and scales [1,Hkv,P,D/G,1] → float past ``pk``/``pv`` [1,Hkv,P,D], the op's way."""
    nodes, inits = [], [_const("groups", np.array([1, KV_HEADS, -1, DIM // GROUP, GROUP], np.int64))]
    inits.append(_const("rows4", np.array([1, KV_HEADS, -1, DIM], np.int64)))
    for x in ("k", "v"):
        nodes += [
            helper.make_node("Cast", [f"p{x}8"], [f"p{x}f"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", [f"p{x}f", "groups"], [f"p{x}g"]),
            helper.make_node("Mul", [f"p{x}g", f"{x}s"], [f"p{x}m"]),
            helper.make_node("Reshape", [f"p{x}m", "rows4"], [f"p{x}"]),
        ]
    return nodes, inits


def _causal_bias(rows_per_query: int) -> tuple[list, list]:
    """``bias`` [1,1,rows_per_query·T,P+T]: 0 where key j ≤ P + i (query i's position), -inf after."""
    nodes = [
        helper.make_node("Shape", ["pk"], ["past"], start=2, end=3),
        helper.make_node("Add", ["past", "chunk"], ["total"]),
        helper.make_node("Squeeze", ["total"], ["total0"]),
        helper.make_node("Range", ["zero", "total0", "one"], ["keys"]),
        helper.make_node("Range", ["zero", "chunk0", "one"], ["queries"]),
        helper.make_node("Add", ["queries", "past"], ["last_seen"]),
        helper.make_node("Unsqueeze", ["last_seen", "axis1"], ["last_seen_col"]),
        helper.make_node("Greater", ["keys", "last_seen_col"], ["future"]),
        helper.make_node("Where", ["future", "minus_inf", "zero_f"], ["bias_rows"]),
        helper.make_node("Tile", ["bias_rows", "tiles"], ["bias_tiled"]),
        helper.make_node("Unsqueeze", ["bias_tiled", "axes01"], ["bias"]),
    ]
    inits = [
        _const("chunk", np.array([CHUNK], np.int64)),
        _const("chunk0", np.array(CHUNK, np.int64)),
        _const("zero", np.array(0, np.int64)),
        _const("one", np.array(1, np.int64)),
        _const("axis1", np.array([1], np.int64)),
        _const("axes01", np.array([0, 1], np.int64)),
        _const("minus_inf", np.array(-np.inf, np.float32)),
        _const("zero_f", np.array(0, np.float32)),
        _const("tiles", np.array([rows_per_query, 1], np.int64)),
    ]
    return nodes, inits


def _new_kv_heads_first() -> tuple[list, list]:
    """The chunk's k/v [1,T,Hkv·D] → ``kb``/``vb`` [1,Hkv,T,D], then past + chunk as ``kc``/``vc``."""
    nodes = []
    for x in ("k", "v"):
        nodes += [
            helper.make_node("Reshape", [x, "bshd"], [f"{x}4"]),
            helper.make_node("Transpose", [f"{x}4"], [f"{x}b"], perm=[0, 2, 1, 3]),
            helper.make_node("Concat", [f"p{x}", f"{x}b"], [f"{x}c"], axis=2),
        ]
    return nodes, [_const("bshd", np.array([0, 0, KV_HEADS, DIM], np.int64))]


def models_by_form() -> dict[str, tuple[object, list[str]]]:
    """form → (model, the feeds it takes)."""
    int8_inputs = ["q", "k", "v", "pk8", "pv8", "ks", "vs"]
    dequantize, dequantize_inits = _dequantize()
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]

    def model(nodes, inits, inputs):
        int32 = TensorProto.INT32
        types = {"pk8": TensorProto.INT8, "pv8": TensorProto.INT8, "seqlens": int32, "total_length": int32}
        graph_inputs = [_info(name, types.get(name, TensorProto.FLOAT)) for name in inputs]
        graph = helper.make_graph(nodes, "attention", graph_inputs, [_info("out")], inits)
        return helper.make_model(graph, opset_imports=opsets), inputs

    gqa = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens", "total_length"],
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
    )
    gqa_inputs = [*int8_inputs, "seqlens", "total_length"]  # the past: int8 + scales, dequantized in the graph
    forms = {"GroupQueryAttention (the op's)": model([*dequantize, gqa], dequantize_inits, gqa_inputs)}

    concat, concat_inits = _new_kv_heads_first()
    bias, bias_inits = _causal_bias(1)
    expand = []
    for x in ("k", "v"):
        expand += [
            helper.make_node("Unsqueeze", [f"{x}c", "axis2"], [f"{x}u"]),
            helper.make_node("Expand", [f"{x}u", "per_kv"], [f"{x}e"]),
            helper.make_node("Reshape", [f"{x}e", "heads4"], [f"{x}h"]),
        ]
    expand_inits = [
        _const("axis2", np.array([2], np.int64)),
        _const("per_kv", np.array([1, 1, PER_KV, 1, 1], np.int64)),
        _const("heads4", np.array([1, HEADS, -1, DIM], np.int64)),
    ]
    mha = helper.make_node(
        "MultiHeadAttention", ["q", "kh", "vh", "", "", "bias"], ["out"], domain="com.microsoft", num_heads=HEADS
    )
    inits = dequantize_inits + concat_inits + bias_inits + expand_inits
    forms["MultiHeadAttention"] = model([*dequantize, *concat, *bias, *expand, mha], inits, list(int8_inputs))

    # grouped rows: q [1,T,H·D] → [1,G·T,Hkv·D] with rows (g, t); the output back the same way
    grouped_bias, grouped_bias_inits = _causal_bias(PER_KV)
    regroup = [
        helper.make_node("Reshape", ["q", "q5_shape"], ["q5"]),
        helper.make_node("Transpose", ["q5"], ["q5t"], perm=[0, 3, 1, 2, 4]),
        helper.make_node("Reshape", ["q5t", "grouped_shape"], ["qg"]),
        helper.make_node(
            "MultiHeadAttention", ["qg", "kc", "vc", "", "", "bias"], ["og"], domain="com.microsoft", num_heads=KV_HEADS
        ),
        helper.make_node("Reshape", ["og", "og5_shape"], ["og5"]),
        helper.make_node("Transpose", ["og5"], ["og5t"], perm=[0, 2, 3, 1, 4]),
        helper.make_node("Reshape", ["og5t", "out_shape"], ["out"]),
    ]
    regroup_inits = [
        _const("q5_shape", np.array([1, CHUNK, KV_HEADS, PER_KV, DIM], np.int64)),
        _const("grouped_shape", np.array([1, PER_KV * CHUNK, KV_HEADS * DIM], np.int64)),
        _const("og5_shape", np.array([1, PER_KV, CHUNK, KV_HEADS, DIM], np.int64)),
        _const("out_shape", np.array([1, CHUNK, HEADS * DIM], np.int64)),
    ]
    inits = dequantize_inits + concat_inits + grouped_bias_inits + regroup_inits
    nodes = [*dequantize, *concat, *grouped_bias, *regroup]
    forms["MultiHeadAttention, grouped rows"] = model(nodes, inits, list(int8_inputs))

    # the kernels alone on prepared inputs: the same nodes, fed what the forms above build
    forms["MultiHeadAttention kernel alone (keys expanded, bias given)"] = model([mha], [], ["q", "kh", "vh", "bias"])
    alone_inputs = ["q", "k", "v", "pk", "pv", "seqlens", "total_length"]
    forms["GroupQueryAttention kernel alone (past given)"] = model([gqa], [], alone_inputs)
    return forms


def chunk_feeds(past: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every input any form takes, for one chunk over ``past`` slots (float forms from the same int8 values)."""
    feeds = {
        "q": rng.standard_normal((1, CHUNK, HEADS * DIM), dtype=np.float32),
        "k": rng.standard_normal((1, CHUNK, KV_HEADS * DIM), dtype=np.float32),
        "v": rng.standard_normal((1, CHUNK, KV_HEADS * DIM), dtype=np.float32),
        "pk8": rng.integers(-127, 128, (1, KV_HEADS, past, DIM), dtype=np.int8),
        "pv8": rng.integers(-127, 128, (1, KV_HEADS, past, DIM), dtype=np.int8),
        "ks": (rng.random((1, KV_HEADS, past, DIM // GROUP, 1), dtype=np.float32) * 0.02),
        "vs": (rng.random((1, KV_HEADS, past, DIM // GROUP, 1), dtype=np.float32) * 0.02),
        "seqlens": np.array([past + CHUNK - 1], np.int32),
        "total_length": np.array(past + CHUNK, np.int32),
    }
    dequantized = {}
    for x in ("k", "v"):
        scaled = feeds[f"p{x}8"].astype(np.float32).reshape(1, KV_HEADS, past, DIM // GROUP, GROUP) * feeds[f"{x}s"]
        dequantized[x] = scaled.reshape(1, KV_HEADS, past, DIM)
        new = feeds[x].reshape(1, CHUNK, KV_HEADS, DIM).transpose(0, 2, 1, 3)
        every = np.concatenate([dequantized[x], new], axis=2)
        feeds[f"{x}h"] = np.ascontiguousarray(np.repeat(every, PER_KV, axis=1))
    feeds["pk"], feeds["pv"] = dequantized["k"], dequantized["v"]
    future = np.arange(past + CHUNK)[None, :] > (past + np.arange(CHUNK))[:, None]
    feeds["bias"] = np.where(future, -np.inf, 0).astype(np.float32)[None, None]
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    sessions = {
        form: (ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]), inputs)
        for form, (m, inputs) in models_by_form().items()
    }
    rng = np.random.default_rng(0)
    chunks = [chunk_feeds(past, rng) for past in range(CHUNK, CHUNK * CHUNKS, CHUNK)]  # the 15 appending chunks
    largest_error = {form: 0.0 for form in sessions}
    for feeds in chunks:  # correctness first, once: every form against GroupQueryAttention over the same inputs
        reference = None
        for form, (session, inputs) in sessions.items():
            out = session.run(["out"], {name: feeds[name] for name in inputs})[0].reshape(1, CHUNK, HEADS * DIM)
            reference = out if reference is None else reference
            largest_error[form] = max(largest_error[form], float(np.abs(out - reference).max()))
    best = {form: float("inf") for form in sessions}
    for _ in range(args.rounds):  # interleaved: each round runs every form over every chunk
        for form, (session, inputs) in sessions.items():
            total = 0.0
            for feeds in chunks:
                start = time.perf_counter()
                session.run(["out"], {name: feeds[name] for name in inputs})
                total += time.perf_counter() - start
            best[form] = min(best[form], total)
    baseline = best["GroupQueryAttention (the op's)"]
    print(
        f"| form, {len(chunks)} chunks of {CHUNK} (8K prompt), {args.threads} thread(s) | ms | vs the op's | max |Δ| |"
    )
    print("|---|---|---|---|")
    for form, seconds in best.items():
        print(f"| {form} | {seconds * 1e3:.0f} | {seconds / baseline:.2f}× | {largest_error[form]:.1e} |")
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, ONNX Runtime {ort.__version__}",
        "threads": args.threads,
        "ms": {form: seconds * 1e3 for form, seconds in best.items()},
        "max_error": largest_error,
    }
    models.OUT.mkdir(parents=True, exist_ok=True)  # a plain clone has no benchmarks/out yet
    (models.OUT / "attention_kernels.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
