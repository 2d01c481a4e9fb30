"""The ONNX body of KVAttention (and its GQA lowering) against the numpy reference, step by step."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgec.kvcache import reference
from edgec.kvcache.function import OUTPUTS
from edgec.passes.kv_attention_gqa import kv_attention_gqa
from tests.kvcache.helpers import empty_state, kv_attention_model, lowered, present, random_step, session

# fp32 attention over ≤ 64 slots: ORT and numpy (float64 softmax) differ by accumulation order only
ATOL = 2e-5
SHAPES = [(4, 2, 8, 16), (6, 2, 16, 40), (4, 4, 8, 24), (3, 1, 32, 64)]  # heads, kv_heads, head_dim, capacity
CHUNKS = [(0, 5), (5, 1), (6, 7), (13, 1), (14, 1)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,capacity", SHAPES)
@pytest.mark.parametrize("window", [0, 4])
def test_function_body_matches_reference(heads, kv_heads, head_dim, capacity, window):
    model = kv_attention_model(heads, kv_heads, head_dim, capacity, scale=head_dim**-0.5, window=window)
    onnx.checker.check_model(model, full_check=True)
    _run_against_reference(session(model), heads, kv_heads, head_dim, capacity, window, seed=capacity + window)


@pytest.mark.parametrize("heads,kv_heads,head_dim,capacity", SHAPES)
@pytest.mark.parametrize("window", [0, 4])
def test_gqa_lowering_matches_reference(heads, kv_heads, head_dim, capacity, window):
    model = lowered(kv_attention_model(heads, kv_heads, head_dim, capacity, scale=0.3, window=window), kv_attention_gqa)
    assert [n.op_type for n in model.graph.node].count("GroupQueryAttention") == 1
    assert "pos_cache" not in [i.name for i in model.graph.input]  # implicit for GQA: slot = position
    _run_against_reference(session(model), heads, kv_heads, head_dim, capacity, window, seed=capacity, scale=0.3)


def test_ring_slots_reuse_in_order_past_capacity():
    """Positions past capacity wrap onto the oldest slot: with a window ≤ capacity that is exact."""
    heads, kv_heads, head_dim, capacity, window = 2, 1, 8, 8, 6
    model = kv_attention_model(heads, kv_heads, head_dim, capacity, scale=0.5, window=window)
    chunks = [(0, 4), *[(p, 1) for p in range(4, 20)]]
    _run_against_reference(
        session(model), heads, kv_heads, head_dim, capacity, window, seed=1, scale=0.5, chunks=chunks
    )


def _run_against_reference(sess, heads, kv_heads, head_dim, capacity, window, seed, scale=None, chunks=CHUNKS):
    rng = np.random.default_rng(seed)
    scale = head_dim**-0.5 if scale is None else scale
    state = empty_state(kv_heads, capacity, head_dim)
    for start, count in chunks:
        q, k, v, positions = random_step(rng, heads, kv_heads, head_dim, start, count)
        feeds = dict(q=q, k=k, v=v, position_ids=positions, k_cache=state[0], v_cache=state[1], pos_cache=state[2])
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, present(sess, feeds)), strict=True))
        want = dict(
            zip(OUTPUTS, reference.kv_attention(q, k, v, positions, *state, scale=scale, window=window), strict=True)
        )
        np.testing.assert_allclose(got["out"], want["out"], atol=ATOL, rtol=0)
        for name in got.keys() - {"out"}:
            np.testing.assert_array_equal(got[name], want[name])
        state = (want["k_cache_out"], want["v_cache_out"], want["pos_cache_out"])


@pytest.mark.parametrize("lower", [None, kv_attention_gqa], ids=["function", "gqa"])
def test_in_place_io_binding_equals_separate_buffers(lower):
    """The runtime binds each cache output to its input's buffer. Prove that gives the separate-buffer result."""
    heads, kv_heads, head_dim, capacity = 4, 2, 8, 32
    model = kv_attention_model(heads, kv_heads, head_dim, capacity, scale=0.35)
    if lower is not None:
        model = lowered(model, lower)
    sess = session(model)
    rng = np.random.default_rng(7)
    aliased = empty_state(kv_heads, capacity, head_dim)
    separate = tuple(a.copy() for a in aliased)
    binding = sess.io_binding()
    binding.bind_output("out", "cpu")  # bound first, so first in get_outputs()
    graph_inputs = {i.name for i in sess.get_inputs()}
    for name, out_name, array in zip(
        ("k_cache", "v_cache", "pos_cache"), ("k_cache_out", "v_cache_out", "pos_cache_out"), aliased, strict=True
    ):
        if name not in graph_inputs:  # the GQA lowering has no pos state
            continue
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(out_name, value)
    for start, count in CHUNKS:
        q, k, v, positions = random_step(rng, heads, kv_heads, head_dim, start, count)
        for name, array in dict(q=q, k=k, v=v, position_ids=positions).items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("out", "cpu")  # re-bound each step: ORT would otherwise reuse last step's shape
        sess.run_with_iobinding(binding)
        in_place_out = binding.get_outputs()[0].numpy()
        feeds = dict(
            q=q, k=k, v=v, position_ids=positions, k_cache=separate[0], v_cache=separate[1], pos_cache=separate[2]
        )
        expected = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, present(sess, feeds)), strict=True))
        separate = tuple(expected.get(n, s) for n, s in zip(OUTPUTS[1:], separate, strict=True))
        np.testing.assert_array_equal(in_place_out, expected["out"])
        for array, name in zip(aliased, OUTPUTS[1:], strict=True):
            if name in expected:  # the numpy buffers themselves were updated in place
                np.testing.assert_array_equal(array, expected[name])
