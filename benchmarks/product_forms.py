"""What the forms of an int4 product cost in ONNX Runtime, on random weights of SmolLM2-135M's shapes.

    python benchmarks/product_forms.py [--threads 1] [--repeats 5] [--chunk-rounds 15] [--only-chunk]

Three tables (docs/BENCHMARKS.md, issue 21's sixth and thirtieth rounds):

- **Prompt rows** (one 576 → 3072 product, 512 / 1,024 / 2,048 rows, 20 copies in one graph): an fp32 MatMul
  (onnxruntime-genai fp32's form); MatMulNBits at accuracy level 1 (fp32 activations: the exact prompt products of
  edgec's ``prefill.onnx``); the same plus a Q4_1 GGUF's per-block minima as ``blocksum(x) @ offsets`` and an Add
  (what edgec carries exactly); the minima as MatMulNBits' float zero points (``-m/d``); MatMulNBits at accuracy
  level 4 (int8 activations, onnxruntime-genai int4's form; the exact import would need two rows of it per
  activation, ``passes/_weights._split_rows``). Each form's largest error
  against a float64 product of the same weights is printed beside its time.
- **A prompt chunk's products** (each product shape of a SmolLM2 layer — qkv, o, gate-up, down — at the cpu
  target's chunk rows, ``targets/cpu.toml``'s ``prefill_chunk``; 10 products of distinct weights in one graph, as a
  model streams its layers'): an fp32 MatMul against MatMulNBits at accuracy level 1 with and without the Q4_1
  minima (``blocksum(x) @ offsets`` and an Add, as the exact import computes them) — what an edgec prompt chunk pays
  for its exact 4-bit products where onnxruntime-genai fp32 runs fp32 MatMuls. Printed first (``--only-chunk``: alone).
- **Decode rows** (every product of one SmolLM2 step, 30 layers' qkv / o / gate-up / down with distinct weights
  and the 8-bit tied lm_head, at accuracy level 4, 4-bit codes without zero points as the exact import carries
  them): one row of activations against two (the split activations of the exact int4 import, stacked as the batch,
  which ONNX Runtime runs on its general path instead of its one-row kernel).

Milliseconds per product (prompt) or per step's products (decode): the best of ``--repeats`` timed runs; the chunk
table's forms alternate over ``--chunk-rounds`` rounds and give the median.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

BLOCK = 32
PROMPT_K, PROMPT_N = 576, 3072
LAYER_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate-up": (576, 3072), "down": (1536, 576)}  # (K, N)
DECODE_SHAPES = list(LAYER_SHAPES.values()) * 30
LM_HEAD = (576, 49152)
LEVEL_4 = "MatMulNBits level 4"  # int8 activations: genai int4's prompt form, not exact (issue 16)


def _session(nodes, inputs, outputs, initializers, threads: int, spin: bool = True):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "forms", inputs, outputs, initializers)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # unused initializers of the other forms are not news
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _best_ms(session, feeds: dict, repeats: int, per: int) -> float:
    for _ in range(2):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return 1000 * min(times) / per


def _nbits(name: str, x: str, k: int, n: int, level: int, inputs: list[str], bits: int = 4):
    from onnx import helper

    attributes = {"K": k, "N": n, "bits": bits, "block_size": BLOCK, "accuracy_level": level}
    return helper.make_node("MatMulNBits", [x, *inputs], [name], domain="com.microsoft", **attributes)


def _q4_1_weight(rng: np.random.Generator, k: int, n: int) -> dict[str, np.ndarray]:
    """A random Q4_1-like weight [K, N]: 4-bit codes, per-block steps and minima, and its float64 value."""
    blocks = k // BLOCK
    codes = rng.integers(0, 16, (n, blocks, BLOCK)).astype(np.uint8)
    steps = (rng.random((n, blocks)) * 0.01 + 0.001).astype(np.float32)
    minima = (-rng.random((n, blocks)) * 0.08).astype(np.float32)
    weight = (steps[..., None] * codes + minima[..., None]).reshape(n, k).T.astype(np.float64)
    return {
        "packed": (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
        "steps": steps.reshape(-1),
        "offsets": np.ascontiguousarray(minima.T),  # [K / 32, N]
        "float_zero": (-minima / steps).astype(np.float32).reshape(-1),  # (q - zero) * step = q * step + minimum
        "weight": weight,
    }


CHUNK_FORMS = ("fp32 MatMul", "MatMulNBits level 1", "+ Q4_1 minima as offsets", "Q4_1 minima as float zero points")


def prompt_rows(rows: int, threads: int, repeats: int, copies: int = 20) -> dict[str, tuple[float, float]]:
    """form → (ms per product, max |error| against float64) for one Q4_1-like weight."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    k, n, blocks = PROMPT_K, PROMPT_N, PROMPT_K // BLOCK
    stored = _q4_1_weight(rng, k, n)
    weight = stored.pop("weight")  # [K, N] float64
    indicator = np.zeros((k, blocks), np.float32)
    indicator[np.arange(k), np.arange(k) // BLOCK] = 1
    tensors = stored | {
        "no_zero": np.zeros((n, (blocks + 1) // 2), np.uint8),
        "indicator": indicator,
        "weight": weight.astype(np.float32),
    }
    x = rng.standard_normal((1, rows, k)).astype(np.float32)
    reference = x[0].astype(np.float64) @ weight
    results = {}
    forms = ("fp32 MatMul", "MatMulNBits level 1", "+ Q4_1 minima as offsets", "Q4_1 minima as float zero points")
    for form in (*forms, LEVEL_4):
        nodes = []
        for copy in range(copies):
            out = f"y{copy}"
            if form == "fp32 MatMul":
                nodes.append(helper.make_node("MatMul", ["x", "weight"], [out]))
            elif form == "Q4_1 minima as float zero points":
                nodes.append(_nbits(out, "x", k, n, 1, ["packed", "steps", "float_zero"]))
            elif form in ("MatMulNBits level 1", LEVEL_4):
                level = 4 if form == LEVEL_4 else 1
                nodes.append(_nbits(out, "x", k, n, level, ["packed", "steps", "no_zero"]))
            else:
                nodes.append(_nbits(f"p{copy}", "x", k, n, 1, ["packed", "steps", "no_zero"]))
                nodes.append(helper.make_node("MatMul", ["x", "indicator"], [f"s{copy}"]))
                nodes.append(helper.make_node("MatMul", [f"s{copy}", "offsets"], [f"o{copy}"]))
                nodes.append(helper.make_node("Add", [f"p{copy}", f"o{copy}"], [out]))
        session = _session(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, k])],
            [helper.make_tensor_value_info(f"y{copy}", TensorProto.FLOAT, None) for copy in range(copies)],
            [numpy_helper.from_array(value, name) for name, value in tensors.items()],
            threads,
        )
        exact = form not in ("MatMulNBits level 1", LEVEL_4)  # these leave the minima out on purpose (cost alone)
        error = float(np.abs(session.run(["y0"], {"x": x})[0][0] - reference).max()) if exact else float("nan")
        results[form] = (_best_ms(session, {"x": x}, repeats, copies), error)
    return results


