"""CompressedKVAttention's ONNX body against the numpy reference: every dtype and policy, several shapes,
steps that fill the cache and then evict, and the state run in place against separate buffers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgec.kvcache import compressed_function as cf
from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import POLICIES
from tests.kvcache.helpers import assert_state_read_before_written, op_types

# out: float32 attention; ORT and numpy (float64) differ by accumulation order, and the dequantized slots are
# computed identically (same bytes, same scales) so the dtype does not widen it
OUT_ATOL = {"fp32": 2e-5, "fp16": 2e-5, "int8": 2e-5, "fp8": 2e-5, "int4": 2e-5}
SHAPES = [(4, 2, 16, 12), (6, 3, 32, 16), (2, 1, 64, 10)]  # heads, kv_heads, head_dim, capacity
# (start, count): a prefill larger than the room left, decode steps that evict one slot each, then a chunk
STEPS = [(0, 7), (7, 1), (8, 1), (9, 5), (14, 1), (15, 1), (16, 8), (24, 1), (25, 1)]


def compressed_model(
    heads, kv_heads, head_dim, capacity, compression: Compression, scale: float, window: int = 0, fused: bool = False
):
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    storage = cf.STORAGE_TYPES[compression.dtype]
    stored_dim = head_dim // 2 if compression.dtype == "int4" else head_dim
    rows = capacity + compression.spare_rows  # GroupQueryAttention's spare row (decode_kernel gqa)
    state_types = {
        "k_cache": (storage, [1, kv_heads, rows, stored_dim]),
        "v_cache": (storage, [1, kv_heads, rows, stored_dim]),
        "k_scale": (f, [1, kv_heads, capacity, head_dim // compression.group]),
        "v_scale": (f, [1, kv_heads, capacity, head_dim // compression.group]),
        "score": (f, [1, kv_heads, capacity]),
        "pos": (i64, [1, kv_heads, capacity]),
    }
    inputs = [
        helper.make_tensor_value_info("q", f, [1, heads, "T", head_dim]),
        helper.make_tensor_value_info("k", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("v", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("position_ids", i64, [1, "T"]),
        helper.make_tensor_value_info("protect", TensorProto.BOOL, [1, "T"]),
    ]
    names = cf.state_names(compression)
    inputs += [helper.make_tensor_value_info(name, *state_types[name]) for name in names]
    inputs.append(helper.make_tensor_value_info("observe", TensorProto.BOOL, [1]))
    outputs = [helper.make_tensor_value_info("out", f, [1, "T", heads, head_dim])]
    outputs += [helper.make_tensor_value_info(f"{name}_out", *state_types[name]) for name in names]
    node = helper.make_node(
        cf.OP_TYPE,
        list(cf.inputs(compression)),
        list(cf.outputs(compression)),
        domain=cf.DOMAIN,
        scale=scale,
        window=window,
    )
    graph = helper.make_graph([node], "compressed", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(cf.DOMAIN, 1)]
        + ([helper.make_opsetid("com.microsoft", 1)] if fused else []),
        functions=[cf.make_function(compression, 23, cf.Heads(heads, kv_heads, head_dim), fused_attention=fused)],
    )


def _state_feed(state: dict) -> dict:
    return {("k_cache" if n == "k" else "v_cache" if n == "v" else n): value for n, value in state.items()}


def _run(
    sess,
    compression,
    heads,
    kv_heads,
    head_dim,
    capacity,
    steps,
    seed,
    window=0,
    protect_at=(),
    in_place=False,
    grid=0.0,
    decode_sess=None,
    unobserved=(),
    **kw,
):
    """``decode_sess``: one-token steps run on it, longer ones on ``sess`` (a bundle's two graphs over one state).
    ``unobserved``: the indices of the steps fed ``observe`` = False.
    ``grid`` > 0 rounds the inputs to its multiples: with a power of two and a head dim that is a power of four,
    a rotation's products and sums are exact in float32 in any order, so ONNX Runtime and numpy store the same
    bytes (otherwise their summation orders may differ in the last bit and tip a rounding)."""
    rng = np.random.default_rng(seed)
    snap = (lambda x: np.round(x / grid) * grid) if grid else (lambda x: x)  # noqa: E731
    state = reference.empty_compressed_state(kv_heads, capacity, head_dim, compression)
    mine = {name: value.copy() for name, value in _state_feed(state).items()}
    spare = compression.spare_rows  # k/v rows after the slots (decode_kernel gqa): whatever they hold is unread
    for name in ("k_cache", "v_cache") if spare else ():
        mine[name] = np.concatenate([mine[name], np.full_like(mine[name][:, :, :spare], 7.0)], axis=2)
    bound = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in mine.items()} if in_place else None
    scale = kw.get("scale", head_dim**-0.5)
    for index, (start, count) in enumerate(steps):
        observe = index not in unobserved
        q = snap(rng.standard_normal((1, heads, count, head_dim))).astype(np.float32)
        # a few loud keys so that scored policies have something to find
        k = rng.standard_normal((1, kv_heads, count, head_dim)) * rng.uniform(0.2, 3, (1, kv_heads, count, 1))
        k = snap(k).astype(np.float32)
        v = snap(rng.standard_normal((1, kv_heads, count, head_dim))).astype(np.float32)
        positions = np.arange(start, start + count, dtype=np.int64)[None]
        protect = np.isin(positions, protect_at)
        want_out, state = reference.compressed_kv_attention(
            q, k, v, positions, protect, state, compression, scale=scale, window=window, observe=observe
        )
        feeds = dict(q=q, k=k, v=v, position_ids=positions, protect=protect, observe=np.array([observe]))
        step = decode_sess if decode_sess is not None and count == 1 else sess
        if in_place:
            binding = step.io_binding()
            binding.bind_output("out")  # first: copy_outputs_to_cpu returns outputs in binding order
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name, value in bound.items():
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(f"{name}_out", value)
            step.run_with_iobinding(binding)
            got_out = binding.copy_outputs_to_cpu()[0]
            got = {name: value.numpy() for name, value in bound.items()}
        else:
            results = step.run(None, feeds | mine)
            got_out = results[0]
            got = dict(zip(cf.state_names(compression), results[1:], strict=True))
            mine = got
        np.testing.assert_allclose(got_out, want_out, atol=OUT_ATOL[compression.dtype], rtol=0)
        want = _state_feed(state)
        np.testing.assert_array_equal(got["pos"], want["pos"], err_msg=f"slots chosen differ at step {start}")
        np.testing.assert_allclose(got["score"], want["score"], rtol=1e-4, atol=1e-5)
        for name in ("k_cache", "v_cache"):
            slots = np.ascontiguousarray(got[name][:, :, :capacity])
            np.testing.assert_array_equal(slots.view(np.uint8), np.ascontiguousarray(want[name]).view(np.uint8))
        for name in ("k_scale", "v_scale"):
            if name in got:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
    return state


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_body_matches_reference_every_dtype_and_policy(dtype, policy):
    heads, kv_heads, head_dim, capacity = SHAPES[(len(dtype) + len(policy)) % len(SHAPES)]
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=head_dim**-0.5)
    onnx.checker.check_model(model, full_check=True)
    _run(_session(model), compression, heads, kv_heads, head_dim, capacity, STEPS, seed=hash((dtype, policy)) % 1000)


@pytest.mark.parametrize("heads,kv_heads,head_dim,capacity", SHAPES)
@pytest.mark.parametrize("dtype,policy", [("int8", "snapkv"), ("int4", "h2o"), ("fp8", "adaptive"), ("fp32", "tova")])
def test_state_in_place_equals_separate_buffers(heads, kv_heads, head_dim, capacity, dtype, policy):
    """IO binding each state input to its own output buffer gives the reference's results."""
    compression = Compression(capacity=capacity, sink=1, window=2, policy=policy, dtype=dtype, group=8, observe=3)
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=head_dim**-0.5))
    _run(sess, compression, heads, kv_heads, head_dim, capacity, STEPS, seed=capacity, in_place=True)


