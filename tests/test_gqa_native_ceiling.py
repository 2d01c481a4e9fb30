"""benchmarks/gqa_native_ceiling.py's prototype computes what it claims: GroupQueryAttention over int8 slots with
per-channel scales gives the plain bundle's logits over the same dequantized slots, and the eviction tail writes the
token (quantized as the kernel quantizes it) into the slot its scores pick, never a sink or a recent one."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tests.conftest import benchmark_script

CAPACITY, SINK, WINDOW, DECAY = 16, 2, 4, 0.99


def test_prototype_attends_like_the_plain_graph_and_evicts_the_weakest_slot(tiny_bundle, tmp_path):
    script = benchmark_script("gqa_native_ceiling")
    prototype = script.session(
        script.native_graph(tiny_bundle / "model.onnx", CAPACITY, sink=SINK, window=WINDOW, decay=DECAY), 1, tmp_path
    )
    plain = ort.InferenceSession(str(tiny_bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    caches = sorted({v.name.rsplit(".", 1)[0] for v in plain.get_inputs() if v.name.startswith("cache.")})
    shape = next(v.shape for v in plain.get_inputs() if v.name == f"{caches[0]}.k")
    kv_heads, context, head_dim = shape[1], shape[2], shape[3]
    query_per_kv = 2  # the tiny Llama: 4 query heads over 2 KV heads
    rng = np.random.default_rng(3)
    token = {"input_ids": np.array([[7]], np.int64), "position_ids": np.array([[CAPACITY]], np.int64)}
    token["logits_index"] = np.array([0], np.int64)
    native_feeds, plain_feeds = dict(token), dict(token)
    slots = {}
    for cache in caches:
        layer = cache.split(".")[1]
        for kind in ("k", "v"):
            slots[layer, kind] = rng.integers(-127, 128, (1, kv_heads, CAPACITY, head_dim)).astype(np.int8)
            native_feeds[f"{cache}.{kind}"] = slots[layer, kind]
            plain_feeds[f"{cache}.{kind}"] = np.zeros((1, kv_heads, context, head_dim), np.float32)
        native_feeds[f"pos.{layer}"] = np.broadcast_to(np.arange(CAPACITY), (1, kv_heads, CAPACITY)).copy()
        native_feeds[f"score.{layer}"] = rng.uniform(0.0, 1.0, (1, kv_heads, CAPACITY)).astype(np.float32)
    # Per-channel scales that hold the token's own rows exactly (x / scale = ±100), so that the kernel's
    # quantization of the token changes nothing and the plain graph's logits are the reference: a layer's new rows
    # depend only on the layers below it, so the scales are fixed layer by layer, the plain graph rerun each time.
    plain_names = [o.name for o in plain.get_outputs()]
    for cache in caches:
        reference = dict(zip(plain_names, plain.run(None, plain_feeds), strict=True))
        layer = cache.split(".")[1]
        for kind in ("k", "v"):
            row = np.abs(reference[f"new_{cache}.{kind}"][0, :, CAPACITY])[:, None, :]  # [Hkv, 1, D]
            scale = np.where(row > 1e-6, row / 100, 1.0).astype(np.float32)
            native_feeds[f"scale.{layer}.{kind}"] = scale
            plain_feeds[f"{cache}.{kind}"][:, :, :CAPACITY] = slots[layer, kind] * scale  # positions 0..C-1
            slots[layer, kind] = (slots[layer, kind], scale)
    names = [o.name for o in prototype.get_outputs()]
    native = dict(zip(names, prototype.run(None, native_feeds), strict=True))
    reference = dict(zip(plain_names, plain.run(None, plain_feeds), strict=True))

    np.testing.assert_allclose(native["logits"], reference["logits"], rtol=1e-4, atol=1e-4)
    for cache in caches:
        layer = cache.split(".")[1]
        pos, score = native_feeds[f"pos.{layer}"][0], native_feeds[f"score.{layer}"][0]
        new_pos, new_score = native[f"new_pos.{layer}"][0], native[f"new_score.{layer}"][0]
        for head in range(kv_heads):
            weakest = int(np.flatnonzero(new_pos[head] == CAPACITY)[0])  # the slot that took the token
            assert SINK <= pos[head, weakest] <= CAPACITY - WINDOW  # neither a sink nor a recent slot
            for kind in ("k", "v"):
                codes, scale = slots[layer, kind]
                written = native[f"new_{cache}.{kind}"][0, head]
                untouched = np.delete(np.arange(CAPACITY), weakest)
                np.testing.assert_array_equal(written[untouched], codes[0, head, untouched])
                # the token as the kernel quantizes it: round(x / scale), x the plain graph's new row
                arriving = reference[f"new_{cache}.{kind}"][0, head, CAPACITY] / scale[head, 0]
                np.testing.assert_array_equal(written[weakest], np.clip(np.round(arriving), -128, 127))
            # scores: the kept slots gained their probabilities; the probabilities of one KV head's query heads
            # sum to their count, which gives the weakest slot's before it was replaced
            others = np.delete(np.arange(CAPACITY), weakest)
            gained = new_score[head, others] - DECAY * score[head, others]
            assert (gained >= -1e-6).all()
            token_share = new_score[head, weakest]
            weakest_share = query_per_kv - gained.sum() - token_share
            assert -1e-4 <= weakest_share <= query_per_kv
            updated = DECAY * score[head].copy()
            updated[others] += gained
            updated[weakest] += weakest_share
            free = (pos[head] >= SINK) & (pos[head] <= CAPACITY - WINDOW)
            assert updated[weakest] <= updated[free].min() + 1e-5


def test_static_cache_mode_writes_the_token_after_the_filled_slots():
    """What docs/kv-cache.md's sketch of the native format relies on: with a past buffer one row longer than the
    slots and ``seqlens_k`` = the filled slots, GroupQueryAttention writes the token (quantized per channel) into
    row ``seqlens_k``, attends over rows [0, seqlens_k] only, and gives the rows after it probability 0."""
    from onnx import TensorProto, helper

    heads, kv_heads, dim, rows, filled, step = 4, 2, 16, 9, 5, 0.05
    names = ["q", "k", "v", "past_k", "past_v", "seqlens", "total", "", "", "", "", "", "scale", "scale"]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["out", "present_k", "present_v", "probs"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=0.25,
        k_quant_type="PER_CHANNEL",
        v_quant_type="PER_CHANNEL",
        kv_cache_bit_width=8,
        qk_output=2,
    )
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    inputs = [
        helper.make_tensor_value_info("q", f, [1, 1, heads * dim]),
        helper.make_tensor_value_info("k", f, [1, 1, kv_heads * dim]),
        helper.make_tensor_value_info("v", f, [1, 1, kv_heads * dim]),
        helper.make_tensor_value_info("past_k", i8, [1, kv_heads, rows, dim]),
        helper.make_tensor_value_info("past_v", i8, [1, kv_heads, rows, dim]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("scale", f, [kv_heads, 1, dim]),
    ]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(node.output, (f, i8, i8, f), strict=True)]
    model = helper.make_model(
        helper.make_graph([node], "static", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    widths = {"q": heads, "k": kv_heads, "v": kv_heads}
    feeds = {name: rng.standard_normal((1, 1, width * dim), np.float32) for name, width in widths.items()}
    feeds |= {name: rng.integers(-100, 101, (1, kv_heads, rows, dim)).astype(np.int8) for name in ("past_k", "past_v")}
    feeds |= {"seqlens": np.array([filled], np.int32), "total": np.array(rows, np.int32)}
    feeds["scale"] = np.full((kv_heads, 1, dim), step, np.float32)
    out, present_k, present_v, probs = sess.run(None, feeds)
    for present, name in ((present_k, "k"), (present_v, "v")):
        np.testing.assert_array_equal(present[0, :, :filled], feeds[f"past_{name}"][0, :, :filled])
        token = np.clip(np.round(feeds[name].reshape(kv_heads, dim) / step), -128, 127)
        np.testing.assert_array_equal(present[0, :, filled], token)
    keys = present_k[0, :, : filled + 1].astype(np.float32) * step
    values = present_v[0, :, : filled + 1].astype(np.float32) * step
    queries = feeds["q"].reshape(heads, dim)
    for head in range(heads):
        scores = 0.25 * keys[head // 2] @ queries[head]
        expected = np.exp(scores - scores.max())
        expected /= expected.sum()
        np.testing.assert_allclose(probs[0, head, 0, : filled + 1], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.reshape(heads, dim)[head], expected @ values[head // 2], rtol=1e-5, atol=1e-5)
    assert (probs[0, :, 0, filled + 1 :] == 0).all()


def test_fp32_prototype_reads_its_slots_in_place_and_moves_the_token_into_the_weakest(tiny_bundle, tmp_path):
    """``storage="fp32"``: the plain graph's logits over the same float slots exactly, and — with every state bound
    in place, the present and the eviction's output to the input's own buffer as bind_step binds them — the token's
    k and v rows land in the weakest slot of that buffer, every other slot untouched."""
    script = benchmark_script("gqa_native_ceiling")
    graph = script.native_graph(
        tiny_bundle / "model.onnx", CAPACITY, sink=SINK, window=WINDOW, decay=DECAY, storage="fp32"
    )
    prototype = script.session(graph, 1, tmp_path)
    plain = ort.InferenceSession(str(tiny_bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    caches = sorted({v.name.rsplit(".", 1)[0] for v in plain.get_inputs() if v.name.startswith("cache.")})
    shape = next(v.shape for v in plain.get_inputs() if v.name == f"{caches[0]}.k")
    kv_heads, context, head_dim = shape[1], shape[2], shape[3]
    rng = np.random.default_rng(5)
    token = {"input_ids": np.array([[7]], np.int64), "position_ids": np.array([[CAPACITY]], np.int64)}
    token["logits_index"] = np.array([0], np.int64)
    plain_feeds = dict(token)
    binding = prototype.io_binding()
    for name, value in token.items():
        binding.bind_cpu_input(name, value)
    buffers, before = {}, {}
    for cache in caches:
        layer = cache.split(".")[1]
        for kind in ("k", "v"):
            slots = rng.standard_normal((1, kv_heads, CAPACITY, head_dim)).astype(np.float32)
            plain_feeds[f"{cache}.{kind}"] = np.zeros((1, kv_heads, context, head_dim), np.float32)
            plain_feeds[f"{cache}.{kind}"][:, :, :CAPACITY] = slots  # positions 0..C-1
            spare = np.full((1, kv_heads, 1, head_dim), 1e4, np.float32)  # whatever the spare row holds is unread
            before[f"{cache}.{kind}"] = np.concatenate([slots, spare], axis=2)
        before[f"pos.{layer}"] = np.broadcast_to(np.arange(CAPACITY), (1, kv_heads, CAPACITY)).copy()
        before[f"score.{layer}"] = rng.uniform(0.0, 1.0, (1, kv_heads, CAPACITY)).astype(np.float32)
    output_names = {o.name for o in prototype.get_outputs()}
    for name, array in before.items():
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(array.copy())
        binding.bind_ortvalue_input(name, buffers[name])
        for prefix in ("new_", "shared_"):
            if prefix + name in output_names:
                binding.bind_ortvalue_output(prefix + name, buffers[name])
    binding.bind_output("logits", "cpu")
    prototype.run_with_iobinding(binding)
    logits = binding.get_outputs()[-1].numpy()  # bound last
    plain_names = [o.name for o in plain.get_outputs()]
    reference = dict(zip(plain_names, plain.run(None, plain_feeds), strict=True))

    np.testing.assert_allclose(logits, reference["logits"], rtol=1e-5, atol=1e-5)
    for cache in caches:
        layer = cache.split(".")[1]
        new_pos = buffers[f"pos.{layer}"].numpy()[0]
        for head in range(kv_heads):
            weakest = int(np.flatnonzero(new_pos[head] == CAPACITY)[0])  # the slot that took the token
            assert SINK <= before[f"pos.{layer}"][0, head, weakest] <= CAPACITY - WINDOW
            for kind in ("k", "v"):
                after = buffers[f"{cache}.{kind}"].numpy()[0, head]
                untouched = np.delete(np.arange(CAPACITY), weakest)
                np.testing.assert_array_equal(after[untouched], before[f"{cache}.{kind}"][0, head, untouched])
                arriving = reference[f"new_{cache}.{kind}"][0, head, CAPACITY]
                np.testing.assert_allclose(after[weakest], arriving, rtol=1e-4, atol=1e-5)