def decode_graph(rows: int) -> tuple[list, list, list, list]:
    """(nodes, inputs, outputs, initializers): every product of one SmolLM2 decode step at ``rows`` rows of
    activations, accuracy level 4, in the exact import's form — 4-bit codes without zero points (a Q4_0 / Q4_1
    block's codes at the default zero point; Q4_1's minima are a product of their own, ``blocksum(x) @ offsets``,
    left out here) and the Q8_0 lm_head's 8-bit codes. Zero points would time another kernel: with them ONNX Runtime
    runs one row on its general path (the 31st round's 4.89 ms) instead of its faster one-row kernel (4.41 ms)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for index, (k, n) in enumerate([*DECODE_SHAPES, LM_HEAD]):
        bits = 8 if (k, n) == LM_HEAD else 4
        blocks = k // BLOCK
        names = [f"codes{index}", f"steps{index}"]
        initializers += [
            numpy_helper.from_array(rng.integers(0, 256, (n, blocks, BLOCK * bits // 8), dtype=np.uint8), names[0]),
            numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), names[1]),
        ]
        outputs.append(f"y{index}")
        nodes.append(_nbits(outputs[-1], f"x{k}", k, n, 4, names, bits))
    widths = sorted({k for k, _ in DECODE_SHAPES})
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [rows, 1, k]) for k in widths]
    return (
        nodes,
        inputs,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        initializers,
    )


def decode_rows(rows: int, threads: int, repeats: int) -> float:
    """ms for every product of one SmolLM2 decode step at ``rows`` rows of activations (``decode_graph``); two rows
    are the exact import's split, stacked as the batch as the bundle stacks them."""
    nodes, inputs, outputs, initializers = decode_graph(rows)
    session = _session(nodes, inputs, outputs, initializers, threads)
    rng = np.random.default_rng(1)
    widths = {value.name: value.type.tensor_type.shape.dim[-1].dim_value for value in inputs}
    feeds = {name: rng.standard_normal((rows, 1, width)).astype(np.float32) for name, width in widths.items()}
    return _best_ms(session, feeds, repeats, 1)