def test_sliding_window_and_protected_tokens():
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 12
    compression = Compression(capacity=capacity, sink=1, window=2, policy="h2o", dtype="int8", group=16, observe=2)
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.25, window=6))
    state = _run(sess, compression, heads, kv_heads, head_dim, capacity, STEPS, seed=5, window=6, protect_at=[3, 9])
    assert {3, 9} <= set(state["pos"].ravel().tolist()), "protected positions were evicted"


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_capacity_above_context_equals_uncompressed_cache(dtype):
    """No eviction: slot == position, and the output equals plain KVAttention's."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 32
    compression = Compression(capacity=capacity, sink=2, window=3, policy="snapkv", dtype=dtype, group=16)
    rng = np.random.default_rng(0)
    state = reference.empty_compressed_state(kv_heads, capacity, head_dim, compression)
    plain = (np.zeros((1, kv_heads, capacity, head_dim), np.float32),) * 2 + (np.full((1, kv_heads, capacity), -1),)
    for start, count in [(0, 9), (9, 1), (10, 6), (16, 1)]:
        q = rng.standard_normal((1, heads, count, head_dim)).astype(np.float32)
        k, v = rng.standard_normal((2, 1, kv_heads, count, head_dim)).astype(np.float32)
        positions = np.arange(start, start + count)[None]
        out, state = reference.compressed_kv_attention(
            q, k, v, positions, np.zeros_like(positions, bool), state, compression, scale=0.25
        )
        plain_out, *plain = reference.kv_attention(q, k, v, positions, *plain, scale=0.25)
        np.testing.assert_array_equal(state["pos"], plain[2])
        if dtype == "fp32":  # the same numbers summed in another order (slots, then the new tokens)
            np.testing.assert_allclose(out, plain_out, atol=1e-6, rtol=0)
        else:  # only earlier tokens are quantized: int8 keeps attention within a few 1e-3
            np.testing.assert_allclose(out, plain_out, atol=2e-2)


@pytest.mark.parametrize("dtype", ["fp32", "int8", "fp8", "int4"])
def test_decode_from_an_empty_cache(dtype):
    """One-token steps from the very first token (no filled slot yet), then past capacity."""
    compression = Compression(capacity=8, sink=1, window=2, policy="snapkv", dtype=dtype, group=8, observe=3)
    sess = _session(compressed_model(4, 2, 16, 8, compression, scale=0.25))
    steps = [(0, 1), (1, 1), (2, 3), *[(p, 1) for p in range(5, 14)]]
    _run(sess, compression, 4, 2, 16, 8, steps, seed=3, in_place=True)


def test_end_selection_pools_each_score_once():
    """snapkv's op pools the last call's new tokens; selecting at the end pools only the others."""
    from edgec.kvcache.policies import snapkv

    compression = Compression(capacity=4, sink=0, window=1, policy="snapkv")
    score = np.zeros((1, 1, 40), np.float32)
    score[..., 10] = 1.0  # an earlier token: pooled here, 7 wide
    score[..., 30] = snapkv.pool(np.eye(1, 10, 5, dtype=np.float32)[None])[0, 0, 5]  # last call: pooled already
    state = {"score": score, "pos": np.arange(40)[None, None]}
    wide = reference.select_slots(state, compression, newest=39, capacity=12, pooled_from=25)["pos"].ravel()
    assert set(range(7, 14)) | {30, 39} <= set(wide.tolist())
    assert not {27, 28, 29, 31, 32, 33} & set(wide.tolist())  # pooled twice, 30 would have spread


# --- prompt chunks through ONNX Runtime's fused attention (the cpu target's body) -----------------------------
# snapkv, tova and streaming judge a chunk by its last queries (or not at all): the op attends with
# com.microsoft::GroupQueryAttention when the chunk extends the slots and scores from the last `observe` rows
FUSED_POLICIES = {"snapkv", "tova", "streaming"}


def _ran(sess: ort.InferenceSession) -> dict[str, int]:
    """How many times a profiled session ran each op type (ends its profile)."""
    import json
    from collections import Counter
    from pathlib import Path

    events = json.loads(Path(sess.end_profiling()).read_text())
    runs = {(e["ts"], e["args"]["op_name"]) for e in events if e.get("cat") == "Node" and "op_name" in e["args"]}
    return Counter(op for _, op in runs)


def _deferred(compression: Compression, fused: bool) -> int:
    """How many state tensors every multi-token call writes with a ScatterND of its own after the branches
    (``_scatter_rows``): k and v for fp32 slots on the fused path; a direct write scatters the others inside."""
    return len(cf.DEFERRED) if fused and compression.dtype == "fp32" else 0


def _kernel_runs(sess: ort.InferenceSession) -> tuple[int, int]:
    """(runs of the state kernel, runs of every other GroupQueryAttention) of a profiled session (ends it)."""
    import json
    from pathlib import Path

    events = json.loads(Path(sess.end_profiling()).read_text())
    runs = {
        (e["ts"], cf.STATE_KERNEL in e["name"])
        for e in events
        if e.get("cat") == "Node" and e["args"].get("op_name") == "GroupQueryAttention"
    }
    return sum(1 for _, kernel in runs if kernel), sum(1 for _, kernel in runs if not kernel)


def _runs(sess: ort.InferenceSession, op_type: str = "GroupQueryAttention") -> int:
    """How many times a profiled session ran ``op_type`` (ends its profile)."""
    return _ran(sess)[op_type]


def _profiled(model: onnx.ModelProto, tmp_path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_prompt_attention_matches_reference(dtype, policy, tmp_path):
    """Every dtype and policy, in place: the same slots, bytes, scores and outputs as the reference; the fused
    kernel runs for every chunk that extends the slots (all multi-token steps of STEPS) where the policy allows.
    fp32 slots: the kernel over the state runs for every chunk (on one query where its output is not taken), and
    the branch's own kernel only for chunks that extend the slots but do not fit after them."""
    heads, kv_heads, head_dim, capacity = SHAPES[(len(dtype) + len(policy) + 1) % len(SHAPES)]
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True)
    onnx.checker.check_model(model, full_check=True)
    sess = _profiled(model, tmp_path)
    seed = hash((dtype, policy, "fused")) % 1000
    _run(sess, compression, heads, kv_heads, head_dim, capacity, STEPS, seed=seed, in_place=True, scale=0.3)
    chunks = [(start, count) for start, count in STEPS if count > 1]
    if dtype != "fp32":
        assert _runs(sess) == (len(chunks) if policy in FUSED_POLICIES else 0)
        return
    no_room = sum(1 for start, count in chunks if min(start, capacity) + count > capacity)
    assert no_room and _kernel_runs(sess) == (len(chunks), no_room if policy in FUSED_POLICIES else 0)


