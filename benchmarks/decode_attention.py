"""One layer's one-token attention over a compressed cache's fp32 slots: ONNX Runtime's GroupQueryAttention (what
the `cpu` target's decode graph runs, ``decode_kernel`` gqa) against the same attention as MatMuls. One run:

    python benchmarks/decode_attention.py [--threads 1,2] [--capacity 1024] [--rounds 3]

Both forms read C + 1 rows of k and v in place (IO binding; one buffer pair per layer, ``--buffers`` of them visited
in turn so that they leave the caches as a model's layers do) and return the output and the query's probabilities:
the kernel in its static-cache mode (``seqlens_k`` = C, the attention bias, ``qk_output``), the MatMuls as
``q [B,Hkv,G,D] · Kᵀ`` (ONNX Runtime fuses the transpose into the product; the query heads of one KV head are the
rows of one product), scale, bias, Softmax, ``· V`` one query head per product ([B,Hkv,G,1,C+1] · [B,Hkv,1,C+1,D]:
a one-row product streams V, a G-row one packs it first). Before timing, the two are checked to give the same output.
Not measured here: what the MatMul form would add in a graph (the token's k/v written into the spare row, RoPE,
which the kernel does itself). Results: benchmarks/out/decode_attention.json; the printed table goes into
docs/BENCHMARKS.md. Default head layout: SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, 30 layers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import models  # noqa: E402

FORMS = ("GroupQueryAttention", "MatMul")


def _graph(form: str, heads: int, kv_heads: int, dim: int, rows: int):
    from onnx import TensorProto, helper

    group = heads // kv_heads
    f32 = TensorProto.FLOAT
    cache = [helper.make_tensor_value_info(name, f32, [1, kv_heads, rows, dim]) for name in ("past_k", "past_v")]
    bias = helper.make_tensor_value_info("bias", f32, [1, 1, 1, rows])
    outputs = [helper.make_tensor_value_info(name, f32, None) for name in ("out", "probs")]
    scale = 1.0 / np.sqrt(dim)
    if form == "GroupQueryAttention":
        node = helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_k", "past_v", "seqlens", "total", "", "", "", "bias"],
            ["out", "present_k", "present_v", "probs"],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            qk_output=2,
            scale=float(scale),
        )
        inputs = [
            helper.make_tensor_value_info("q", f32, [1, 1, heads * dim]),
            helper.make_tensor_value_info("k", f32, [1, 1, kv_heads * dim]),
            helper.make_tensor_value_info("v", f32, [1, 1, kv_heads * dim]),
            *cache,
            helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
            bias,
        ]
        outputs += [helper.make_tensor_value_info(name, f32, None) for name in ("present_k", "present_v")]
        graph = helper.make_graph([node], "kernel", inputs, outputs)
    else:
        nodes = [
            helper.make_node("Reshape", ["q", "grouped"], ["q_grouped"]),  # [B,Hkv,G,D]
            helper.make_node("Transpose", ["past_k"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q_grouped", "k_t"], ["scores"]),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
            helper.make_node("Add", ["scaled", "bias"], ["biased"]),
            helper.make_node("Softmax", ["biased"], ["probs_grouped"], axis=-1),
            # one query head per product, as prefill_graph.decode_kernels_as_matmuls writes it: [B,Hkv,G,1,D]
            helper.make_node("Reshape", ["probs_grouped", "rows"], ["probs_rows"]),
            helper.make_node("Unsqueeze", ["past_v", "axis2"], ["v_rows"]),
            helper.make_node("MatMul", ["probs_rows", "v_rows"], ["context"]),
            helper.make_node("Reshape", ["context", "flat"], ["out"]),
            helper.make_node("Reshape", ["probs_grouped", "per_head"], ["probs"]),
        ]
        constants = [
            helper.make_tensor("grouped", TensorProto.INT64, [4], [1, kv_heads, group, dim]),
            helper.make_tensor("flat", TensorProto.INT64, [3], [1, 1, heads * dim]),
            helper.make_tensor("per_head", TensorProto.INT64, [4], [1, heads, 1, rows]),
            helper.make_tensor("scale", f32, [], [float(scale)]),
            helper.make_tensor("rows", TensorProto.INT64, [5], [1, kv_heads, group, 1, rows]),
            helper.make_tensor("axis2", TensorProto.INT64, [1], [2]),
        ]
        inputs = [helper.make_tensor_value_info("q", f32, [1, 1, heads * dim]), *cache, bias]
        graph = helper.make_graph(nodes, "matmuls", inputs, outputs, initializer=constants)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


class _Form:
    """One form's session and one IO binding per buffer pair."""

    def __init__(self, form: str, threads: int, caches: list, feeds: dict, layout: tuple[int, int, int, int]):
        import onnxruntime as ort

        heads, kv_heads, dim, rows = layout
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        model = _graph(form, heads, kv_heads, dim, rows).SerializeToString()
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        names = {value.name for value in self.session.get_inputs()}
        self.bindings = []
        for past_k, past_v in caches:
            binding = self.session.io_binding()
            for name, array in feeds.items():
                if name in names:
                    binding.bind_cpu_input(name, array)
            k_value, v_value = (ort.OrtValue.ortvalue_from_numpy(array) for array in (past_k, past_v))
            binding.bind_ortvalue_input("past_k", k_value)
            binding.bind_ortvalue_input("past_v", v_value)
            binding.bind_output("out")
            binding.bind_output("probs")
            if form == "GroupQueryAttention":  # static-cache mode: the present is the past's own buffer
                binding.bind_ortvalue_output("present_k", k_value)
                binding.bind_ortvalue_output("present_v", v_value)
            self.bindings.append(binding)

    def run_all(self) -> None:
        for binding in self.bindings:
            self.session.run_with_iobinding(binding)

    def first_outputs(self) -> list[np.ndarray]:
        self.session.run_with_iobinding(self.bindings[0])
        return [value.numpy() for value in self.bindings[0].get_outputs()[:2]]  # out, probs