def chunk_rows() -> int:
    """The cpu target's prompt chunk (rows per prompt step)."""
    import tomllib  # (benchmarks/targets.py shadows the project's targets package here)

    target = Path(__file__).resolve().parent.parent / "targets" / "cpu.toml"
    return int(tomllib.loads(target.read_text())["defaults"]["prefill_chunk"])


def chunk_products(
    threads: int, repeats: int, rows: int | None = None, copies: int = 10
) -> dict[str, dict[str, tuple[float, float]]]:
    """layer product → form → (ms per product, max |error| against float64) at a prompt chunk's rows: ``copies``
    products of distinct weights in one graph (a model streams every layer's weights; one weight reused would stay
    in cache), the forms alternating over ``repeats`` rounds, the median round."""
    from onnx import TensorProto, helper, numpy_helper

    rows = rows or chunk_rows()
    rng = np.random.default_rng(0)
    table = {}
    for name, (k, n) in LAYER_SHAPES.items():
        weights = [_q4_1_weight(rng, k, n) for _ in range(copies)]
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        constants = {
            "block_rows": np.array([1, rows, k // BLOCK, BLOCK], np.int64),
            "last": np.array([-1], np.int64),
            # zero points 0: the codes are offsets from each block's minimum (MatMulNBits' default would be 8)
            "no_zero": np.zeros((n, (k // BLOCK + 1) // 2), np.uint8),
        }
        sessions = {}
        for form in CHUNK_FORMS:
            nodes, tensors = [], dict(constants)
            for copy, weight in enumerate(weights):
                out = f"y{copy}"
                if form == "fp32 MatMul":
                    tensors[f"w{copy}"] = weight["weight"].astype(np.float32)
                    nodes.append(helper.make_node("MatMul", ["x", f"w{copy}"], [out]))
                    continue
                tensors[f"codes{copy}"] = weight["packed"]
                tensors[f"steps{copy}"] = weight["steps"]
                if form == "Q4_1 minima as float zero points":
                    tensors[f"zero{copy}"] = weight["float_zero"]
                    nodes.append(_nbits(out, "x", k, n, 1, [f"codes{copy}", f"steps{copy}", f"zero{copy}"]))
                    continue
                product = out if form == "MatMulNBits level 1" else f"p{copy}"
                nodes.append(_nbits(product, "x", k, n, 1, [f"codes{copy}", f"steps{copy}", "no_zero"]))
                if form == "+ Q4_1 minima as offsets":  # the exact import's form: blocksum(x) @ offsets, added
                    tensors[f"offsets{copy}"] = weight["offsets"]
                    # each product sums its own input's blocks, as each of a layer's products has its own input
                    nodes.append(helper.make_node("Reshape", ["x", "block_rows"], [f"x_blocks{copy}"]))
                    nodes.append(
                        helper.make_node("ReduceSum", [f"x_blocks{copy}", "last"], [f"sums{copy}"], keepdims=0)
                    )
                    nodes.append(helper.make_node("MatMul", [f"sums{copy}", f"offsets{copy}"], [f"o{copy}"]))
                    nodes.append(helper.make_node("Add", [product, f"o{copy}"], [out]))
            sessions[form] = _session(
                nodes,
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, k])],
                [helper.make_tensor_value_info(f"y{copy}", TensorProto.FLOAT, None) for copy in range(copies)],
                [numpy_helper.from_array(value, key) for key, value in tensors.items()],
                threads,
                spin=False,  # the forms' sessions alternate: one's spinning pool would take the cores from the next
            )
        reference = x[0].astype(np.float64) @ weights[0]["weight"]
        errors = {
            form: float(np.abs(session.run(["y0"], {"x": x})[0][0] - reference).max())
            if form != "MatMulNBits level 1"  # leaves the minima out on purpose (cost alone)
            else float("nan")
            for form, session in sessions.items()
        }
        times: dict[str, list[float]] = {form: [] for form in CHUNK_FORMS}
        for _ in range(repeats):
            for form, session in sessions.items():
                session.run(None, {"x": x})  # its buffers and threads awake again after the other forms' runs
                start = time.perf_counter()
                session.run(None, {"x": x})
                times[form].append(1000 * (time.perf_counter() - start) / copies)
        table[name] = {form: (float(np.median(times[form])), errors[form]) for form in CHUNK_FORMS}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-rounds", type=int, default=15, help="alternating rounds of the chunk table")
    parser.add_argument("--only-chunk", action="store_true", help="the prompt chunk's table alone")
    args = parser.parse_args()
    rows = chunk_rows()
    print(f"a prompt chunk's products ({rows} rows, {args.threads} thread(s)): ms per product, median of rounds")
    for name, forms in chunk_products(args.threads, args.chunk_rounds, rows).items():
        fp32, level_1 = forms["fp32 MatMul"][0], forms["MatMulNBits level 1"][0]
        minima, error = forms["+ Q4_1 minima as offsets"]
        zero, zero_error = forms["Q4_1 minima as float zero points"]
        print(
            f"  {name:8s} {LAYER_SHAPES[name][0]} → {LAYER_SHAPES[name][1]}: fp32 {fp32:.3f}, level 1 {level_1:.3f} "
            f"({level_1 / fp32:.3f}×), + minima {minima:.3f} ({minima / fp32:.3f}×; max |error| {error:.1e}), "
            f"float zero points {zero:.3f} ({zero / fp32:.3f}×; {zero_error:.1e})"
        )
    if args.only_chunk:
        return
    print(f"prompt rows, one {PROMPT_K} → {PROMPT_N} product, {args.threads} thread(s): ms per product (max |error|)")
    for rows in (512, 1024, 2048):
        cells = [
            f"{form} {ms:.2f} ({error:.1e})"
            for form, (ms, error) in prompt_rows(rows, args.threads, args.repeats).items()
        ]
        print(f"  {rows:5d} rows: " + "; ".join(cells))
    print(f"decode rows, one step's {len(DECODE_SHAPES) + 1} products, {args.threads} thread(s):")
    for rows in (1, 2):
        print(f"  {rows} row{'s' if rows > 1 else ''}: {decode_rows(rows, args.threads, args.repeats):.2f} ms")


if __name__ == "__main__":
    main()