@pytest.mark.parametrize("dtype", ["int8", "fp32"])
def test_fused_prompt_attention_falls_back_where_slots_do_not_extend(dtype):
    """A sliding window, or new positions not after every cached one: every query's probabilities, as before
    (fp32: the kernel over the state runs on one query there, its output not taken)."""
    compression = Compression(capacity=12, sink=1, window=2, policy="snapkv", dtype=dtype, group=16, observe=3)
    model = compressed_model(4, 2, 16, 12, compression, scale=0.25, window=6, fused=True)
    sess = _session(model)
    _run(sess, compression, 4, 2, 16, 12, STEPS, seed=11, window=6, protect_at=[3, 9])
    model = compressed_model(4, 2, 16, 12, compression, scale=0.25, fused=True)
    steps = [(20, 6), (0, 5), (26, 1), (10, 4)]  # a chunk of earlier positions after later ones
    _run(_session(model), compression, 4, 2, 16, 12, steps, seed=12, in_place=True)


# --- the direct write: a chunk that fits the empty slots after the filled ones lands there in order ----------------
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,policy", [("int8", "snapkv"), ("int4", "h2o"), ("fp32", "adaptive"), ("fp8", "tova")])
def test_chunks_that_fit_the_empty_slots_are_written_directly(dtype, policy, fused, tmp_path):
    """In place, against the reference: a chunk into an empty cache, one that fills it exactly, and one that must
    evict (the pairing). The direct write (one ScatterND per state tensor) runs for the first two only — but for
    fp32 slots on the fused path, whose k and v every chunk writes with a ScatterND after the branches."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 16
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    sess = _profiled(
        compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=fused), tmp_path
    )
    steps = [(0, 7), (7, 1), (8, 8), (16, 1), (17, 4)]
    _run(sess, compression, heads, kv_heads, head_dim, capacity, steps, seed=21, in_place=True, scale=0.3)
    deferred = _deferred(compression, fused)
    assert _runs(sess, "ScatterND") == 2 * (len(cf.state_names(compression)) - deferred) + 3 * deferred


@pytest.mark.parametrize(
    "case,observe",
    [("a hole", True), ("a hole", False), ("a filled slot scoring -inf", False), ("no room", True), ("no room", False)],
)
def test_the_pairing_decides_where_the_empty_slots_are_not_simply_next(case, observe, tmp_path):
    """Room for the chunk, but the weakest slots are not [active, active + T): an empty slot among the filled ones
    (which the pairing fills first), a filled slot whose score ties the empty ones (-inf; not a sink, not recent:
    the pairing takes it, lowest index first; unobserved, so the slot keeps that score) — or no room at all. The
    op must neither write directly nor take the unobserved append (no ScatterND runs) and must still give the
    reference's state."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 16
    compression = Compression(capacity=capacity, sink=1, window=2, policy="snapkv", dtype="int8", group=8, observe=4)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True)
    state = _run(_session(model), compression, heads, kv_heads, head_dim, capacity, [(0, 8)], seed=1, scale=0.3)
    if case == "a hole":
        state["pos"][:, :, 4] = -1
    elif case == "a filled slot scoring -inf":
        state["score"][:, 1, 5] = -np.inf
    count = 9 if case == "no room" else 4
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, heads, count, head_dim)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, kv_heads, count, head_dim)).astype(np.float32)
    positions = np.arange(8, 8 + count)[None]
    protect = np.zeros_like(positions, bool)
    want_out, want = reference.compressed_kv_attention(
        q, k, v, positions, protect, state, compression, scale=0.3, observe=observe
    )
    sess = _profiled(model, tmp_path)
    feeds = dict(q=q, k=k, v=v, position_ids=positions, protect=protect, observe=np.array([observe]))
    out, *results = sess.run(None, feeds | _state_feed(state))
    got = dict(zip(cf.state_names(compression), results, strict=True))
    np.testing.assert_allclose(out, want_out, atol=OUT_ATOL["int8"], rtol=0)
    want = _state_feed(want)
    np.testing.assert_array_equal(got["pos"], want["pos"])
    assert case == "no room" or set(range(8, 12)) - set(got["pos"][0, 1].tolist()) == set()
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_allclose(got["score"], want["score"], rtol=1e-4, atol=1e-5)
    assert _runs(sess, "ScatterND") == 0