def compare(
    threads: list[int],
    capacity: int = 1024,
    heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    buffers: int = 30,
    passes: int = 20,
    rounds: int = 3,
) -> dict:
    """Microseconds per call of each form, round by round, per thread count (the forms alternate in a round)."""
    rows = capacity + 1
    rng = np.random.default_rng(0)
    caches = [
        tuple(rng.standard_normal((1, kv_heads, rows, dim), dtype=np.float32) for _ in ("k", "v"))
        for _ in range(buffers)
    ]
    for past_k, past_v in caches:  # the spare row holds the token, as the kernel writes it: the same for both
        past_k[:, :, capacity] = 0.0
        past_v[:, :, capacity] = 0.0
    bias = np.zeros((1, 1, 1, rows), np.float32)
    bias[..., : capacity // 8] = -np.inf  # some slots empty, hidden by the bias as in a filling cache
    feeds = {
        "q": rng.standard_normal((1, 1, heads * dim), dtype=np.float32),
        "k": np.zeros((1, 1, kv_heads * dim), np.float32),
        "v": np.zeros((1, 1, kv_heads * dim), np.float32),
        "seqlens": np.array([capacity], np.int32),
        "total": np.array(rows, np.int32),
        "bias": bias,
    }
    results: dict = {"layout": {"heads": heads, "kv_heads": kv_heads, "dim": dim, "capacity": capacity}, "rows": {}}
    for count in threads:
        forms = {form: _Form(form, count, caches, feeds, (heads, kv_heads, dim, rows)) for form in FORMS}
        kernel, matmuls = (forms[form].first_outputs() for form in FORMS)
        for got, want in zip(matmuls, kernel, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        timings: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(rounds):
            for form, runner in forms.items():
                runner.run_all()  # warm
                start = time.perf_counter()
                for _ in range(passes):
                    runner.run_all()
                timings[form].append((time.perf_counter() - start) / passes / buffers * 1e6)
        ratios = [m / k for m, k in zip(timings["MatMul"], timings["GroupQueryAttention"], strict=True)]
        results["rows"][str(count)] = {
            "us_per_call": {form: [round(value, 1) for value in values] for form, values in timings.items()},
            "matmul_vs_kernel": [round(ratio, 3) for ratio in ratios],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = compare([int(t) for t in args.threads.split(",")], capacity=args.capacity, rounds=args.rounds)
    results |= {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": measure.machine(),
    }
    (models.OUT / "decode_attention.json").write_text(json.dumps(results, indent=2))
    print(
        "| threads | GroupQueryAttention µs/call (rounds) | MatMuls µs/call (rounds) | MatMuls / kernel (geo. mean) |"
    )
    print("|---|---|---|---|")
    for count, row in results["rows"].items():
        calls = row["us_per_call"]
        mean = float(np.exp(np.mean(np.log(row["matmul_vs_kernel"]))))
        print(
            f"| {count} | {', '.join(f'{v:.0f}' for v in calls['GroupQueryAttention'])} | "
            f"{', '.join(f'{v:.0f}' for v in calls['MatMul'])} | {mean:.2f}× |"
        )


if __name__ == "__main__":
    main()
