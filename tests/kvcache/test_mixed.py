"""The mixed-precision cache (``--kv-mixed``): a wide pool (int8/fp16) for the sinks, the recent window and protected
tokens, a narrow one (int4, …) for the rest. The reference's meaning (it keeps the same tokens as one pool), the ONNX
body against the reference for every policy — with separate buffers and in place, rotated too — and the proof that
the in-place body reads every state input before the scatter that overwrites it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgec.kvcache import compressed_function as cf
from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import POLICIES
from edgec.kvcache.quantize import dequantize, quantize
from tests.kvcache.helpers import assert_state_read_before_written

# a prompt chunk larger than the wide pool and the room left, one-token steps that demote and evict, more chunks
STEPS = [(0, 7), (7, 1), (8, 1), (9, 5), (14, 1), (15, 1), (16, 8), (24, 1), (25, 1), (26, 12), (38, 1), (39, 1)]
NUMPY_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
NUMPY_TYPES |= {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}
NUMPY_TYPES |= {np.dtype(np.int64): TensorProto.INT64}


def _feed_name(name: str) -> str:
    return cf.FORMAL.get(name, name)


def mixed_model(heads, kv_heads, head_dim, capacity, compression, scale, window=0) -> onnx.ModelProto:
    """A one-node model around the op; the state's shapes and types are the spec's (``empty_compressed_state``)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    state = reference.empty_compressed_state(kv_heads, capacity, head_dim, compression)
    inputs = [
        helper.make_tensor_value_info("q", f, [1, heads, "T", head_dim]),
        helper.make_tensor_value_info("k", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("v", f, [1, kv_heads, "T", head_dim]),
        helper.make_tensor_value_info("position_ids", i64, [1, "T"]),
        helper.make_tensor_value_info("protect", TensorProto.BOOL, [1, "T"]),
    ]
    typed = {_feed_name(n): (NUMPY_TYPES[a.dtype], list(a.shape)) for n, a in state.items()}
    inputs += [helper.make_tensor_value_info(name, *typed[name]) for name in cf.state_names(compression)]
    inputs.append(helper.make_tensor_value_info("observe", TensorProto.BOOL, [1]))
    outputs = [helper.make_tensor_value_info("out", f, [1, "T", heads, head_dim])]
    outputs += [helper.make_tensor_value_info(f"{name}_out", *typed[name]) for name in cf.state_names(compression)]
    node = helper.make_node(
        cf.OP_TYPE,
        list(cf.inputs(compression)),
        list(cf.outputs(compression)),
        domain=cf.DOMAIN,
        scale=scale,
        window=window,
    )
    return helper.make_model(
        helper.make_graph([node], "mixed", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(cf.DOMAIN, 1)],
        functions=[cf.make_function(compression, 23, cf.Heads(heads, kv_heads, head_dim))],
    )


def _inputs(rng, heads, kv_heads, head_dim, start, count, grid=0.0):
    snap = (lambda x: np.round(x / grid) * grid) if grid else (lambda x: x)  # noqa: E731
    q = snap(rng.standard_normal((1, heads, count, head_dim))).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, count, head_dim)) * rng.uniform(0.2, 3, (1, kv_heads, count, 1))
    v = snap(rng.standard_normal((1, kv_heads, count, head_dim))).astype(np.float32)
    return q, snap(k).astype(np.float32), v, np.arange(start, start + count, dtype=np.int64)[None]