@pytest.mark.parametrize("dtype,policy", [("int8", "snapkv"), ("int4", "tova"), ("fp32", "streaming"), ("fp8", "h2o")])
def test_unobserved_chunks_that_append_take_the_lean_branch(dtype, policy, tmp_path):
    """An `end` prompt's chunks (unobserved, each after the last, with room): the reference's state in place, and
    ONNX Runtime ran the append branch — GroupQueryAttention and a ScatterND per state tensor, none of the judging
    (its IsInf of the protected slots, its Pad of the unobserved scores, its TopKs). Then an observed chunk takes
    the judging."""
    heads, kv_heads, head_dim, capacity = 6, 3, 32, 48
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True)
    steps = [(0, 5), (5, 16), (21, 16)]
    shape = (heads, kv_heads, head_dim, capacity)
    sess = _profiled(model, tmp_path)
    _run(sess, compression, *shape, steps, seed=8, in_place=True, scale=0.3, unobserved={0, 1, 2})
    ran = _ran(sess)
    assert ran["GroupQueryAttention"] == 3 and ran["ScatterND"] == 3 * len(cf.state_names(compression))
    assert not {"IsInf", "Pad", "TopK"} & set(ran)
    sess = _profiled(model, tmp_path)
    _run(sess, compression, *shape, [*steps, (37, 8)], seed=8, in_place=True, scale=0.3, unobserved={0, 1, 2})
    assert _ran(sess)["IsInf"] > 0


