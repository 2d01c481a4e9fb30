"""What decode would gain from a cache format ONNX Runtime's GroupQueryAttention reads natively — a measured prototype.

    python benchmarks/gqa_native_ceiling.py [--prompt 8000] [--threads 1,2] [--rounds 3]

Today's compressed cache keeps per-slot group scales (each slot's k and v rows carry D/group scales), which no
stock ONNX Runtime kernel reads, so the op reads its int8 slots through ~110 small nodes per layer. ONNX Runtime's
CPU GroupQueryAttention reads int8 caches itself when the scales are **per channel** (`k_quant_type` /
`v_quant_type` PER_CHANNEL, 8 bits: one scale per KV head and channel for every slot), quantizes the new token into
its present, and returns the new query's probabilities (`qk_output` 2) — what the eviction scores need.

The prototype (``native_graph``) is edgec's plain int4 decode graph with every layer's GroupQueryAttention reading
C int8 slots that way (the token lands in row C of its present), followed by the decode half of snapkv as an
eviction tail: the slots' scores decayed plus the token's probabilities summed over each KV head's query heads,
sinks and the recent window forced to stay, ArgMin, and the token's k and v rows, position and score written into
the weakest slot by ScatterElements bound in place. It is **not a bundle**: no prompt path, no empty slots, no
sliding window, no protected tokens, constant scales (how a real format would choose them is the open question:
docs/kv-cache.md). tests/test_gqa_native_ceiling.py holds its attention to the plain bundle's over the same
dequantized slots and its writes to the slot the scores pick.

A second prototype (``storage="fp32"``) keeps the slots float32 and lets the kernel read them **in place**: the
buffer one row longer than the slots, GroupQueryAttention's static-cache mode writing the token into that spare row
(past and present one buffer, as the plain bundle binds them), the eviction tail moving it into the weakest slot.
No scales, nothing less exact than the plain cache — the question is only what reading 4× the bytes costs.

Per thread count, round by round in one process: onnxruntime-genai int4 and edgec's compressed bundle decoding after
the prompt (kv_speed.py's runners, the issue's pair), then three decode graphs stepped alone with IO binding on
full random slots: the compressed bundle's own graph (``today's op``: the runner's step without the runtime's
Python), the two prototypes, and the plain int4 graph at position 64 (the floor). A prototype's projected ratio
is ``genai step / (prototype step + the runner's overhead over today's graph)``.

Results: benchmarks/out/gqa_native_ceiling.json and .png (``--plot-only`` redraws it from the json); the printed
table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import snapkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_ceiling  # noqa: E402
import kv_speed  # noqa: E402
import measure  # noqa: E402

CAPACITY = 1024
SINK, WINDOW, DECAY = Compression.sink, Compression.window, snapkv.DECAY  # the compressed bundle's defaults
FLOOR_POSITION = 64
RESULTS = kv_speed.OUT / "gqa_native_ceiling.json"


def native_graph(
    plain_model: Path,
    capacity: int,
    sink: int = SINK,
    window: int = WINDOW,
    decay: float = DECAY,
    storage: str = "int8",
):
    """The plain decode graph (``model.onnx`` of a plain bundle whose layers run GroupQueryAttention) rewritten as
    described above. Per layer it reads ``cache.L.k``/``.v`` int8 [1, Hkv, capacity, D], ``pos.L`` int64 and
    ``score.L`` float [1, Hkv, capacity], and writes ``new_`` of each; the scales are the inputs ``scale.L.k``/``.v``
    float [Hkv, 1, D]. Every slot is taken to be filled; the new token is at ``position_ids``.

    ``storage="fp32"``: the slots stay float32 and the kernel reads them **in place** — ``cache.L.k``/``.v`` are
    [1, Hkv, capacity + 1, D], the last row a spare: GroupQueryAttention in its static-cache mode (past and present
    one buffer, ``seqlens_k`` = capacity) writes the token into the spare row and attends over every row; its
    present is the graph output ``shared_cache.L.k`` and the eviction's ScatterElements (the spare row into the
    weakest slot) ``new_cache.L.k``, both bound to the input's buffer (``bind_step``). No scales."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if storage not in ("int8", "fp32"):
        raise ValueError(f"storage {storage!r}: int8 or fp32")
    shared_buffer = storage == "fp32"
    model = onnx.load(plain_model)
    graph = model.graph

    def constant(name: str, value) -> str:
        graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    shared = {
        "decay": constant("native.decay", np.float32(decay)),
        "inf": constant("native.inf", np.float32(np.inf)),
        "zero": constant("native.zero", np.float32(0.0)),
        "pad_last": constant("native.pad_last", np.array([0, 0, 0, 0, 0, 1], np.int64)),
        "axis2": constant("native.axis2", np.array([2], np.int64)),
        "last": constant("native.last", np.array([-1], np.int64)),
        "start": constant("native.start", np.array([0], np.int64)),
        "capacity": constant("native.capacity", np.array([capacity], np.int64)),
        "past_end": constant("native.past_end", np.array([capacity + 1], np.int64)),
        "seqlens": constant("native.seqlens", np.array([capacity], np.int32)),
        "total": constant("native.total", np.int32(capacity + 1)),
        "sink": constant("native.sink", np.int64(sink)),
        "window": constant("native.window", np.int64(window)),
    }
    inputs = {value.name: value for value in graph.input}
    layers = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    if not layers:
        raise ValueError(f"{plain_model}: no GroupQueryAttention (not a plain bundle for ONNX Runtime)")
    kv_heads = inputs[layers[0].input[3]].type.tensor_type.shape.dim[1].dim_value
    head_dim = inputs[layers[0].input[3]].type.tensor_type.shape.dim[3].dim_value
    query_heads = next(a.i for a in layers[0].attribute if a.name == "num_heads")
    groups = constant("native.groups", np.array([1, kv_heads, query_heads // kv_heads, capacity + 1], np.int64))
    rows = constant("native.rows", np.array([1, 1, 1, head_dim], np.int64))
    heads = constant("native.heads", np.array([1, kv_heads, 1], np.int64))
    nodes = [
        helper.make_node("Sub", ["position_ids", shared["window"]], ["native.lowest"]),
        helper.make_node("Expand", ["position_ids", heads], ["native.new_pos"]),
    ]
    kept = [output for output in graph.output if not output.name.startswith("new_cache.")]
    del graph.output[:]  # the logits stay; every state output is added again below
    graph.output.extend(kept)
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "GroupQueryAttention":
            continue
        past_k, past_v = node.input[3], node.input[4]
        layer = past_k.split(".")[1]
        cache_type = TensorProto.FLOAT if shared_buffer else TensorProto.INT8
        for name in (past_k, past_v):
            tensor_type = inputs[name].type.tensor_type
            tensor_type.elem_type = cache_type
            tensor_type.shape.dim[2].dim_value = capacity + 1 if shared_buffer else capacity
        scales = [] if shared_buffer else [f"scale.{layer}.k", f"scale.{layer}.v"]
        pos, score = f"pos.{layer}", f"score.{layer}"
        graph.input.extend(
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, [kv_heads, 1, head_dim]) for name in scales]
            + [
                helper.make_tensor_value_info(pos, TensorProto.INT64, [1, kv_heads, capacity]),
                helper.make_tensor_value_info(score, TensorProto.FLOAT, [1, kv_heads, capacity]),
            ]
        )
        # the slots, then the token at row `capacity` of the present (positions come from position_ids)
        node.input[5], node.input[6] = shared["seqlens"], shared["total"]
        while len(node.input) < (10 if shared_buffer else 12):
            node.input.append("")
        node.input.extend(scales)
        if not shared_buffer:
            node.attribute.extend(
                [
                    helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                    helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                    helper.make_attribute("kv_cache_bit_width", 8),
                ]
            )
        node.attribute.append(helper.make_attribute("qk_output", 2))
        p = f"native.{layer}."
        if shared_buffer:  # graph outputs, so that they can be bound to the past's buffer
            present_k, present_v = f"shared_{past_k}", f"shared_{past_v}"
        else:
            present_k, present_v = p + "present_k", p + "present_v"
        probs = p + "probs"
        node.output[1], node.output[2] = present_k, present_v
        node.output.append(probs)

        def op(op_type: str, args: list[str], out: str, **attributes) -> str:
            nodes.append(helper.make_node(op_type, args, [out], **attributes))
            return out

        # the token's probabilities summed over each KV head's query heads: [1, Hkv, C+1]
        grouped = op("Reshape", [probs, groups], p + "grouped")
        total = op("ReduceSum", [grouped, shared["axis2"]], p + "total", keepdims=0)
        decayed = op("Mul", [score, shared["decay"]], p + "decayed")
        padded = op("Pad", [decayed, shared["pad_last"], shared["zero"]], p + "pad")
        updated = op("Add", [padded, total], p + "updated")
        score_old = op("Slice", [updated, shared["start"], shared["capacity"], shared["last"]], p + "score_old")
        score_new = op("Slice", [updated, shared["capacity"], shared["past_end"], shared["last"]], p + "score_new")
        forced = op(
            "Or",
            [op("Less", [pos, shared["sink"]], p + "sink"), op("Greater", [pos, "native.lowest"], p + "recent")],
            p + "forced",
        )
        keep = op("Where", [forced, shared["inf"], score_old], p + "keep")
        weakest = op("ArgMin", [keep], p + "weakest", axis=-1, keepdims=1)  # [1, Hkv, 1]
        rows_index = op("Expand", [op("Unsqueeze", [weakest, shared["last"]], p + "weakest4"), rows], p + "rows")
        for past, present in ((past_k, present_k), (past_v, present_v)):
            token = op("Slice", [present, shared["capacity"], shared["past_end"], shared["axis2"]], present + ".token")
            # fp32: the spare row moves into the weakest slot of the same buffer
            op("ScatterElements", [present if shared_buffer else past, rows_index, token], f"new_{past}", axis=2)
        op("ScatterElements", [pos, weakest, "native.new_pos"], f"new_{pos}", axis=2)
        op("ScatterElements", [score_old, weakest, score_new], f"new_{score}", axis=2)
        graph.output.extend(
            [helper.make_tensor_value_info(f"new_{past}", cache_type, None) for past in (past_k, past_v)]
            + [helper.make_tensor_value_info(present, cache_type, None) for present in (present_k, present_v)][
                : 2 if shared_buffer else 0
            ]
            + [
                helper.make_tensor_value_info(f"new_{pos}", TensorProto.INT64, None),
                helper.make_tensor_value_info(f"new_{score}", TensorProto.FLOAT, None),
            ]
        )
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def session(model, threads: int, folder: Path | None = None):
    """An ONNX Runtime session as the runtime makes one (all optimizations, spinning on). ``model``: a path, or a
    ModelProto saved (with its weights beside it) into ``folder`` first."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    if not isinstance(model, (str, Path)):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "native.onnx"
        onnx.save(model, path, save_as_external_data=True, location="native.onnx.data")
        model = path
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def bind_step(sess, position: int, capacity: int, seed: int = 0):
    """One decode step of ``sess`` bound once, every state input to random full slots with distinct positions
    below ``position`` and its ``new_`` output to the same buffer (in place, as the runtime binds them); returns
    (binding, kept OrtValues by input name)."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    binding = sess.io_binding()
    kept = {}
    outputs = {output.name for output in sess.get_outputs()}
    fixed = {
        "input_ids": np.array([[42]], np.int64),
        "position_ids": np.array([[position]], np.int64),
        "logits_index": np.array([0], np.int64),
        "protect": np.array([[False]]),
        "observe": np.array([False]),
    }
    for value in sess.get_inputs():
        if value.name in fixed:
            binding.bind_cpu_input(value.name, fixed[value.name])
            continue
        shape = [d if isinstance(d, int) else capacity for d in value.shape]
        if value.type == "tensor(int8)":
            array = rng.integers(-100, 101, shape).astype(np.int8)
        elif value.type == "tensor(int64)":  # slot positions: distinct, spread below the token's
            array = np.broadcast_to(np.linspace(0, position - 1, shape[-1]).astype(np.int64), shape).copy()
        elif value.name.endswith((".k", ".v")) and value.name.startswith("cache."):  # fp32 slots
            array = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:  # scales and scores
            array = rng.uniform(0.01, 0.02, shape).astype(np.float32)
        kept[value.name] = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(value.name, kept[value.name])
        for prefix in ("new_", "shared_"):  # shared_: fp32 prototype's present, the same buffer (native_graph)
            if f"{prefix}{value.name}" in outputs:
                binding.bind_ortvalue_output(f"{prefix}{value.name}", kept[value.name])
    for name in outputs:
        if name.split("_", 1)[-1] not in kept:
            binding.bind_output(name, "cpu")
    return binding, kept


def graph_step_ms(sess, binding, steps: int) -> float:
    for _ in range(3):
        sess.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(steps):
        sess.run_with_iobinding(binding)
    return (time.perf_counter() - start) / steps * 1000.0


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the saved results")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(RESULTS.read_text()), RESULTS.with_suffix(".png"))
        return
    thread_counts = [int(t) for t in args.threads.split(",")]
    names = [kv_speed.GENAI_INT4, kv_speed.COMPRESSED, kv_speed.PLAIN_INT4]
    kv_speed.prepare(names)
    ids = kv_speed.prompt_ids(args.prompt)
    plain_graph = kv_speed.OUT / kv_speed.BUNDLES[kv_speed.PLAIN_INT4][0] / "model.onnx"
    compressed_graph = kv_speed.OUT / kv_speed.BUNDLES[kv_speed.COMPRESSED][0] / "model.onnx"
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        prototype = native_graph(plain_graph, CAPACITY)
        prototype_fp32 = native_graph(plain_graph, CAPACITY, storage="fp32")
        for threads in thread_counts:
            runners = {name: kv_speed.runner(name, threads) for name in names[:2]}
            for runner in runners.values():  # warm-up
                runner.run(ids[:256], 4)
            graphs = {
                "today": session(compressed_graph, threads),
                "prototype": session(prototype, threads, Path(scratch) / "int8"),
                "fp32": session(prototype_fp32, threads, Path(scratch) / "fp32"),
                "floor": session(plain_graph, threads),
            }
            bindings = {
                "today": bind_step(graphs["today"], args.prompt, CAPACITY),
                "prototype": bind_step(graphs["prototype"], args.prompt, CAPACITY),
                "fp32": bind_step(graphs["fp32"], args.prompt, CAPACITY),
                "floor": bind_step(graphs["floor"], FLOOR_POSITION, CAPACITY),
            }
            kinds = ("genai", "runner", "today", "prototype", "fp32", "floor")
            steps: dict[str, list[float]] = {key: [] for key in kinds}
            for round_index in range(args.rounds):
                for key, name in (("genai", kv_speed.GENAI_INT4), ("runner", kv_speed.COMPRESSED)):
                    _, tokens_per_second = runners[name].run(ids, args.new_tokens)
                    steps[key].append(1000.0 / tokens_per_second)
                for key, sess in graphs.items():
                    steps[key].append(graph_step_ms(sess, bindings[key][0], args.new_tokens))
                latest = ", ".join(f"{key} {values[-1]:.1f} ms" for key, values in steps.items())
                print(f"{threads} thread(s), round {round_index}: {latest}", flush=True)
            del runners, graphs, bindings
            paired = [dict(zip(steps, values, strict=True)) for values in zip(*steps.values(), strict=True)]

            def median(per_round, paired=paired) -> float:
                return float(np.median([per_round(r) for r in paired]))

            rows[threads] = {
                "steps_ms": {key: [round(s, 2) for s in values] for key, values in steps.items()},
                **{f"{key}_ms": float(np.median(values)) for key, values in steps.items()},
                "runner_vs_genai_int4": median(lambda r: r["genai"] / r["runner"]),
                "prototype_vs_today": median(lambda r: r["today"] / r["prototype"]),
                # the runner's step = today's graph + the runtime's per-step work; the prototype would keep the latter
                "projected_vs_genai_int4": median(lambda r: r["genai"] / (r["prototype"] + r["runner"] - r["today"])),
                "projected_fp32_vs_genai_int4": median(lambda r: r["genai"] / (r["fp32"] + r["runner"] - r["today"])),
                "fp32_cache_cost_ms": median(lambda r: r["fp32"] - r["floor"]),
                "prototype_cache_cost_ms": median(lambda r: r["prototype"] - r["floor"]),
                "today_cache_cost_ms": median(lambda r: r["today"] - r["floor"]),
            }
    results = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "machine": measure.machine(),
        "prompt": args.prompt,
        "capacity": CAPACITY,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(results, indent=2))
    plot(results, RESULTS.with_suffix(".png"))
    print(
        "| threads | genai int4 | compressed bundle (runner) | today's op graph | prototype graph | floor graph "
        "| fp32 prototype graph | runner vs genai int4 | prototype vs today's graph | **projected vs genai int4** "
        "| **fp32 prototype, projected** | cache cost today → prototype / fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads, row in rows.items():
        print(
            f"| {threads} | {row['genai_ms']:.1f} ms | {row['runner_ms']:.1f} ms | {row['today_ms']:.1f} ms | "
            f"{row['prototype_ms']:.1f} ms | {row['floor_ms']:.1f} ms | {row['fp32_ms']:.1f} ms | "
            f"{row['runner_vs_genai_int4']:.2f}× | {row['prototype_vs_today']:.2f}× | "
            f"**{row['projected_vs_genai_int4']:.2f}×** | **{row['projected_fp32_vs_genai_int4']:.2f}×** | "
            f"{row['today_cache_cost_ms']:.1f} → {row['prototype_cache_cost_ms']:.1f} / "
            f"{row['fp32_cache_cost_ms']:.1f} ms |"
        )


def plot(results: dict, path: Path) -> None:
    """Per thread count: genai int4's step, the compressed bundle's, the prototype's and the floor's as bars, the
    achieved and projected ratios written above them."""
    rows = results["rows"]
    kinds = [
        ("genai_ms", f"onnxruntime-genai int4, prompt {results['prompt']}"),
        ("runner_ms", f"edgec int4 + {results['capacity']} int8 slots (today's format)"),
        ("prototype_ms", "prototype: GroupQueryAttention over int8 per-channel slots + eviction tail"),
        ("fp32_ms", "prototype: GroupQueryAttention over fp32 slots in place + eviction tail"),
        ("floor_ms", "edgec int4, position 64 (the floor)"),
    ]
    if not all("fp32_ms" in row for row in rows.values()):  # results saved before the fp32 prototype
        kinds = [kind for kind in kinds if kind[0] != "fp32_ms"]
    notes = [
        f"today {row['runner_vs_genai_int4']:.2f}×, int8 {row['projected_vs_genai_int4']:.2f}×"
        + (f", fp32 {row['projected_fp32_vs_genai_int4']:.2f}×" if "fp32_ms" in row else "")
        for row in rows.values()
    ]
    title = f"Decode vs genai int4: a natively read cache ({results['machine']}, {results['date']})"
    decode_ceiling.step_bars(rows, kinds, notes, title, path, headroom=1.4, title_size=10)


if __name__ == "__main__":
    main()
