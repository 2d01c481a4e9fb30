"""The static KVAttention body (for runtimes that need fixed shapes): every chunk padded to one length with
tokens at position -1, which must leave the cache exactly as it was and never be seen by a real query."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgec.kvcache import reference
from edgec.kvcache.function import OUTPUTS
from tests.kvcache.helpers import empty_state, kv_attention_model, random_step, session

ATOL = 2e-5
CHUNK = 8


def _padded(rng, q, k, v, positions, chunk):
    """Pad a step to ``chunk`` tokens with random garbage at position -1 (garbage, so a leak would show)."""
    pad = chunk - positions.shape[1]

    def grow(x):
        return np.concatenate([x, rng.standard_normal((*x.shape[:2], pad, x.shape[3])).astype(np.float32)], axis=2)

    return grow(q), grow(k), grow(v), np.concatenate([positions, np.full((1, pad), -1, np.int64)], axis=1)


@pytest.mark.parametrize(
    "capacity,chunks",
    [
        (32, [(0, 5), (5, 8), (13, 1), (14, 3)]),
        # capacity == chunk: the pads' slots wrap onto the real tokens of earlier chunks, which they must keep
        (8, [(0, 5), (5, 3)]),
    ],
)
@pytest.mark.parametrize("window", [0, 4])
def test_padded_chunks_match_the_unpadded_reference(capacity, chunks, window):
    heads, kv_heads, head_dim = 4, 2, 8
    model = kv_attention_model(heads, kv_heads, head_dim, capacity, scale=0.35, window=window, static=True)
    onnx.checker.check_model(model, full_check=True)
    assert "Slice" not in {node.op_type for node in model.functions[0].node}  # no data-dependent shape
    sess = session(model)
    rng = np.random.default_rng(capacity + window)
    state = empty_state(kv_heads, capacity, head_dim)
    for start, count in chunks:
        q, k, v, positions = random_step(rng, heads, kv_heads, head_dim, start, count)
        want = dict(
            zip(OUTPUTS, reference.kv_attention(q, k, v, positions, *state, scale=0.35, window=window), strict=True)
        )
        feeds = dict(zip(("q", "k", "v", "position_ids"), _padded(rng, q, k, v, positions, CHUNK), strict=True))
        got = dict(
            zip(
                OUTPUTS,
                sess.run(None, {**feeds, "k_cache": state[0], "v_cache": state[1], "pos_cache": state[2]}),
                strict=True,
            )
        )
        np.testing.assert_allclose(got["out"][:, :count], want["out"], atol=ATOL, rtol=0)
        assert np.isfinite(got["out"]).all()  # a pad's query sees nothing, yet its softmax stays finite
        for name in OUTPUTS[1:]:  # pads left every slot they touched as it was
            np.testing.assert_array_equal(got[name], want[name])
        state = (want["k_cache_out"], want["v_cache_out"], want["pos_cache_out"])


def test_padded_in_place_io_binding_equals_separate_buffers():
    """The pads read their slots (GatherElements) before the scatter writes them: still correct in place."""
    heads, kv_heads, head_dim, capacity = 4, 2, 8, 8
    sess = session(kv_attention_model(heads, kv_heads, head_dim, capacity, scale=0.35, static=True))
    rng = np.random.default_rng(3)
    aliased = empty_state(kv_heads, capacity, head_dim)
    separate = tuple(a.copy() for a in aliased)
    binding = sess.io_binding()
    binding.bind_output("out", "cpu")
    for name, out_name, array in zip(("k_cache", "v_cache", "pos_cache"), OUTPUTS[1:], aliased, strict=True):
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(out_name, value)
    for start, count in [(0, 6), (6, 1), (7, 1)]:
        feeds = dict(
            zip(
                ("q", "k", "v", "position_ids"),
                _padded(rng, *random_step(rng, heads, kv_heads, head_dim, start, count), CHUNK),
                strict=True,
            )
        )
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        sess.run_with_iobinding(binding)
        expected = sess.run(None, {**feeds, "k_cache": separate[0], "v_cache": separate[1], "pos_cache": separate[2]})
        separate = tuple(expected[1:])
        np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), expected[0])
        for array, want in zip(aliased, separate, strict=True):
            np.testing.assert_array_equal(array, want)