# --- one branch per graph: a bundle with a prompt-chunk graph decodes on the decode branch alone -------------------
def _one_branch_model(model: onnx.ModelProto, kind: str) -> onnx.ModelProto:
    specialised = onnx.ModelProto()
    specialised.CopyFrom(model)
    (function,) = specialised.functions
    function.CopyFrom(cf.single_branch(function, kind))
    return specialised


def _branch_names(nodes) -> set[str]:
    """The names of every If branch in ``nodes``, nested ones too."""
    names = set()
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= {attribute.g.name} | _branch_names(attribute.g.node)
    return names


@pytest.mark.parametrize(
    "dtype,policy,fused",
    [("int8", "snapkv", True), ("int4", "h2o", True), ("fp8", "tova", False), ("fp32", "streaming", True)],
)
def test_one_branch_graphs_match_reference_in_place(dtype, policy, fused):
    """The general branch alone for multi-token steps and the decode branch alone for one-token steps, one set of
    buffers bound to both (as the runtime binds model.onnx and prefill.onnx): the reference's slots, bytes, scores
    and outputs. Neither body holds the decode/general If (the general one keeps its fused-attention fallback);
    the decode body refuses a call of more than one token."""
    heads, kv_heads, head_dim, capacity = SHAPES[len(dtype) % len(SHAPES)]
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=fused)
    general, decode = (_one_branch_model(model, kind) for kind in ("general", "decode"))
    for specialised in (general, decode):
        onnx.checker.check_model(specialised, full_check=True)
    branches = _branch_names(general.functions[0].node)
    fused_branches = {"fast_attention", "full_attention", "observed_scores", "unobserved_scores"}
    writes = {"direct_writes", "paired_writes"}
    appending = {"append_chunk", "judged_chunk"}  # fused: an unobserved chunk that only appends
    state_kernel = {"kernel_attention", "fallback_attention"}  # fused, fp32: the kernel over the state or not
    # fused, a policy reading the observation window: the window's attention a query head at a time
    per_head = {"observation_per_head"} if fused and policy in ("snapkv", "tova") and heads > 1 else set()
    assert (
        branches
        == (fused_branches if fused and policy != "h2o" else set())
        | writes
        | (appending if fused else set())
        | (state_kernel if fused and dtype == "fp32" and policy != "h2o" else set())
        | per_head
    )
    assert not any(node.op_type == "If" for node in decode.functions[0].node)
    assert "TopK" in op_types(general.functions[0].node)
    assert "TopK" not in op_types(decode.functions[0].node)
    body = decode.functions[0]
    read = set(body.output) | {name for node in body.node for name in node.input}
    assert all(set(node.output) & read for node in body.node)  # nothing left that only the If's condition read
    chunks, decoder = _session(general), _session(decode)
    seed = hash((dtype, policy, "branches")) % 1000
    _run(
        chunks,
        compression,
        heads,
        kv_heads,
        head_dim,
        capacity,
        STEPS,
        seed,
        in_place=True,
        decode_sess=decoder,
        scale=0.3,
    )
    with pytest.raises(Exception, match="Non-zero status code"):  # q [B,H,3,D] cannot be reshaped to [B,Hkv,G,D]
        _run(decoder, compression, heads, kv_heads, head_dim, capacity, [(0, 3)], seed, scale=0.3)


