"""What the mixed-precision cache costs per call: the CompressedKVAttention op alone (SmolLM2's head layout, 9 query
heads, 3 KV heads, head dim 64), its state full, one-token decode steps and 512-token prompt chunks, int4 slots
(the cpu target's body: decode branch and fused prompt attention) against int4 under an int8 wide pool
(``--kv-mixed int8``: its own decode branch, no fused prompt attention), rounds interleaved in one process.

    python benchmarks/kv_mixed_step.py --slots 2048 --rounds 5

Prints the median time per call of each and their ratio; results: benchmarks/out/kv_mixed_step.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

from edgec.kvcache import compressed_function as cf  # noqa: E402
from edgec.kvcache import reference  # noqa: E402
from edgec.kvcache.compression import Compression  # noqa: E402

HEADS = cf.Heads(9, 3, 64)
TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}
TYPES |= {"uint8": TensorProto.UINT8, "int64": TensorProto.INT64}


def session(compression: Compression, threads: int) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """The op in a one-node model (cpu target: fused prompt attention) and a full state of its slots."""
    model, formal = op_model(compression)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    # fill every slot: one chunk per capacity's worth of positions through the op itself
    rng = np.random.default_rng(0)
    position = 0
    while position < compression.capacity:
        count = min(512, compression.capacity - position)
        formal = step(sess, formal, rng, position, count)
        position += count
    return sess, formal


def op_model(compression: Compression, function=None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The op alone in a model (SmolLM2's head layout; ``function``: its body, by default the cpu target's, fused
    prompt attention) and an empty state of its slots, by the op's input names."""
    state = reference.empty_compressed_state(HEADS.kv, compression.capacity, HEADS.dim, compression)
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [1, h, "T", HEADS.dim]) for n, h in (("q", 9), ("k", 3), ("v", 3))]
    inputs += [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "T"])]
    inputs += [helper.make_tensor_value_info("protect", TensorProto.BOOL, [1, "T"])]
    formal = {cf.FORMAL.get(name, name): array for name, array in state.items()}
    for name in cf.state_names(compression):
        inputs.append(helper.make_tensor_value_info(name, TYPES[formal[name].dtype.name], list(formal[name].shape)))
    inputs.append(helper.make_tensor_value_info("observe", TensorProto.BOOL, [1]))
    outputs = [helper.make_tensor_value_info("out", f, [1, "T", 9, HEADS.dim])]
    outputs += [helper.make_tensor_value_info(f"{n}_out", TYPES[formal[n].dtype.name], None) for n in formal]
    node = helper.make_node(
        cf.OP_TYPE, list(cf.inputs(compression)), list(cf.outputs(compression)), domain=cf.DOMAIN, scale=0.125
    )
    model = helper.make_model(
        helper.make_graph([node], "op", inputs, outputs),
        opset_imports=[
            helper.make_opsetid("", 23),
            helper.make_opsetid(cf.DOMAIN, 1),
            helper.make_opsetid("com.microsoft", 1),
        ],
        functions=[function or cf.make_function(compression, 23, HEADS, fused_attention=True)],
    )
    return model, formal


def step(sess, formal, rng, start, count):
    feeds = {
        "q": rng.standard_normal((1, 9, count, HEADS.dim), np.float32),
        "k": rng.standard_normal((1, 3, count, HEADS.dim), np.float32),
        "v": rng.standard_normal((1, 3, count, HEADS.dim), np.float32),
        "position_ids": np.arange(start, start + count, dtype=np.int64)[None],
        "protect": np.zeros((1, count), bool),
        "observe": np.ones(1, bool),
    }
    results = sess.run(None, feeds | formal)
    return dict(zip(formal, results[1:], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    caches = {
        "int4": Compression(capacity=args.slots, dtype="int4", policy="snapkv"),
        "int4 + int8 wide pool": Compression(capacity=args.slots, dtype="int4", policy="snapkv", mixed="int8"),
    }
    prepared = {name: session(c, args.threads) for name, c in caches.items()}
    times = {(name, kind): [] for name in caches for kind in ("decode", "chunk")}
    rng = np.random.default_rng(1)
    for _ in range(args.rounds):
        for name, (sess, formal) in prepared.items():
            position = 2 * args.slots
            started = time.perf_counter()
            for i in range(args.steps):
                formal = step(sess, formal, rng, position + i, 1)
            times[(name, "decode")].append((time.perf_counter() - started) / args.steps)
            started = time.perf_counter()
            step(sess, formal, rng, position + args.steps, min(512, args.slots))  # not kept: the same state each round
            times[(name, "chunk")].append(time.perf_counter() - started)
            prepared[name] = (sess, formal)
    medians = {key: statistics.median(values) for key, values in times.items()}
    for kind in ("decode", "chunk"):
        plain, mixed = medians[("int4", kind)], medians[("int4 + int8 wide pool", kind)]
        label = "one-token step" if kind == "decode" else "512-token chunk"
        print(f"{label}: int4 {plain * 1e3:.2f} ms, int4 + int8 wide pool {mixed * 1e3:.2f} ms ({mixed / plain:.2f}×)")
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {args.threads} threads",
        "command": "python " + " ".join(sys.argv),
        "slots": args.slots,
        "median_seconds": {f"{name} / {kind}": value for (name, kind), value in medians.items()},
    }
    models.OUT.mkdir(parents=True, exist_ok=True)
    (models.OUT / "kv_mixed_step.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