def _run(sess, compression, shape, steps, seed, in_place, window=0, protect_at=(), grid=0.0, unobserved=()):
    """Step the op through ONNX Runtime and the reference; every output and state byte must agree.
    ``unobserved``: the indices of the steps fed ``observe`` = False."""
    heads, kv_heads, head_dim, capacity = shape
    rng = np.random.default_rng(seed)
    state = reference.empty_compressed_state(kv_heads, capacity, head_dim, compression)
    mine = {_feed_name(name): value.copy() for name, value in state.items()}
    bound = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in mine.items()}
    for index, (start, count) in enumerate(steps):
        q, k, v, positions = _inputs(rng, heads, kv_heads, head_dim, start, count, grid)
        protect = np.isin(positions, protect_at)
        observe = index not in unobserved
        want_out, state = reference.compressed_kv_attention(
            q, k, v, positions, protect, state, compression, scale=0.3, window=window, observe=observe
        )
        feeds = dict(q=q, k=k, v=v, position_ids=positions, protect=protect, observe=np.array([observe]))
        if in_place:  # each state tensor one buffer, bound as input and output
            binding = sess.io_binding()
            binding.bind_output("out")
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name, value in bound.items():
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(f"{name}_out", value)
            sess.run_with_iobinding(binding)
            got_out = binding.copy_outputs_to_cpu()[0]
            got = {name: value.numpy() for name, value in bound.items()}
        else:
            results = sess.run(None, feeds | mine)
            got_out, got = results[0], dict(zip(cf.state_names(compression), results[1:], strict=True))
            mine = got
        np.testing.assert_allclose(got_out, want_out, atol=2e-5, rtol=0, err_msg=f"output at step {start}")
        for name, value in state.items():
            mine_value = got[_feed_name(name)]
            if name.startswith("score"):
                np.testing.assert_allclose(mine_value, value, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {start}")
            elif name.endswith("scale"):
                np.testing.assert_allclose(mine_value, value, rtol=1e-6, err_msg=f"{name} at {start}")
            else:  # positions (the slots chosen) and the stored bytes
                np.testing.assert_array_equal(
                    np.ascontiguousarray(mine_value).view(np.uint8),
                    np.ascontiguousarray(value).view(np.uint8),
                    err_msg=f"{name} at step {start}",
                )
    return state


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# --- the meaning ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_pools_keep_what_one_pool_keeps(policy):
    """Both pools fp32: the same outputs and, per head, the same set of kept positions as one pool of as many
    slots — the wide pool only holds tokens step 3 forces anyway (sinks, window, protected), and the displaced
    compete for the narrow pool by the same keep-scores. Chunks larger than the wide pool, evictions, pruning."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 20
    plain = Compression(capacity=capacity, sink=2, window=4, policy=policy, dtype="fp32", observe=4)
    mixed = replace(plain, mixed="fp32")  # not a setting a build takes (check() wants a narrower dtype): the meaning
    states = {c: reference.empty_compressed_state(kv_heads, capacity, head_dim, c) for c in (plain, mixed)}
    rng = np.random.default_rng(sum(map(ord, policy)))
    for start, count in STEPS:
        q, k, v, positions = _inputs(rng, heads, kv_heads, head_dim, start, count)
        protect = np.isin(positions, [10, 17])
        outs = {}
        for c in (plain, mixed):
            outs[c], states[c] = reference.compressed_kv_attention(
                q, k, v, positions, protect, states[c], c, scale=0.25
            )
        np.testing.assert_allclose(outs[mixed], outs[plain], atol=1e-5, rtol=0)
        for head in range(kv_heads):
            one = states[plain]["pos"][0, head]
            two = np.concatenate([states[mixed]["pos_hi"][0, head], states[mixed]["pos"][0, head]])
            assert sorted(one[one >= 0]) == sorted(two[two >= 0]), (start, one, two)
    wide = states[mixed]["pos_hi"][0, 0]
    assert {0, 1, 10, 17, 38, 39} == set(wide.tolist())  # sinks, protected (ahead of the window), the newest
    assert start + count > capacity


def test_tokens_are_requantized_as_they_leave_the_window():
    """Room for every token: the wide pool holds the sinks and the last window in int8 (the bytes quantize()
    gives); every other token sits in the narrow pool in int4, quantized from its int8 value once it aged out
    (the newest of a chunk never entered the wide pool: quantized from its own values)."""
    heads, kv_heads, head_dim = 2, 1, 16
    compression = Compression(capacity=32, sink=2, window=4, policy="h2o", dtype="int4", group=8, mixed="int8")
    state = reference.empty_compressed_state(kv_heads, 32, head_dim, compression)
    rng = np.random.default_rng(1)
    keys = []
    for start, length in [(0, 3), *[(p, 1) for p in range(3, 12)], (12, 12)]:
        q, k, v, positions = _inputs(rng, heads, kv_heads, head_dim, start, length)
        keys.append(k)
        _, state = reference.compressed_kv_attention(
            q, k, v, positions, np.zeros_like(positions, bool), state, compression, scale=0.3
        )
    keys = np.concatenate(keys, axis=2)[0, 0]  # [24, D]
    wide = {int(p): i for i, p in enumerate(state["pos_hi"][0, 0])}
    assert set(wide) == {0, 1, 20, 21, 22, 23}
    for position, slot in wide.items():
        np.testing.assert_array_equal(state["k_hi"][0, 0, slot], quantize(keys[position], "int8", 8)[0])
    narrow = {int(p): i for i, p in enumerate(state["pos"][0, 0]) if p >= 0}
    assert set(narrow) == set(range(2, 20))
    for position, slot in narrow.items():
        aged = position < 12  # decoded one by one: entered the wide pool first, left it as the window moved on
        source = dequantize(*quantize(keys[position], "int8", 8), "int8", 8) if aged else keys[position]
        np.testing.assert_array_equal(state["k"][0, 0, slot], quantize(source, "int4", 8)[0])


# --- the ONNX body --------------------------------------------------------------------------------------------
SLOW = pytest.mark.slow  # the same checks on more combinations: the slow tier (each ~0.7 s)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "dtype,mixed",
    [("int4", "int8"), pytest.param("int4", "fp16", marks=SLOW), pytest.param("int8", "fp16", marks=SLOW)],
)
def test_body_matches_reference(policy, dtype, mixed):
    """Every policy, int4 (and int8) narrow pools under int8/fp16 wide ones: the same outputs, slots, bytes and
    scores as the reference, with separate buffers and in place (one buffer per state tensor, ORT IO binding)."""
    shape = (4, 2, 16, 20) if policy != "tova" else (6, 3, 32, 16)
    compression = Compression(
        capacity=shape[3], sink=2, window=4, policy=policy, dtype=dtype, mixed=mixed, group=8, observe=4
    )
    compression.check(head_dim=shape[2])
    model = mixed_model(*shape, compression, scale=0.3)
    sess = _session(model)
    seed = sum(map(ord, policy + dtype + mixed))
    _run(sess, compression, shape, STEPS, seed, in_place=False, protect_at=[10, 17])
    _run(sess, compression, shape, STEPS, seed, in_place=True, protect_at=[10, 17])


def test_body_with_a_sliding_window_and_more_protected_than_the_wide_pool_holds():
    """Protected tokens crowd the window out of the wide pool: it stays kept (forced) in the narrow one."""
    shape = (4, 2, 16, 16)
    compression = Compression(capacity=16, sink=1, window=3, policy="h2o", dtype="int4", mixed="int8", group=16)
    sess = _session(mixed_model(*shape, compression, scale=0.3, window=9))
    protect_at = [3, 5, 9, 12, 20]
    state = _run(sess, compression, shape, STEPS, seed=2, in_place=True, window=9, protect_at=protect_at)
    kept = set(state["pos"].ravel().tolist()) | set(state["pos_hi"].ravel().tolist())
    assert set(protect_at) | {0, 37, 38, 39} <= kept


GRID = 2.0**-6  # as test_rotation: rotated products exact in float32 in any order


@pytest.mark.parametrize("policy", [p if p == "snapkv" else pytest.param(p, marks=SLOW) for p in sorted(POLICIES)])
def test_rotated_body_matches_reference(policy):
    """--kv-rotation hadamard wraps the mixed body as it wraps the one-pool body: in place, every policy."""
    shape = (4, 2, 16, 20)
    compression = Compression(
        capacity=20, sink=2, window=4, policy=policy, dtype="int4", mixed="int8", group=8, rotation="hadamard"
    )
    sess = _session(mixed_model(*shape, compression, scale=0.3))
    _run(sess, compression, shape, STEPS, seed=7, in_place=True, protect_at=[10], grid=GRID)


@pytest.mark.parametrize(
    "policy", ["adaptive", pytest.param("snapkv", marks=SLOW), pytest.param("streaming", marks=SLOW)]
)
def test_every_state_input_is_read_before_its_output_is_written(policy):
    """The in-place proof, on the graph: bound in place, a state input's buffer is its output's, which the node
    that computes the output writes (the last one before Identity copies, which ONNX Runtime removes: a
    ScatterElements, or the Where that prunes positions). In each branch of the op's If (decode, general), every
    node that reads the input, directly or through a view, must be an ancestor of that writer: ONNX Runtime runs a
    node only after its inputs exist, so nothing can read a slot after it was overwritten."""
    compression = Compression(capacity=20, sink=2, window=4, policy=policy, dtype="int4", mixed="int8", group=8)
    function = cf.make_function(compression, 23, cf.Heads(4, 2, 16))
    names = cf.state_names(compression)
    (branching,) = [node for node in function.node if node.op_type == "If"]
    outer_readers = [node.op_type for node in function.node if set(node.input) & set(names)]
    assert outer_readers == [], outer_readers  # the state is read inside the branches only
    for attribute in branching.attribute:
        assert_state_read_before_written(attribute.g.node, [value.name for value in attribute.g.output], compression)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_unobserved_calls_match_reference(policy):
    """``observe`` = False (a prompt chunk whose scores the next one replaces; one-token steps ignore it): the
    two-pool body takes the reference's meaning, in place, through chunks with room and chunks that evict."""
    shape = (4, 2, 16, 20)
    compression = Compression(capacity=20, sink=2, window=4, policy=policy, dtype="int4", mixed="int8", group=8)
    sess = _session(mixed_model(*shape, compression, scale=0.3))
    _run(sess, compression, shape, STEPS, seed=9, in_place=True, protect_at=[10], unobserved={0, 2, 3, 6, 9})