# --- the `observe` input: a prompt chunk whose scores the next chunk replaces skips its observation ---------------
# steps 0, 2, 4 and 6 unobserved: chunks with room, a chunk that evicts (the slots keep their scores, the new tokens
# start at zero) and a one-token step (which observes all the same)
UNOBSERVED = {0, 2, 4, 6}


@pytest.mark.parametrize(
    "dtype,policy,fused",
    [("int8", "snapkv", True), ("int4", "h2o", True), ("fp8", "tova", False), ("fp32", "streaming", True)]
    + [("int8", "snapkv", False), ("fp16", "adaptive", False)],
)
def test_unobserved_calls_match_reference(dtype, policy, fused):
    """The fused body (an If around the observation) and the every-query one (a Where) take the reference's
    meaning of ``observe`` = False, in place: slots, bytes, scores and outputs."""
    heads, kv_heads, head_dim, capacity = SHAPES[1]
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=fused))
    seed = hash((dtype, policy, "unobserved")) % 1000
    shape = (heads, kv_heads, head_dim, capacity)
    _run(sess, compression, *shape, STEPS, seed, in_place=True, unobserved=UNOBSERVED, scale=0.3)


def test_unobserved_call_keeps_old_scores_and_starts_new_ones_at_zero():
    """What ``observe`` = False means, on a cache that must evict: the old slots' scores are untouched, the new
    tokens' are zero (+inf where protected), and an observed call scores differently (the test would see a body
    that ignored the input)."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 8
    compression = Compression(capacity=capacity, sink=1, window=2, policy="snapkv", dtype="int8", group=8, observe=3)
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True))
    state = _run(sess, compression, heads, kv_heads, head_dim, capacity, [(0, 6)], seed=1, scale=0.3)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, heads, 5, head_dim)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, kv_heads, 5, head_dim)).astype(np.float32)
    positions = np.arange(6, 11)[None]
    protect = positions == 7
    scores = {}
    for observe in (True, False):
        feeds = dict(q=q, k=k, v=v, position_ids=positions, protect=protect, observe=np.array([observe]))
        results = sess.run(None, feeds | _state_feed(state))
        scores[observe] = dict(zip(cf.state_names(compression), results[1:], strict=True))
    unobserved = scores[False]
    for head in range(kv_heads):
        score, pos = unobserved["score"][0, head], unobserved["pos"][0, head]
        for slot, position in enumerate(pos):
            if position >= 6:  # a new token
                assert score[slot] == (np.inf if position == 7 else 0.0)
            else:
                old_slot = list(state["pos"][0, head]).index(position)
                assert score[slot] == state["score"][0, head, old_slot]
    assert not np.array_equal(scores[True]["score"], unobserved["score"])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_prompt_overwrites_is_what_the_update_does(policy):
    """``prompt_overwrites`` (the runtime then skips a chunk's observation when the next chunk follows) holds
    exactly for the policies whose multi-token update reads no old score."""
    from edgec.kvcache.policies.base import prompt_overwrites

    module = POLICIES[policy]
    rng = np.random.default_rng(0)
    stats = {name: rng.random((1, 2, 14), dtype=np.float32) for name in ("total", "observed", "last")}
    key_pos = np.arange(14)[None, None].repeat(2, 1)
    old = [rng.random((1, 2, 9), dtype=np.float32) for _ in range(2)]
    same = np.array_equal(*(module.update(score, stats, key_pos, 5) for score in old))
    assert prompt_overwrites(module) == same


@pytest.mark.parametrize("policy", ["snapkv", "tova", "streaming"])
@pytest.mark.parametrize("dtype", ["int8", "fp32"])
def test_skipping_the_observation_of_all_but_the_last_chunk_changes_nothing(policy, dtype):
    """A prompt that fits the slots, read in chunks: when every chunk but the last skips its observation, the
    cache ends the prompt in the same state (bytes, slots, scores) with the same outputs, through the reference
    and through the op — what the runtime relies on (edgec/runtime/observe.py)."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 40
    compression = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    chunks = [(0, 4), (4, 12), (16, 12), (28, 12)]
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True))
    shape = (heads, kv_heads, head_dim, capacity)
    observed = _run(sess, compression, *shape, chunks, seed=4, in_place=True, scale=0.3)
    skipped = _run(sess, compression, *shape, chunks, seed=4, in_place=True, scale=0.3, unobserved={0, 1, 2})
    for name, value in observed.items():
        np.testing.assert_array_equal(skipped[name], value, err_msg=name)


# --- in place: every reader of a state input runs before the scatter that overwrites it ---------------------------
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,policy", [("int8", "snapkv"), ("int4", "adaptive"), ("fp32", "tova"), ("fp8", "h2o")])
def test_every_state_read_comes_before_its_write(dtype, policy, fused):
    """What makes running the state in place correct (backend_ort binds each state output to its input's buffer),
    checked on the graph rather than on what one ONNX Runtime happened to schedule: in the decode and the general
    branch, every node that reads a state input — the fused path's check that a chunk extends the slots, the
    pruning's look at the evicted positions — is an ancestor of the scatter that writes it. (The two-pool body:
    tests/kvcache/test_mixed.py, the same check.)"""
    compression = Compression(capacity=16, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    function = cf.make_function(compression, 23, cf.Heads(6, 3, 32), fused_attention=fused)
    (branch_node,) = [node for node in function.node if node.op_type == "If"]
    for attribute in branch_node.attribute:
        assert_state_read_before_written(attribute.g.node, [value.name for value in attribute.g.output], compression)
    # the general body alone, every slot attended (TensorRT-RTX targets: no If)
    every_slot = cf.make_function(compression, 23, cf.Heads(6, 3, 32), data_dependent_shapes=False)
    assert_state_read_before_written(every_slot.node, list(every_slot.output), compression)


@pytest.mark.parametrize("policy", ["snapkv", "adaptive"])
def test_every_state_read_comes_before_its_write_around_the_plugin(policy):
    """The same for the TensorRT-RTX plugin's function: its one-token branch (the plugin's node, then the slot
    choice and the writes) and its general every-slot branch."""
    pytest.importorskip("edgec.plugins.compressed_attention.kernel", reason="needs triton (edgec[dev])")
    from edgec.plugins.compressed_attention.graph import make_plugin_function

    compression = Compression(capacity=16, sink=2, window=3, policy=policy, dtype="int8", group=8, observe=4)
    function = make_plugin_function(compression, 23, cf.Heads(6, 3, 32))
    (branch_node,) = [node for node in function.node if node.op_type == "If"]
    for attribute in branch_node.attribute:
        assert_state_read_before_written(attribute.g.node, [value.name for value in attribute.g.output], compression)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_onnx_runtime_loads_the_body_without_a_warning(dtype, policy, fused, capfd):
    """ONNX Runtime's optimizer warns (on stderr, on every load) when a subgraph reads a Slice's output from the
    outer scope (CanUpdateImplicitInputNameInSubgraphs): the If branches slice fp32 slots themselves. A warning
    here is a warning every `edgec run` and `edgec serve` prints, and it breaks their one-line errors."""
    compression = Compression(capacity=12, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4)
    model = compressed_model(4, 2, 16, 12, compression, scale=0.25, fused=fused)
    capfd.readouterr()
    _session(model)
    assert "onnxruntime" not in capfd.readouterr().err
